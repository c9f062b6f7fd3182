#!/usr/bin/env python3
"""What the Python SDK adds to a native exec round trip, beside raw http.client.

Starts its own daemon (the release binary by default; `--binary` for
another) on a free port with its own temp state and run directories and a
network instance of its own (tests/net_instances.py), makes one sandbox, and
runs `true` in it over and over, interleaving in a rotating order:

  - raw:       http.client on one keep-alive connection, the same request the
               SDK sends (POST .../exec {"command":"true"}, with an
               Idempotency-Key header), the body parsed with json.loads;
  - sdk:       `sandbox.exec("true")` of the sync client (`hutch.Hutch`);
  - raw-nokey: the raw request without the Idempotency-Key (what the daemon
               spends journaling the key, for reference).

Then the async client (`await sandbox.exec("true")`) interleaved with raw in
one coroutine. Prints median and p95 of each and the SDK's overhead: the
median of the per-round differences sdk - raw (goal: at most 0.3 ms).

Run as root:
    cargo build --release -p hutch -p hutch-agent
    pip install ./sdk/python
    python3 bench/sdk_bench.py [--rounds 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, List

import httpx

REPO = Path(__file__).resolve().parents[1]
GOAL_MS = 0.3

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import RELEASE, Daemon, pct  # noqa: E402

try:
    import hutch
except ImportError:  # not installed: the source tree's
    sys.path.insert(0, str(REPO / "sdk" / "python" / "src"))
    import hutch


class Raw:
    """The floor: one keep-alive http.client connection."""

    def __init__(self, port: int, key: str, sandbox_id: str):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.path = f"/v1/sandboxes/{sandbox_id}/exec"
        self.headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        self.body = json.dumps({"command": "true"})

    def exec(self, with_key: bool = True) -> None:
        headers = {**self.headers, "Idempotency-Key": uuid.uuid4().hex} if with_key else self.headers
        self.conn.request("POST", self.path, self.body, headers)
        r = self.conn.getresponse()
        out = json.loads(r.read())
        if r.status != 200 or out["exit_code"] != 0:
            raise RuntimeError(f"raw exec: {r.status} {out}")


def report(title: str, series: Dict[str, List[float]], base: str = "raw") -> float:
    print(f"\n{title}: {len(series[base])} rounds")
    print(f"  {'ms':10} {'median':>8} {'p95':>8}")
    for name, xs in series.items():
        print(f"  {name:10} {statistics.median(xs) * 1000:8.3f} {pct(xs, 95) * 1000:8.3f}")
    over = {}
    for name, xs in series.items():
        if name.startswith("sdk"):
            diffs = [a - b for a, b in zip(xs, series[base])]
            over[name] = statistics.median(diffs) * 1000
            print(f"  {name} - {base}: median of the per-round differences {over[name]:+.3f} ms "
                  f"(difference of medians {(statistics.median(xs) - statistics.median(series[base])) * 1000:+.3f})")
    return max(over.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--binary", type=Path, default=RELEASE)
    args = ap.parse_args()

    d = Daemon(args.binary)
    client = hutch.Hutch(d.base, d.key)
    sb = client.sandboxes.create(ttl="30m")
    try:
        raw = Raw(d.port, d.key, sb.id)
        fns: Dict[str, Callable[[], object]] = {
            "raw": raw.exec,
            "sdk": lambda: sb.exec("true"),
            "raw-nokey": lambda: raw.exec(with_key=False),
        }
        for f in fns.values():
            for _ in range(args.warmup):
                f()
        series: Dict[str, List[float]] = {k: [] for k in fns}
        cpu: Dict[str, List[float]] = {k: [] for k in fns}
        order = list(fns)
        for i in range(args.rounds):
            k = i % len(order)
            for name in order[k:] + order[:k]:
                c = time.process_time()
                t = time.perf_counter()
                fns[name]()
                series[name].append(time.perf_counter() - t)
                cpu[name].append(time.process_time() - c)
        print(f"hutch {hutch.__version__} (httpx {httpx.__version__}), daemon {args.binary}, sandbox {sb.id}, "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        worst = report("sync: exec `true`, interleaved", series)
        print("  this process's CPU time per call (what the client itself spends), mean:")
        for name, xs in cpu.items():
            print(f"  {name:10} {statistics.fmean(xs) * 1000:8.3f} ms")

        async def run_async() -> Dict[str, List[float]]:
            async with hutch.AsyncHutch(d.base, d.key) as ac:
                asb = await ac.sandboxes.get(sb.id)
                for _ in range(args.warmup):
                    await asb.exec("true")
                s: Dict[str, List[float]] = {"raw": [], "sdk-async": []}
                for i in range(args.rounds):
                    pair = ["raw", "sdk-async"] if i % 2 == 0 else ["sdk-async", "raw"]
                    for name in pair:
                        t = time.perf_counter()
                        if name == "raw":
                            raw.exec()
                        else:
                            await asb.exec("true")
                        s[name].append(time.perf_counter() - t)
                return s

        worst_async = report("async: exec `true`, interleaved (one event loop)", asyncio.run(run_async()))
        verdict = "meets" if worst <= GOAL_MS else "MISSES"
        print(f"\nsync SDK overhead {worst:.3f} ms: {verdict} the goal of at most {GOAL_MS} ms "
              f"(async {worst_async:.3f} ms)")
    finally:
        try:
            sb.delete()
        finally:
            client.close()
            d.stop()


if __name__ == "__main__":
    main()
