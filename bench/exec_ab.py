#!/usr/bin/env python3
"""A command's cost, this build against a peer build, interleaved.

Starts a daemon of this build and one of the peer's (`--peer-binary`, for
instance a release build of the commit before a change), each with one
sandbox, and measures in turns so that both see the same noise:

  - exec round trip (`true`) in the running sandbox, at the client, with
    the server's `run` phase from `Server-Timing`;
  - create -> first exec (`true`) -> delete of a fresh sandbox;
  - the floor: a fork+exec of /bin/true from this client (subprocess).

Prints medians and p90s, and this build's median over the peer's. Run as
root:
    python3 bench/exec_ab.py --peer-binary /path/to/older/hutch [--runs 600]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import RELEASE, Daemon, Lean, check, pct  # noqa: E402


def server_phase(headers, name: str) -> float | None:
    """A phase of `Server-Timing` (`name;dur=<ms>`), in seconds."""
    for part in (headers.get("Server-Timing") or "").split(","):
        fields = [f.strip() for f in part.split(";")]
        if fields and fields[0] == name:
            for f in fields[1:]:
                if f.startswith("dur="):
                    return float(f[4:]) / 1000
    return None


class Side:
    def __init__(self, name: str, binary: Path):
        self.name = name
        self.daemon = Daemon(binary)
        self.s = self.daemon.session()
        self.base = self.daemon.base
        self.sid = check(self.s.post(self.base + "/v1/sandboxes", data='{"ttl_seconds":3600}'), 201)["id"]
        self.exec_rt: list[float] = []
        self.exec_run: list[float] = []
        self.first: list[float] = []

    def exec_once(self) -> None:
        t0 = time.perf_counter()
        r = self.s.post(f"{self.base}/v1/sandboxes/{self.sid}/exec", data='{"argv":["true"]}')
        dt = time.perf_counter() - t0
        if check(r, 200)["exit_code"] != 0:
            raise RuntimeError(f"{self.name}: `true` failed")
        self.exec_rt.append(dt)
        run = server_phase(r.headers, "run")
        if run is not None:
            self.exec_run.append(run)

    def first_once(self) -> None:
        t0 = time.perf_counter()
        sid = check(self.s.post(self.base + "/v1/sandboxes", data='{"ttl_seconds":600}'), 201)["id"]
        res = check(self.s.post(f"{self.base}/v1/sandboxes/{sid}/exec", data='{"argv":["true"]}'), 200)
        self.first.append(time.perf_counter() - t0)
        check(self.s.delete(f"{self.base}/v1/sandboxes/{sid}"), 200)
        if res["exit_code"] != 0:
            raise RuntimeError(f"{self.name}: `true` failed in a fresh sandbox")

    def stop(self) -> None:
        self.daemon.stop()


def summary(xs: list[float]) -> str:
    if not xs:
        return "n/a"
    return f"{statistics.median(xs) * 1000:.3f} ms (p90 {pct(xs, 90) * 1000:.3f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", type=Path, default=RELEASE)
    ap.add_argument("--peer-binary", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=600, help="exec round trips of each build")
    ap.add_argument("--creates", type=int, default=100, help="create -> first exec rounds of each build")
    a = ap.parse_args()
    sides = []
    try:
        sides = [Side("this build", a.binary), Side("peer build", a.peer_binary)]
        floor: list[float] = []
        for side in sides:
            for _ in range(20):
                side.exec_once()
            side.exec_rt.clear()
            side.exec_run.clear()
        for i in range(a.runs):
            for side in sides if i % 2 == 0 else reversed(sides):
                side.exec_once()
            t0 = time.perf_counter()
            subprocess.run(["/bin/true"], check=True)
            floor.append(time.perf_counter() - t0)
        for i in range(a.creates):
            for side in sides if i % 2 == 0 else reversed(sides):
                side.first_once()
        ours, peer = sides
        print(f"{'':28} {'this build':>26} {'peer build':>26} {'ratio':>6}")
        for title, x, y in [
            ("exec round trip (`true`)", ours.exec_rt, peer.exec_rt),
            ("  server's run phase", ours.exec_run, peer.exec_run),
            ("create -> first exec", ours.first, peer.first),
        ]:
            ratio = statistics.median(x) / statistics.median(y) if x and y else float("nan")
            print(f"{title:28} {summary(x):>26} {summary(y):>26} {ratio:6.2f}")
        print(f"{'floor: fork+exec of true':28} {summary(floor):>26}")
        print(f"exec round trip over the floor: this build {statistics.median(ours.exec_rt) / statistics.median(floor):.2f}x, "
              f"peer {statistics.median(peer.exec_rt) / statistics.median(floor):.2f}x")
    finally:
        for side in sides:
            side.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
