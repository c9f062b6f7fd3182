#!/usr/bin/env python3
"""Sandbox state, measured in one run against one `hutch serve`.

Starts its own daemon from the release binary (or --binary) with its own
temp state directory (so its own btrfs storage image) and prints, as medians
(and p95) over --rounds rounds, the two kinds interleaved round by round so
both see the same host:

  - create (POST /v1/sandboxes answered, the sandbox running), create ->
    first exec (`true`), and delete, for a disk layer (the default) and a
    memory layer (`"storage": "memory"`);
  - writing 200 MiB in 5,000 files (one exec of a shell loop copying a
    40 KiB file) into each kind, to show what a disk layer costs a writer;
  - with a sandbox holding those 200 MiB in 5,000 files: a snapshot
    (POST /v1/sandboxes/{id}/snapshots, the sandbox frozen meanwhile), a
    create from that snapshot (create -> first exec) against a create from
    the template in the same rounds, a fork of 10 (POST .../fork), and a
    pause to disk and its resume.

Goals (issue 11): a disk-layer create at most 0.5 ms more than a memory one;
snapshot <= 50 ms; create from a snapshot within 1 ms of one from a
template; fork of 10 <= 100 ms in all; pause to disk <= 100 ms, resume
<= 20 ms. Run as root:
    cargo build --release && python3 bench/storage_bench.py
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import RELEASE, Daemon, pct  # noqa: E402

TIMEOUT = 120
GOAL_CREATE_EXTRA_MS = 0.5

FILL = ("mkdir -p /workspace/fill && cd /workspace/fill && "
        "head -c 41943 /dev/zero | tr '\\0' x > seed && "
        "for d in $(seq 0 49); do mkdir d$d; for f in $(seq 0 99); do cp seed d$d/f$f; done; done && "
        "rm seed && sync -f .")


class Client:
    """A keep-alive HTTP/1.1 client with bearer auth."""

    def __init__(self, port: int, key: str):
        self.port = port
        self.headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)

    def call(self, method: str, path: str, body=None, want: int = 200) -> dict:
        data = None if body is None else json.dumps(body)
        for attempt in (0, 1):
            try:
                self.conn.request(method, path, body=data, headers=self.headers)
                r = self.conn.getresponse()
                raw = r.read()
                break
            except (http.client.HTTPException, ConnectionError):
                self.conn.close()
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT)
                if attempt:
                    raise
        if r.status != want:
            raise RuntimeError(f"{method} {path} -> {r.status}: {raw[:500]!r}")
        return json.loads(raw) if raw else {}


def round_trip(c: Client, storage: str) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    sb = c.call("POST", "/v1/sandboxes", {"ttl_seconds": 600, "storage": storage}, 201)
    t1 = time.perf_counter()
    res = c.call("POST", f"/v1/sandboxes/{sb['id']}/exec", {"argv": ["true"]})
    t2 = time.perf_counter()
    assert res["exit_code"] == 0, res
    c.call("DELETE", f"/v1/sandboxes/{sb['id']}")
    t3 = time.perf_counter()
    return t1 - t0, t2 - t0, t3 - t2


def fill(c: Client, storage: str) -> float:
    sb = c.call("POST", "/v1/sandboxes",
                {"ttl_seconds": 600, "storage": storage, "memory_mb": 1024, "limits": {"disk_mib": 1024}}, 201)
    try:
        t0 = time.perf_counter()
        res = c.call("POST", f"/v1/sandboxes/{sb['id']}/exec", {"command": FILL, "timeout_seconds": 600})
        took = time.perf_counter() - t0
        assert res["exit_code"] == 0, res
        return took
    finally:
        c.call("DELETE", f"/v1/sandboxes/{sb['id']}")


def snapshots(c: Client, rounds: int) -> None:
    src = c.call("POST", "/v1/sandboxes",
                 {"ttl_seconds": 3600, "memory_mb": 1024, "limits": {"disk_mib": 1024}}, 201)
    sid = src["id"]
    try:
        res = c.call("POST", f"/v1/sandboxes/{sid}/exec", {"command": FILL, "timeout_seconds": 600})
        assert res["exit_code"] == 0, res
        snap_s, snaps = [], []
        for _ in range(max(10, rounds // 5)):
            t0 = time.perf_counter()
            snap = c.call("POST", f"/v1/sandboxes/{sid}/snapshots", {}, 201)
            snap_s.append(time.perf_counter() - t0)
            snaps.append(snap["id"])
        for s in snaps[1:]:
            c.call("DELETE", f"/v1/snapshots/{s}", want=204)
        snap = snaps[0]
        from_snap, from_tpl = [], []
        for i in range(rounds):
            for kind in (("snap", "tpl") if i % 2 == 0 else ("tpl", "snap")):
                body = {"ttl_seconds": 600, "memory_mb": 1024, "limits": {"disk_mib": 1024}}
                if kind == "snap":
                    body["snapshot"] = snap
                t0 = time.perf_counter()
                sb = c.call("POST", "/v1/sandboxes", body, 201)
                r = c.call("POST", f"/v1/sandboxes/{sb['id']}/exec", {"argv": ["true"]})
                took = time.perf_counter() - t0
                assert r["exit_code"] == 0, r
                c.call("DELETE", f"/v1/sandboxes/{sb['id']}")
                (from_snap if kind == "snap" else from_tpl).append(took)
        forks = []
        for _ in range(5):
            t0 = time.perf_counter()
            kids = c.call("POST", f"/v1/sandboxes/{sid}/fork", {"count": 10}, 201)["sandboxes"]
            forks.append(time.perf_counter() - t0)
            for k in kids:
                c.call("DELETE", f"/v1/sandboxes/{k['id']}")
        c.call("DELETE", f"/v1/snapshots/{snap}", want=204)
        pauses, resumes = [], []
        for _ in range(10):
            t0 = time.perf_counter()
            c.call("POST", f"/v1/sandboxes/{sid}/suspend", {"mode": "disk"})
            t1 = time.perf_counter()
            c.call("POST", f"/v1/sandboxes/{sid}/resume")
            t2 = time.perf_counter()
            pauses.append(t1 - t0)
            resumes.append(t2 - t1)
        print(f"\n  a sandbox holding 200 MiB in 5,000 files ({len(snap_s)} snapshots, {rounds} creates of each "
              f"kind, {len(forks)} forks):")
        print(f"  {'ms':34} {'median':>9} {'p95':>9}")
        print(line("snapshot", snap_s))
        print(line("create -> first exec (snapshot)", from_snap))
        print(line("create -> first exec (template)", from_tpl))
        print(line("fork of 10 (all running)", forks))
        print(line("pause to disk", pauses))
        print(line("resume from disk (running again)", resumes))
    finally:
        c.call("DELETE", f"/v1/sandboxes/{sid}")


def line(name: str, xs: list[float]) -> str:
    return f"  {name:34} {statistics.median(xs) * 1000:9.2f} {pct(xs, 95) * 1000:9.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", type=Path, default=RELEASE)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--fills", type=int, default=3)
    args = ap.parse_args()
    # Its storage image at 16 GiB, as the quoted figures were measured;
    # making the image adds to the start, so it gets 60 s to be healthy.
    d = Daemon(args.binary, args=["--storage-size", "16G"], ready_within=60)
    try:
        c = Client(d.port, d.key)
        for _ in range(5):
            round_trip(c, "disk")
            round_trip(c, "memory")
        rounds: dict[str, list[tuple[float, float, float]]] = {"disk": [], "memory": []}
        for i in range(args.rounds):
            for kind in (("disk", "memory") if i % 2 == 0 else ("memory", "disk")):
                rounds[kind].append(round_trip(c, kind))
        print(f"hutch storage bench: {args.rounds} rounds of each kind, interleaved ({args.binary.name} "
              f"{'release' if 'release' in str(args.binary) else 'debug'})")
        print(f"  {'ms':34} {'median':>9} {'p95':>9}")
        for kind in ("disk", "memory"):
            xs = rounds[kind]
            print(line(f"create ({kind})", [x[0] for x in xs]))
            print(line(f"create -> first exec ({kind})", [x[1] for x in xs]))
            print(line(f"delete ({kind})", [x[2] for x in xs]))
        extra = (statistics.median([x[0] for x in rounds["disk"]])
                 - statistics.median([x[0] for x in rounds["memory"]])) * 1000
        print(f"  disk create - memory create: {extra:+.2f} ms (goal: <= {GOAL_CREATE_EXTRA_MS} ms)")
        fills: dict[str, list[float]] = {"disk": [], "memory": []}
        for _ in range(args.fills):
            for kind in ("disk", "memory"):
                fills[kind].append(fill(c, kind))
        print(f"\n  writing 200 MiB in 5,000 files, {args.fills} runs, median seconds:")
        for kind in ("disk", "memory"):
            print(f"  {kind:8} {statistics.median(fills[kind]):7.2f}")
        snapshots(c, args.rounds)
        return 0
    finally:
        d.stop()


if __name__ == "__main__":
    sys.exit(main())
