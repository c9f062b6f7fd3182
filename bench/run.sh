#!/usr/bin/env bash
# Installs the peers hutch is compared with (if missing), builds the release
# binaries and runs sandbox-bench with this script's arguments, e.g.
#   bash bench/run.sh --iters 100
# Needs root (namespaces, cgroups, runc, apt).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Runs an apt-get command, waiting while another apt/dpkg holds its locks.
apt_get() {
    local tries=0
    until apt-get -o DPkg::Lock::Timeout=600 "$@"; do
        tries=$((tries + 1))
        if ((tries >= 60)); then
            echo "run.sh: apt-get $* kept failing" >&2
            return 1
        fi
        echo "run.sh: apt-get $* failed (locked by another apt?); retrying in 5 s" >&2
        sleep 5
    done
}

missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v runc >/dev/null 2>&1 || missing+=(runc)
command -v podman >/dev/null 2>&1 || missing+=(podman)
if ((${#missing[@]} > 0)); then
    echo "run.sh: installing ${missing[*]}" >&2
    apt_get update
    export DEBIAN_FRONTEND=noninteractive
    apt_get install -y "${missing[@]}"
fi

cargo build --release -p hutch -p hutch-agent -p hutch-bench

# .cargo/config.toml pins the target triple, so binaries land under it.
exec "${CARGO_TARGET_DIR:-target}/x86_64-unknown-linux-gnu/release/sandbox-bench" "$@"
