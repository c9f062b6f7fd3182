#!/usr/bin/env python3
"""What a network costs a sandbox, measured against no network in the same run.

Starts its own release daemon (see api_bench.py) and creates sandboxes in
interleaved rounds, one with `{"egress": "deny_all"}` (a namespace with only
`lo`, no veth, no policy: the same as before networking existed) and one with
`{"egress": "default"}` (a pooled namespace with a veth, addresses, routes,
and its policy's set elements added over netlink), then the same with a
domain allow list. Each round: create -> first exec of `true` -> delete.
Prints median and p95 of create and of create -> first exec, and the
difference of the medians.

Bar: a sandbox with a network creates in at most 5 ms more than one
without, at the median.

Run as root:
    cargo build --release && python3 bench/net_bench.py [--rounds 100]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from api_bench import Daemon, RELEASE, check, ms, pct

BAR_MS = 5.0

POLICIES = {
    "none (deny_all)": {"egress": "deny_all"},
    "default": {"egress": "default"},
    "allow list": {"egress": "default", "allow": ["pypi.org", "*.github.com", "203.0.113.0/24"]},
}


def one(s, base: str, network: dict) -> tuple[float, float]:
    body = json.dumps({"ttl_seconds": 600, "network": network})
    t0 = time.perf_counter()
    sb = check(s.post(base + "/v1/sandboxes", data=body), 201)
    t1 = time.perf_counter()
    res = check(s.post(f"{base}/v1/sandboxes/{sb['id']}/exec", data='{"argv":["true"]}'), 200)
    t2 = time.perf_counter()
    if res["exit_code"] != 0 or sb["network"]["applied"] != network["egress"]:
        raise RuntimeError(f"unexpected sandbox: {sb} / {res}")
    check(s.delete(f"{base}/v1/sandboxes/{sb['id']}"), 200)
    return t1 - t0, t2 - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--pause", type=float, default=0.02, help="seconds between creates")
    args = ap.parse_args()
    d = Daemon(RELEASE)
    try:
        s = d.session()
        for net in POLICIES.values():  # warm up: binary pages, pools, caches
            for _ in range(5):
                one(s, d.base, net)
        results: dict[str, list[tuple[float, float]]] = {k: [] for k in POLICIES}
        for _ in range(args.rounds):
            for name, net in POLICIES.items():
                results[name].append(one(s, d.base, net))
                time.sleep(args.pause)
        print(f"network cost at create: {args.rounds} rounds, interleaved, release build")
        print(f"  {'ms':22} {'create med':>10} {'p95':>8} {'->exec med':>10} {'p95':>8}")
        med = {}
        for name, rs in results.items():
            c = [r[0] for r in rs]
            e = [r[1] for r in rs]
            med[name] = statistics.median(c)
            print(f"  {name:22} {ms(statistics.median(c)):>10} {ms(pct(c, 95))} "
                  f"{ms(statistics.median(e)):>10} {ms(pct(e, 95))}")
        base = med["none (deny_all)"]
        ok = True
        for name in ("default", "allow list"):
            extra = (med[name] - base) * 1000
            ok &= extra <= BAR_MS
            print(f"  {name}: +{extra:.2f} ms at the median (bar: <= {BAR_MS} ms)")
        print("bar met" if ok else "bar MISSED")
        return 0
    finally:
        d.stop()


if __name__ == "__main__":
    sys.exit(main())
