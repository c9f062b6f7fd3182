#!/usr/bin/env python3
"""Isolation classes side by side, in one run of one release daemon:
`container` and `process` (a template of each, same limits).

For each class prints:
  - create -> first exec (`true`) -> delete, 200 sequential rounds:
    median / p95 of create, of create -> first exec, and of delete
    (client-side, keep-alive http.client: the HTTP floor, GET /healthz,
    is printed too), and, from the daemon's `Server-Timing` header, the
    server's time for the create (with its phases) and for the exec;
  - the same rounds from a template of the class with a warm pool
    (`--warm-rounds`, each create waits until the pool has a ready
    sandbox, so each is a claim), beside the peer: a fork+exec of
    /bin/true from this process, in the same run;
  - 1,000 sandboxes created, each running `true`, and deleted, by 8 client
    threads: the wall time, and the daemon's CPU time (user + system, all
    its threads) per sandbox.

Goals (issue 14): process class create -> first exec <= 1 ms server-side,
and 1,000 in <= 1 s. Run as root:
    cargo build --release && python3 bench/class_bench.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import RELEASE, TIMEOUT, Daemon, check, ms, pct  # noqa: E402
from fast_bench import spawn  # noqa: E402
from warm_bench import wait_ready  # noqa: E402


def server_timing(resp) -> dict[str, float]:
    """The daemon's `Server-Timing` header: phase -> seconds."""
    out = {}
    for part in resp.headers.get("Server-Timing", "").split(","):
        name, _, dur = part.strip().partition(";dur=")
        if name and dur:
            out[name] = float(dur) / 1000
    return out


def round_trip(s, base: str, body: str) -> tuple[float, float, float, dict[str, float], dict[str, float]]:
    """Client seconds of create, create -> first exec, delete; and the
    server's phases of the create and of the exec."""
    t0 = time.perf_counter()
    r = s.post(base + "/v1/sandboxes", data=body, timeout=TIMEOUT)
    sb = check(r, 201)
    t1 = time.perf_counter()
    x = s.post(f"{base}/v1/sandboxes/{sb['id']}/exec", data='{"argv":["true"]}', timeout=TIMEOUT)
    res = check(x, 200)
    t2 = time.perf_counter()
    if res["exit_code"] != 0:
        raise RuntimeError(f"`true` exited {res['exit_code']}: {res}")
    check(s.delete(f"{base}/v1/sandboxes/{sb['id']}", timeout=TIMEOUT), 200)
    return t1 - t0, t2 - t0, time.perf_counter() - t2, server_timing(r), server_timing(x)


def server_rows(rounds) -> list[tuple[str, list[float]]]:
    """Server-side rows (empty when the daemon sends no Server-Timing)."""
    creates, execs = [r[3] for r in rounds], [r[4] for r in rounds]
    if not all("total" in c for c in creates) or not all("total" in e for e in execs):
        return []
    rows = [("server: create", [c["total"] for c in creates])]
    for phase in creates[0]:
        if phase != "total" and all(phase in c for c in creates):
            rows.append((f"server:   {phase}", [c[phase] for c in creates]))
    rows.append(("server: exec", [e["total"] for e in execs]))
    rows.append(("server: create + exec", [c["total"] + e["total"] for c, e in zip(creates, execs)]))
    return rows


def warm_rounds(s, base: str, cls: str, n: int) -> list:
    """n rounds, each claiming from a warm pool of 2 (waited for)."""
    tpl = check(s.post(base + "/v1/templates", data=json.dumps(
        {"name": f"bench-{cls}-warm", "class": cls, "memory_mb": 256, "limits": {"pids": 64},
         "warm": {"min": 2, "max": 2}}), timeout=TIMEOUT), 201)
    body = json.dumps({"template": tpl["name"], "ttl_seconds": 600})

    try:
        out = []
        for _ in range(n):
            wait_ready(s, base, tpl["id"], 1, timeout=60)
            out.append(round_trip(s, base, body))
            if "claim" not in out[-1][3]:
                raise RuntimeError(f"{cls}: a create did not claim from the pool: {out[-1][3]}")
        return out
    finally:
        s.delete(f"{base}/v1/templates/{tpl['id']}", timeout=TIMEOUT)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its threads so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", type=Path, default=RELEASE)
    ap.add_argument("--sequential", type=int, default=200)
    ap.add_argument("--fanout", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--classes", default="container,process")
    ap.add_argument("--warm-rounds", type=int, default=100, help="rounds from a warm pool per class (0: none)")
    args = ap.parse_args()
    # A network instance no other daemon on this host holds: Daemon claims one.
    d = Daemon(args.binary)
    try:
        s = d.session()
        health = []
        for _ in range(200):
            t = time.perf_counter()
            s.get(d.base + "/healthz", timeout=TIMEOUT).raise_for_status()
            health.append(time.perf_counter() - t)
        print(f"hutch serve {args.binary}; HTTP floor (GET /healthz) median {ms(statistics.median(health))} ms")
        results = {}
        for cls in args.classes.split(","):
            tpl = check(s.post(d.base + "/v1/templates", data=json.dumps(
                {"name": f"bench-{cls}", "class": cls, "memory_mb": 256, "limits": {"pids": 64}}), timeout=TIMEOUT), 201)
            body = json.dumps({"template": tpl["name"], "ttl_seconds": 600})
            # Warm-up (the process class's host container is made here).
            keep = check(s.post(d.base + "/v1/sandboxes", data=body, timeout=TIMEOUT), 201)
            for _ in range(5):
                round_trip(s, d.base, body)
            rounds = [round_trip(s, d.base, body) for _ in range(args.sequential)]
            print(f"\n{cls}: {len(rounds)} sequential rounds")
            print(f"  {'ms':24} {'median':>8} {'p95':>8}")
            for i, name in enumerate(("create", "create -> first exec", "delete")):
                xs = [r[i] for r in rounds]
                print(f"  {name:24} {ms(statistics.median(xs))} {ms(pct(xs, 95))}")
            for name, xs in server_rows(rounds):
                print(f"  {name:24} {ms(statistics.median(xs))} {ms(pct(xs, 95))}")
            warm = []
            if args.warm_rounds:
                warm = warm_rounds(s, d.base, cls, args.warm_rounds)
                forks = [spawn(["/bin/true"]) for _ in range(args.warm_rounds)]
                print(f"  from a warm pool, {len(warm)} rounds; peer: fork+exec of /bin/true from here")
                for i, name in enumerate(("create (a claim)", "create -> first exec")):
                    xs = [r[i] for r in warm]
                    print(f"  {name:24} {ms(statistics.median(xs))} {ms(pct(xs, 95))}")
                for name, xs in server_rows(warm):
                    print(f"  {name:24} {ms(statistics.median(xs))} {ms(pct(xs, 95))}")
                print(f"  {'peer: fork+exec':24} {ms(statistics.median(forks))} {ms(pct(forks, 95))}")
            local = threading.local()

            def one(_):
                if not hasattr(local, "s"):
                    local.s = d.session()
                return round_trip(local.s, d.base, body)

            wall = None
            if args.fanout:
                cpu0 = cpu_seconds(d.proc.pid)
                t0 = time.perf_counter()
                with ThreadPoolExecutor(args.threads) as pool:
                    fan = list(pool.map(one, range(args.fanout)))
                wall = time.perf_counter() - t0
                cpu = cpu_seconds(d.proc.pid) - cpu0
                print(f"  {args.fanout} created + `true` + deleted, {args.threads} clients: {wall:.2f} s "
                      f"({args.fanout / wall:.0f}/s); create -> first exec median "
                      f"{ms(statistics.median([r[1] for r in fan]))} ms; daemon CPU per sandbox "
                      f"{cpu * 1000 / args.fanout:.2f} ms")
                for name, xs in server_rows(fan):
                    print(f"    fan-out {name:22} median {ms(statistics.median(xs))} ms")
            srv = dict(server_rows(rounds)).get("server: create + exec")
            wsrv = dict(server_rows(warm)).get("server: create + exec") if warm else None
            results[cls] = (statistics.median([r[1] for r in rounds]), wall, srv and statistics.median(srv),
                            wsrv and statistics.median(wsrv))
            check(s.delete(f"{d.base}/v1/sandboxes/{keep['id']}", timeout=TIMEOUT), 200)
            s.delete(f"{d.base}/v1/templates/{tpl['id']}", timeout=TIMEOUT)
        if "process" in results:
            first, wall, srv, wsrv = results["process"]
            print("\ngoals (process class)")
            print(f"  create -> first exec median (client) {first * 1000:7.2f} ms")
            if srv is not None:
                print(f"  create + first exec median (server)  {srv * 1000:7.2f} ms   goal 1 ms")
            if wsrv is not None:
                print(f"    the same from a warm pool          {wsrv * 1000:7.2f} ms   goal 1 ms")
            if wall is not None:
                print(f"  {args.fanout} with {args.threads} clients          {wall:7.2f} s    goal 1 s")
        return 0
    finally:
        d.stop()


if __name__ == "__main__":
    sys.exit(main())
