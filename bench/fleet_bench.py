#!/usr/bin/env python3
"""A fleet of three nodes on one PostgreSQL against one node on SQLite, on
this host, in one run. Prints:

  - create -> first exec (`true`), through the node that takes the sandbox
    vs through a node that forwards to it: creates are sent to node A and
    placement spreads them, so each round lands in one of the two columns
    (100 sequential rounds);
  - exec round trip (`true`) in one sandbox of node B: through B (its
    owner) vs through A (forwarded), 300 runs each, interleaved;
  - 1,000 sandboxes created, run (`true`) and deleted by 8 clients: across
    the three nodes (each client sends to the nodes in turn) vs one node
    with SQLite.

Release binaries; PostgreSQL is a throwaway cluster of scripts/pg-scratch.sh
(fsync off, unix socket). Run as root:
    cargo build --release && python3 bench/fleet_bench.py
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import RELEASE, REPO, TIMEOUT, Daemon, check, ms, pct  # noqa: E402

NODES = ("bench-a", "bench-b", "bench-c")


class Scratch:
    """A throwaway PostgreSQL cluster and one database in it."""

    def __init__(self):
        out = subprocess.run(
            ["bash", "-c", 'source scripts/pg-scratch.sh >&2 && printf "%s\\n%s\\n" "$HUTCH_TEST_POSTGRES" "$pg_scratch_dir"'],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )
        if out.returncode != 0:
            sys.exit(f"pg-scratch.sh failed: {out.stderr}")
        admin, self.dir = out.stdout.split()
        subprocess.run(["psql", "-q", admin, "-c", "CREATE DATABASE fleet_bench"], check=True, timeout=30)
        self.url = admin.rsplit("/", 1)[0] + "/fleet_bench"

    def stop(self) -> None:
        stop = f'"$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)/pg_ctl" -D {self.dir}/data -m immediate -w stop'
        subprocess.run(["runuser", "-u", "postgres", "--", "bash", "-c", stop], capture_output=True, timeout=60)
        subprocess.run(["rm", "-rf", self.dir], timeout=60)


def wait_fleet(d: Daemon, key: str) -> None:
    """Until every node heartbeated since its start (placement sees it)."""
    from api_bench import Lean
    s = Lean(d.base, key)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        nodes = check(s.get(d.base + "/v1/nodes"), 200)["nodes"]
        if len(nodes) == len(NODES) and all(n["heartbeat_at"] > n["started_at"] for n in nodes):
            return
        time.sleep(0.1)
    sys.exit("the nodes did not all heartbeat within 30 s")


def first_exec(s, base: str) -> tuple[str, float, str]:
    """create -> exec `true` through `base`; returns (sandbox id, seconds, its node)."""
    t0 = time.perf_counter()
    sb = check(s.post(base + "/v1/sandboxes", data='{"ttl_seconds":600}', timeout=TIMEOUT), 201)
    res = check(s.post(f"{base}/v1/sandboxes/{sb['id']}/exec", data='{"argv":["true"]}', timeout=TIMEOUT), 200)
    if res["exit_code"] != 0:
        raise RuntimeError(f"`true` exited {res['exit_code']}")
    return sb["id"], time.perf_counter() - t0, sb["node"]


def exec_true(s, base: str, sid: str) -> float:
    t0 = time.perf_counter()
    res = check(s.post(f"{base}/v1/sandboxes/{sid}/exec", data='{"argv":["true"]}', timeout=TIMEOUT), 200)
    if res["exit_code"] != 0:
        raise RuntimeError(f"`true` exited {res['exit_code']}")
    return time.perf_counter() - t0


def fan_out(bases: list[str], key: str, n: int, clients: int) -> float:
    """n rounds of create, exec `true`, delete by `clients` threads, each
    sending to the nodes in turn; returns the wall time."""
    def worker(w: int) -> None:
        from api_bench import Lean
        s = Lean(bases[0], key)
        for i in range(w, n, clients):
            base = bases[i % len(bases)]
            sb = check(s.post(base + "/v1/sandboxes", data='{"ttl_seconds":600}', timeout=TIMEOUT), 201)
            check(s.post(f"{base}/v1/sandboxes/{sb['id']}/exec", data='{"argv":["true"]}', timeout=TIMEOUT), 200)
            check(s.delete(f"{base}/v1/sandboxes/{sb['id']}", timeout=TIMEOUT), 200)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(worker, range(clients)))
    return time.perf_counter() - t0


def row(name: str, xs: list[float]) -> None:
    print(f"  {name:34} {len(xs):5} {ms(statistics.median(xs))} {ms(pct(xs, 95))}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", type=Path, default=RELEASE)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--execs", type=int, default=300)
    ap.add_argument("--fan", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=8)
    args = ap.parse_args()

    pg = Scratch()
    fleet: list[Daemon] = []
    try:
        for i, name in enumerate(NODES):
            fleet.append(Daemon(args.binary, env_extra={
                "HUTCH_DATABASE": pg.url, "HUTCH_NODE": name, "HUTCH_HEARTBEAT": "1s",
                "HUTCH_NET_INSTANCE": str(20 + i),
            }))
        key = fleet[0].key
        for d in fleet:
            d.key = key
        a, b, _ = fleet
        wait_fleet(a, key)
        s = a.session()

        print(f"fleet of {len(fleet)} nodes on one PostgreSQL (this host), release build\n")
        print(f"  {'ms':34} {'n':>5} {'median':>8} {'p95':>8}")
        here, forwarded, made = [], [], []
        for _ in range(args.rounds):
            sid, secs, node = first_exec(s, a.base)
            made.append(sid)
            (here if node == NODES[0] else forwarded).append(secs)
        row("create -> first exec, on A (owner)", here)
        row("create -> first exec, placed on B/C", forwarded)
        for sid in made:
            check(s.delete(f"{a.base}/v1/sandboxes/{sid}", timeout=TIMEOUT), 200)

        on_b = b.session()
        sid = next(sb for sb in (check(on_b.post(b.base + "/v1/sandboxes", data="{}"), 201) for _ in range(20))
                   if sb["node"] == NODES[1])["id"]
        owner, via = [], []
        for _ in range(args.execs):
            owner.append(exec_true(on_b, b.base, sid))
            via.append(exec_true(s, a.base, sid))
        row("exec round trip, through owner B", owner)
        row("exec round trip, through A -> B", via)
        print(f"  forwarding adds {1000 * (statistics.median(via) - statistics.median(owner)):.2f} ms "
              f"({statistics.median(via) / statistics.median(owner):.2f}x) to an exec")
        for d in fleet:
            d.stop()
        fleet.clear()

        wall3 = None
        for i, name in enumerate(NODES):
            fleet.append(Daemon(args.binary, env_extra={
                "HUTCH_DATABASE": pg.url, "HUTCH_NODE": name, "HUTCH_HEARTBEAT": "1s",
                "HUTCH_NET_INSTANCE": str(20 + i),
            }))
        for d in fleet:
            d.key = key
        wait_fleet(fleet[0], key)
        wall3 = fan_out([d.base for d in fleet], key, args.fan, args.clients)
        for d in fleet:
            d.stop()
        fleet.clear()

        lone = Daemon(args.binary, env_extra={"HUTCH_NET_INSTANCE": "20"})
        fleet.append(lone)
        wall1 = fan_out([lone.base], lone.key, args.fan, args.clients)
        print(f"\n{args.fan} sandboxes created, run (`true`) and deleted, {args.clients} clients:")
        print(f"  three nodes on PostgreSQL   {wall3:6.2f} s ({args.fan / wall3:.0f}/s)")
        print(f"  one node on SQLite          {wall1:6.2f} s ({args.fan / wall1:.0f}/s)")
        print(f"  ratio                       {wall3 / wall1:.2f}x (one host: the three nodes share its 2 cores)")
    finally:
        for d in fleet:
            d.stop()
        pg.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
