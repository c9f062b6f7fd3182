#!/usr/bin/env python3
"""What `hutch serve --wake-hold` buys: exec round trips (`true`) against
two release daemons started side by side, one with `--wake-hold 20ms` and
one without, in alternating blocks from one client, so that the host's
drift falls on both alike. Prints each one's median and p90 and their
ratio.

Where idle CPUs halt (a VM's vCPU then leaves for its hypervisor), a
command's wakeups pay for it; with the hold, idle CPUs poll while calls
run. Run as root after `cargo build --release -p hutch -p hutch-agent`:
    python3 bench/wake_bench.py [--blocks 8 --per-block 150]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import RELEASE, Daemon, pct  # noqa: E402
from fast_bench import create, exec_rts  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", type=Path, default=RELEASE)
    ap.add_argument("--blocks", type=int, default=8, help="blocks per daemon, alternating")
    ap.add_argument("--per-block", type=int, default=150)
    ap.add_argument("--hold", default="20ms")
    a = ap.parse_args()
    daemons = {"without": Daemon(a.binary), f"--wake-hold {a.hold}": Daemon(a.binary, args=["--wake-hold", a.hold])}
    try:
        runs: dict[str, list[float]] = {name: [] for name in daemons}
        targets = {}
        for name, d in daemons.items():
            s = d.session()
            targets[name] = (s, d.base, create(s, d.base, {"ttl_seconds": 600})["id"])

        def block(name: str) -> list[float]:
            # The first of a block wake from the other daemon's turn.
            return exec_rts(*targets[name], a.per_block)[10:]

        for _ in range(a.blocks):
            for name in daemons:
                runs[name].extend(block(name))
        base = statistics.median(runs["without"])
        print("| exec round trip (`true`) | median | p90 | vs without |\n|---|---:|---:|---:|")
        for name, xs in runs.items():
            med = statistics.median(xs)
            print(f"| {name} | {med * 1000:.2f} ms | {pct(xs, 90) * 1000:.2f} ms | {med / base:.2f}x |")
    finally:
        for d in daemons.values():
            d.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
