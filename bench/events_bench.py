#!/usr/bin/env python3
"""Cost of the event path on a create and an exec.

Starts two daemons of its own (the release binary unless `--binary`), one
with events on (the default) and one with `--no-events` (a hidden flag that
makes `emit` return at once), and times, interleaved between them so both
see the same host load, `POST /v1/sandboxes` (which emits `sandbox.created`
and `sandbox.ready`; the delete after it, untimed, emits `sandbox.deleted`)
and `POST /v1/sandboxes/<id>/exec` of `true` on one sandbox each (no event:
what every request pays is nothing, which this shows). The difference of
the medians is the event path's cost on the request; the writer appends
off the request path.

    cargo build --release && python3 bench/events_bench.py [--binary PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import RELEASE, Daemon, check  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--binary", type=Path, default=RELEASE)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--execs", type=int, default=600)
    a = p.parse_args()
    # Each claims a network instance no other daemon on this host holds.
    on = Daemon(a.binary)
    off = Daemon(a.binary, args=["--no-events"])
    try:
        ds = {"on": on, "off": off}
        ss = {k: d.session() for k, d in ds.items()}
        creates: dict[str, list[float]] = {"on": [], "off": []}
        execs: dict[str, list[float]] = {"on": [], "off": []}

        def create(k: str) -> float:
            d, s = ds[k], ss[k]
            t = time.perf_counter()
            sb = check(s.post(d.base + "/v1/sandboxes", data='{"ttl_seconds":600,"storage":"memory"}'), 201)
            dt = time.perf_counter() - t
            check(s.delete(f"{d.base}/v1/sandboxes/{sb['id']}"), 200)
            return dt

        for _ in range(3):
            for k in ds:
                create(k)
        for i in range(a.rounds):
            for k in (("on", "off") if i % 2 == 0 else ("off", "on")):
                creates[k].append(create(k))
        sids = {k: check(ss[k].post(ds[k].base + "/v1/sandboxes", data='{"ttl_seconds":900,"storage":"memory"}'), 201)["id"] for k in ds}

        def run(k: str) -> float:
            d, s = ds[k], ss[k]
            t = time.perf_counter()
            r = check(s.post(f"{d.base}/v1/sandboxes/{sids[k]}/exec", data='{"command":"true"}'), 200)
            dt = time.perf_counter() - t
            assert r["exit_code"] == 0, r
            return dt

        for _ in range(50):
            for k in ds:
                run(k)
        for i in range(a.execs):
            for k in (("on", "off") if i % 2 == 0 else ("off", "on")):
                execs[k].append(run(k))
        for what, m in (("create", creates), ("exec", execs)):
            on_ms, off_ms = statistics.median(m["on"]) * 1e3, statistics.median(m["off"]) * 1e3
            print(
                f"{what}: median {on_ms:.3f} ms with events, {off_ms:.3f} ms without "
                f"({len(m['on'])} each, interleaved); difference {on_ms - off_ms:+.3f} ms"
            )
        for k, d in ds.items():
            ss[k].delete(f"{d.base}/v1/sandboxes/{sids[k]}")
        written = [ln for ln in ss["on"].get(on.base + "/metrics").text.splitlines() if ln.startswith("hutch_events_")]
        print("; ".join(written))
    finally:
        on.stop()
        off.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
