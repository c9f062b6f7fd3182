#!/usr/bin/env bash
# The whole test suite, from a fresh Debian machine with the Rust toolchain:
# installs what the tests need, builds everything, runs every test as root.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
    echo "test.sh: the tests make real namespaces and cgroups; run as root" >&2
    exit 1
fi

# Tools the sandboxed probes use (the base template is the host's /usr), and
# what the network tests need (nft to read and compare tables, ip; the
# daemon itself needs neither).
need=()
# Images: mmdebstrap builds the Debian presets; docker-registry serves pulls
# in the image tests (each test starts its own on a free loopback port; the
# package's own service is not used). Node and npm run the E2B JavaScript
# SDK's suite (tests/e2b-js) and the MCP server's run_code in node
# (tests/api/test_mcp.py). btrfs-progs: the test that the
# committed btrfs seed is what scripts/make-btrfs-seed.sh makes (the daemon
# never runs mkfs.btrfs). Chromium is the
# headless browser the web console's tests drive (tests/api/test_console.py,
# through Playwright with this browser: Playwright's own are never fetched).
# umoci (6 MB, libc only) unpacks exported snapshots as another OCI
# implementation reads them (tests/api/test_snapshot_export.py).
# systemd-analyze verifies the service unit (crates/hutch/tests/install.rs).
# openssl makes the test CA of the secrets tests (tests/api/test_secrets.py).
for pkg_cmd in python3:python3 procps:pgrep util-linux:unshare mount:mount coreutils:sha256sum \
    nftables:nft iproute2:ip mmdebstrap:mmdebstrap docker-registry:docker-registry \
    nodejs:node npm:npm btrfs-progs:mkfs.btrfs chromium:chromium umoci:umoci systemd:systemd-analyze openssl:openssl runsc:runsc; do
    pkg=${pkg_cmd%%:*} cmd=${pkg_cmd##*:}
    found=
    for dir in /usr/bin /bin /usr/sbin /sbin; do
        [ -x "$dir/$cmd" ] && found=1
    done
    [ -n "$found" ] || need+=("$pkg")
done
# PostgreSQL (Debian 12: 15): the store's tests run on it as well as on
# SQLite, in a throwaway cluster of their own (scripts/pg-scratch.sh), and
# tests/api/test_fleet.py runs two daemons on one database in another.
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi

# Python packages of the end-to-end suite of hutch serve.
python3 -m pip install --quiet --disable-pip-version-check -r tests/api/requirements.txt

# The web console's front-end packages (xterm.js), as pinned in its
# package-lock.json: the daemon's build embeds them (crates/hutch-server/
# build.rs; without them its terminal says it was built without xterm).
(cd console && npm ci --no-audit --no-fund --loglevel=error)
cargo build --workspace --all-targets
# The deployment files (deploy/: the Helm chart, rendered here by the
# test's own template evaluator, its plain manifests, the Nomad job, the
# systemd unit), checked as data against `hutch serve`'s flags and
# variables: there is no helm, nomad or cluster here. A second or so.
python3 -m pip install --quiet --disable-pip-version-check -r tests/deploy/requirements.txt
python3 -m pytest tests/deploy -q -p no:cacheprovider
# A private PostgreSQL cluster (a temporary directory, a unix socket there,
# no TCP port) for the store's tests on PostgreSQL: HUTCH_TEST_POSTGRES
# names it; it is stopped and removed when this script exits.
source scripts/pg-scratch.sh
trap pg_scratch_stop EXIT
cargo test --workspace -- --test-threads=2
pg_scratch_stop
# The escape probes again, in the gvisor class (runsc).
HUTCH_TEST_CLASS=gvisor cargo test -p hutch --test escape -- --test-threads=2
# Every parser of untrusted bytes, fuzzed for a bounded time (fuzz/).
bash scripts/fuzz.sh "${HUTCH_FUZZ_SECONDS:-20}"
# The E2B JavaScript SDK's packages, as pinned in its package-lock.json; the
# SDK wants Node 20.18.1 or newer (not 21): with an older Node (Debian 12
# ships 18), npm's `node` package puts a pinned one in tests/e2b-js/.node,
# first on PATH for the suite (tests/e2b/test_js.py runs it).
python3 -m pip install --quiet --disable-pip-version-check -r tests/e2b/requirements.txt
(cd tests/e2b-js && npm ci --no-audit --no-fund --loglevel=error)
if ! node -e 'const [a, b, c] = process.versions.node.split(".").map(Number);
    process.exit(a >= 22 || (a === 20 && (b > 18 || (b === 18 && c >= 1))) ? 0 : 1)'; then
    npm install --prefix tests/e2b-js/.node --no-save --no-audit --no-fund --loglevel=error node@22.23.3
    export PATH="$PWD/tests/e2b-js/.node/node_modules/.bin:$PATH"
fi
# The Python SDK, installed as a user would (pip install ./sdk/python), with
# its test extras; its suite starts one daemon of its own for the session.
python3 -m pip install --quiet --disable-pip-version-check './sdk/python[test]'

# The end-to-end suites run two at a time: each starts daemons of its own
# (state directories, network instances and ports apart; see the
# conftest.py files), and much of their time is spent waiting on sandboxes,
# so on CI's two cores a pair takes little more than its longer half. Each
# half writes to a log of its own, printed whole once it has ended; the
# step fails if either half failed.
side_by_side() {
    local logs pids=() rc=0 i ok
    logs=$(mktemp -d)
    for i in 1 2; do
        bash -c "${!i}" >"$logs/$i" 2>&1 &
        pids+=($!)
    done
    for i in 1 2; do
        ok=1
        wait "${pids[$((i - 1))]}" || ok=
        echo "=== ${!i}"
        cat "$logs/$i"
        if [ -z "$ok" ]; then
            echo "test.sh: failed: ${!i}"
            rc=1
        fi
    done
    rm -rf "$logs"
    return $rc
}

# The native API's suite beside the E2B suite (both SDKs) and then our own
# Python SDK's.
side_by_side \
    'python3 -m pytest tests/api -q -p no:cacheprovider' \
    'python3 -m pytest tests/e2b -q -p no:cacheprovider && python3 -m pytest sdk/python/tests -q -p no:cacheprovider'
# Both API suites again with gvisor (runsc, ptrace platform) as the
# daemons' default class (HUTCH_TEST_CLASS: `hutch serve --default-class`,
# so `base` and every template made without a class run under runsc; see
# the conftest.py files): the whole E2B suite, and of the native one the
# files whose routes reach into the sandbox: commands (test_exec), their
# processes and slots (test_processes), terminals (test_pty), files
# (test_files), pause (test_pause) and snapshots and fork (test_snapshots).
# The rest of the native suite (keys, tenants, templates, images, builds,
# fleet, console, ...) exercises the control plane, the same for every
# class, and the gvisor-specific routes have tests/api/test_gvisor.py in the
# run above. What the class does not do is marked in the tests
# (`on_class("gvisor", ...)`). Measured on the 2-core test host
# (2026-12-02, shared with other builds): E2B 9 min and these six files
# 11 min, each alone (ptrace gVisor: ~0.4 s per create and first exec,
# ~0.25 s per exec). Since the agent's close_range fix and runsc's
# reaper (2026-12-03) an exec is ~20-30 ms and a create and first exec
# ~0.2 s: side by side, E2B 4 min 55 s and these six files 4 min 15 s.
side_by_side \
    'HUTCH_TEST_CLASS=gvisor python3 -m pytest tests/e2b -q -p no:cacheprovider' \
    'HUTCH_TEST_CLASS=gvisor python3 -m pytest tests/api/test_exec.py tests/api/test_processes.py tests/api/test_pty.py tests/api/test_files.py tests/api/test_pause.py tests/api/test_snapshots.py -q -p no:cacheprovider'
