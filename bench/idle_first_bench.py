#!/usr/bin/env python3
"""The first command after a pause, and its peer after the same pause.

A sandbox's first command after it sat idle is slower than the next ones
(README, "Warm pools and images"). This bench says how much of that is
hutch's: for each pause (0, 0.3 and 1 s) it makes a sandbox, waits, and
runs `true` three times in a row, and it times a bare fork+exec of
/bin/true from this process three times in a row after the same pause.
Prints the medians of the first, second and third of each: the client's
time for hutch, with the server's (`Server-Timing` total) beside it.

Run as root:
    cargo build --release && python3 bench/idle_first_bench.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import RELEASE, TIMEOUT, Daemon, check  # noqa: E402
from class_bench import server_timing  # noqa: E402
from fast_bench import spawn  # noqa: E402

PAUSES = (0.0, 0.3, 1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", type=Path, default=RELEASE)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    d = Daemon(args.binary)
    try:
        s = d.session()
        body = json.dumps({"argv": ["true"]})
        print(f"hutch serve {args.binary}; {args.rounds} rounds per pause; medians in ms of the 1st / 2nd / 3rd")
        print(f"  {'pause':>6}  {'hutch exec, client':>22}  {'hutch exec, server':>22}  {'peer: fork+exec':>22}")
        for pause in PAUSES:
            client, server, peer = [], [], []
            for _ in range(args.rounds):
                sb = check(s.post(d.base + "/v1/sandboxes", data="{}", timeout=TIMEOUT), 201)
                time.sleep(pause)
                c, v = [], []
                for _ in range(3):
                    t = time.perf_counter()
                    r = s.post(f"{d.base}/v1/sandboxes/{sb['id']}/exec", data=body, timeout=TIMEOUT)
                    c.append((time.perf_counter() - t) * 1000)
                    if check(r, 200)["exit_code"] != 0:
                        raise RuntimeError(f"`true` failed: {r.text[:300]}")
                    v.append(server_timing(r)["total"] * 1000)
                client.append(c)
                server.append(v)
                check(s.delete(f"{d.base}/v1/sandboxes/{sb['id']}", timeout=TIMEOUT), 200)
                time.sleep(pause)
                peer.append([spawn(["/bin/true"]) * 1000 for _ in range(3)])

            def meds(rows: list[list[float]]) -> str:
                return " / ".join(f"{statistics.median(r[i] for r in rows):.2f}" for i in range(3))

            print(f"  {pause:5.1f}s  {meds(client):>22}  {meds(server):>22}  {meds(peer):>22}")
        return 0
    finally:
        d.stop()


if __name__ == "__main__":
    sys.exit(main())
