#!/usr/bin/env bash
# Runs every fuzz target under fuzz/ (cargo-fuzz, libFuzzer) for a bounded
# time: builds them all once, then runs each from its committed seeds
# (fuzz/corpus/<target>, read only) into a scratch corpus. Any crash, panic,
# timeout or out-of-memory fails the script; libFuzzer leaves the input that
# did it in fuzz/artifacts/<target>/ (replay: cargo +nightly fuzz run -a
# <target> <file>).
#
#   bash scripts/fuzz.sh [seconds per target, default 20] [target...]
#
# Needs the nightly toolchain (sanitizer flags); without one, the stable
# compiler is told to accept them (RUSTC_BOOTSTRAP=1). Installs cargo-fuzz
# when it is missing. scripts/test.sh runs this as part of CI.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-20}
shift || true
case $seconds in
    '' | *[!0-9]*)
        echo "fuzz.sh: the time per target is a number of seconds, not '$seconds'" >&2
        exit 2
        ;;
esac

if ! command -v cargo-fuzz >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi
if rustup run nightly rustc --version >/dev/null 2>&1; then
    fuzz=(cargo +nightly fuzz)
else
    echo "fuzz.sh: no nightly toolchain; building with the stable one and RUSTC_BOOTSTRAP=1" >&2
    export RUSTC_BOOTSTRAP=1
    fuzz=(cargo fuzz)
fi

# -a: debug assertions on, so that an arithmetic overflow is a crash too.
start=$(date +%s)
"${fuzz[@]}" build -a
built=$(date +%s)
echo "fuzz: built every target in $((built - start)) s"

if [ $# -gt 0 ]; then
    targets=("$@")
else
    mapfile -t targets < <("${fuzz[@]}" list)
fi

# The binaries just built, run as they are (`cargo fuzz run` would rebuild
# first whenever a source changed meanwhile).
bin="fuzz/target/$(rustc -vV | sed -n 's/^host: //p')/release"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# The targets run side by side, one per core (HUTCH_FUZZ_JOBS to change):
# each libFuzzer process is single-threaded, so on CI's two cores this
# halves the step's time without shortening any target's run.
jobs=${HUTCH_FUZZ_JOBS:-$(nproc)}
fuzz_one() {
    local t=$1
    mkdir -p "$scratch/$t" "fuzz/corpus/$t" "fuzz/artifacts/$t"
    if "$bin/$t" "$scratch/$t" "fuzz/corpus/$t" -artifact_prefix="fuzz/artifacts/$t/" \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        >"$scratch/$t.log" 2>&1; then
        touch "$scratch/$t.passed"
    fi
}
running=0
for t in "${targets[@]}"; do
    if [ "$running" -ge "$jobs" ]; then
        wait -n || true
        running=$((running - 1))
    fi
    echo "fuzz: $t for ${seconds} s"
    fuzz_one "$t" &
    running=$((running + 1))
done
wait
passed=0
failed=()
for t in "${targets[@]}"; do
    if [ -e "$scratch/$t.passed" ]; then
        passed=$((passed + 1))
        grep -E '^stat::number_of_executed_units' "$scratch/$t.log" | sed "s/^/fuzz: $t: /" || true
    else
        failed+=("$t")
        tail -n 60 "$scratch/$t.log"
    fi
done
echo "fuzz: ran ${#targets[@]} targets ${seconds} s each in $(($(date +%s) - built)) s"
if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzz: failed: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
fi
echo "fuzz: ${passed} passed, ${#failed[@]} failed"
[ ${#failed[@]} -eq 0 ]
