#!/usr/bin/env bash
# Installs hutch as a system service, from a checkout of the repository:
#
#   sudo bash scripts/install.sh
#
# builds the static binaries (`cargo build --release`: .cargo/config.toml
# links them with -C target-feature=+crt-static) unless HUTCH_BINARY_DIR
# names a directory holding `hutch` and `hutch-agent` already built; copies
# them to $PREFIX/bin (default /usr/local/bin); installs
# deploy/systemd/hutch.service to $UNIT_DIR (default /etc/systemd/system),
# naming that binary; then enables and starts it, and prints where the admin
# key is. Run it again to upgrade: the service is restarted on the new
# binary, its state (/var/lib/hutch) kept.
#
# DESTDIR=/some/dir installs under that directory instead and starts
# nothing (packaging, and the test suite); NO_START=1 installs without
# enabling or starting the service.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PREFIX=${PREFIX:-/usr/local}
UNIT_DIR=${UNIT_DIR:-/etc/systemd/system}
DESTDIR=${DESTDIR:-}
NO_START=${NO_START:-}
STATE_DIR=/var/lib/hutch
TRIPLE=x86_64-unknown-linux-gnu

say() { printf 'hutch install: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

if [ -z "$DESTDIR" ] && [ "$(id -u)" -ne 0 ]; then
    die "run as root (sudo bash $0), or set DESTDIR to install under a directory"
fi

bin_dir=${HUTCH_BINARY_DIR:-}
if [ -z "$bin_dir" ]; then
    command -v cargo >/dev/null || die "cargo not found: install the Rust toolchain (https://rustup.rs), or set HUTCH_BINARY_DIR"
    say "building the release binaries (cargo build --release)"
    (cd "$REPO" && cargo build --release -p hutch -p hutch-agent)
    bin_dir=$REPO/target/$TRIPLE/release
fi
for b in hutch hutch-agent; do
    [ -x "$bin_dir/$b" ] || die "$bin_dir/$b is missing or not executable"
done

bin=$PREFIX/bin
install -d -m 0755 "$DESTDIR$bin" "$DESTDIR$UNIT_DIR"
# Copied beside the running ones, then renamed over them: a running
# daemon keeps its binary, and no half-written file is ever executed.
for b in hutch hutch-agent; do
    install -m 0755 "$bin_dir/$b" "$DESTDIR$bin/.$b.new"
    mv -f "$DESTDIR$bin/.$b.new" "$DESTDIR$bin/$b"
done
sed "s|/usr/local/bin/hutch|$bin/hutch|g" "$REPO/deploy/systemd/hutch.service" >"$DESTDIR$UNIT_DIR/.hutch.service.new"
chmod 0644 "$DESTDIR$UNIT_DIR/.hutch.service.new"
mv -f "$DESTDIR$UNIT_DIR/.hutch.service.new" "$DESTDIR$UNIT_DIR/hutch.service"
say "installed $DESTDIR$bin/hutch, $DESTDIR$bin/hutch-agent and $DESTDIR$UNIT_DIR/hutch.service"

if [ -n "$DESTDIR" ] || [ -n "$NO_START" ]; then
    say "not started; on the target host: systemctl daemon-reload && systemctl enable --now hutch"
    exit 0
fi
command -v systemctl >/dev/null || die "systemctl not found: start it by hand with $bin/hutch serve"

systemctl daemon-reload
systemctl enable hutch.service >/dev/null
systemctl restart hutch.service
# The daemon writes the admin key once its store is open.
for _ in $(seq 1 100); do
    [ -s "$STATE_DIR/admin.key" ] && break
    systemctl is-active --quiet hutch.service || break
    sleep 0.1
done
if ! systemctl is-active --quiet hutch.service; then
    journalctl -u hutch.service -n 30 --no-pager >&2 || true
    die "the service did not stay up (journalctl -u hutch)"
fi
"$bin/hutch" doctor --state-dir "$STATE_DIR" >&2 || say "hutch doctor found something to fix (above)"
cat <<EOT
hutch is running as the systemd service hutch.service, on http://127.0.0.1:7700.
The admin API key is in $STATE_DIR/admin.key (root only, mode 0600):

  export HUTCH_URL=http://127.0.0.1:7700 HUTCH_API_KEY=\$(sudo cat $STATE_DIR/admin.key)
  hutch sandbox create

Logs: journalctl -u hutch -f. Listen elsewhere: systemctl edit hutch (ExecStart=).
EOT
