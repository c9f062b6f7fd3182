#!/usr/bin/env python3
"""Cost of the audit layer on the request path.

Starts its own daemon (the release binary unless `--binary`) and times,
interleaved on one keep-alive connection, two calls that do the same work
but one is audited: `GET /v1/sandboxes/<missing>` (a read: not recorded)
and `DELETE /v1/sandboxes/<missing>` (a mutation: recorded, with its 404
and `not_found`). Both authenticate, look the sandbox up and answer 404;
the difference of their medians bounds the layer's cost (the slot, the
row, the queue; the writer appends off the request path). Then the median
of create -> delete rounds, with the audit log on (it cannot be turned off).

    cargo build --release && python3 bench/audit_bench.py [--net-instance N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import RELEASE, Daemon, Lean, check  # noqa: E402

MISSING = "/v1/sandboxes/sb-00000000000000aa"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--binary", type=Path, default=RELEASE)
    p.add_argument("--net-instance", type=int, default=0)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=50)
    a = p.parse_args()
    d = Daemon(a.binary, env_extra={"HUTCH_NET_INSTANCE": str(a.net_instance)})
    try:
        s = d.session()

        def once(method: str) -> float:
            t = time.perf_counter()
            r = s._do(method, d.base + MISSING)
            assert r.status_code == 404, (method, r.status_code, r.text)
            return time.perf_counter() - t

        for m in ("GET", "DELETE"):
            for _ in range(200):
                once(m)
        reads, writes = [], []
        for _ in range(a.calls):
            reads.append(once("GET"))
            writes.append(once("DELETE"))
        r, w = statistics.median(reads) * 1e3, statistics.median(writes) * 1e3
        print(f"GET (not audited) median {r:.3f} ms; DELETE (audited) median {w:.3f} ms; difference {w - r:+.3f} ms")

        creates = []
        for _ in range(a.rounds):
            t = time.perf_counter()
            sb = check(s.post(d.base + "/v1/sandboxes", data='{"ttl_seconds":600}'), 201)
            creates.append(time.perf_counter() - t)
            check(s.delete(f"{d.base}/v1/sandboxes/{sb['id']}"), 200)
        print(f"create median {statistics.median(creates) * 1e3:.2f} ms over {a.rounds} (audited)")
        written = [ln for ln in s.get(d.base + "/metrics").text.splitlines() if ln.startswith("hutch_audit_")]
        print("; ".join(written))
    finally:
        d.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
