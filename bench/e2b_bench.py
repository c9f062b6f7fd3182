#!/usr/bin/env python3
"""Create plus first command through the unmodified E2B SDK beside the
same flow through hutch's native API, in one run against one daemon.

Starts its own release daemon (the Daemon of api_bench.py), makes an E2B
key with `hutch key create --e2b`, points the SDK at the daemon with
E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY, then for each round times:

- e2b:    Sandbox.create() + commands.run("true") (the kill is not timed)
- native: POST /v1/sandboxes + POST .../exec argv ["true"] on a keep-alive
          http.client connection (the delete is not timed)

The two flows alternate round by round so both see the same machine.
Prints median and p95 of each, and their difference.

    cargo build --release && python3 bench/e2b_bench.py [--rounds 50]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import RELEASE, TIMEOUT, Daemon, check, ms, pct  # noqa: E402

WARMUP = 3


def e2b_round(Sandbox) -> tuple[float, float]:
    t0 = time.perf_counter()
    sb = Sandbox.create()
    t1 = time.perf_counter()
    r = sb.commands.run("true")
    t2 = time.perf_counter()
    if r.exit_code != 0:
        raise RuntimeError(f"`true` exited {r.exit_code}")
    sb.kill()
    return t1 - t0, t2 - t1


def native_round(s, base: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    sb = check(s.post(base + "/v1/sandboxes", data='{"ttl_seconds":600}', timeout=TIMEOUT), 201)
    t1 = time.perf_counter()
    res = check(s.post(f"{base}/v1/sandboxes/{sb['id']}/exec", data='{"argv":["true"]}', timeout=TIMEOUT), 200)
    t2 = time.perf_counter()
    if res["exit_code"] != 0:
        raise RuntimeError(f"`true` exited {res['exit_code']}")
    check(s.delete(f"{base}/v1/sandboxes/{sb['id']}", timeout=TIMEOUT), 200)
    return t1 - t0, t2 - t1


def row(name: str, xs: list[float]) -> str:
    return f"{name:<34} {ms(pct(xs, 50))} {ms(pct(xs, 95))}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=50)
    args = ap.parse_args()
    d = Daemon(RELEASE)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HUTCH_")}
        out = subprocess.run(
            [str(RELEASE), "key", "create", "--e2b", "--json", "--name", "e2b-bench",
             "--state-dir", str(d.root / "state")],
            env=env, capture_output=True, text=True, timeout=30, check=True,
        )
        os.environ.update({"E2B_API_URL": d.base, "E2B_SANDBOX_URL": d.base,
                           "E2B_API_KEY": json.loads(out.stdout)["secret"]})
        os.environ.pop("E2B_DOMAIN", None)
        from e2b import Sandbox

        s = d.session()
        for _ in range(WARMUP):
            e2b_round(Sandbox)
            native_round(s, d.base)
        e2b, native = [], []
        for _ in range(args.rounds):
            e2b.append(e2b_round(Sandbox))
            native.append(native_round(s, d.base))
        print(f"{args.rounds} rounds each, alternating; ms")
        print(f"{'':<34} {'median':>8} {'p95':>8}")
        for name, rounds in (("e2b SDK", e2b), ("native API", native)):
            print(row(f"{name}: create", [c for c, _ in rounds]))
            print(row(f"{name}: first command", [x for _, x in rounds]))
            print(row(f"{name}: create + first command", [c + x for c, x in rounds]))
        gap = [(a + b) - (c + x) for (a, b), (c, x) in zip(e2b, native)]
        print(row("e2b minus native (paired)", gap))
    finally:
        d.stop()


if __name__ == "__main__":
    main()
