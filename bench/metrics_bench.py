#!/usr/bin/env python3
"""What a `/metrics` scrape costs as the host's history grows.

Seeds one store with a history: `--history` ended sandboxes, each with a
closed usage interval and a row of counts, as a host that ran that many
sandboxes keeps them. Then this build and a peer build (`--peer-binary`,
e.g. the build before running totals) each start on a copy of that store
(the first start of a build that adds a migration backfills there, once;
the bench times each start), make three live sandboxes, and are scraped
in turns: as the admin key (every key's totals) and as a tenant's key (its
own). Medians of client-side times.

    cargo build --release
    python3 bench/metrics_bench.py --peer-binary /path/to/an/older/hutch [--history 1000000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import RELEASE, Daemon, Lean, check  # noqa: E402


def seed(binary: Path, state: Path, history: int) -> None:
    """A store whose history holds `history` ended sandboxes of the admin
    key: one real sandbox made and deleted by `binary`, copied."""
    d = Daemon(binary, state_dir=state)
    try:
        s = d.session()
        sb = check(s.post(d.base + "/v1/sandboxes", data="{}"), 201)
        check(s.post(f"{d.base}/v1/sandboxes/{sb['id']}/exec", data='{"argv":["true"]}'), 200)
        check(s.delete(f"{d.base}/v1/sandboxes/{sb['id']}"), 200)
    finally:
        # The daemon goes, the store stays: stop it, not the bench's
        # cleanup (it removes its own directory, not `state`).
        d.stop()
    db = sqlite3.connect(state / "hutch.db")
    try:
        cols = [r[1] for r in db.execute("PRAGMA table_info(sandboxes)")]
        picks = ", ".join(
            {"id": "printf('sbh-%08d', n)", "idempotency_key": "NULL"}.get(c, c) for c in cols
        )
        count = f"WITH RECURSIVE k(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM k WHERE n < {history})"
        db.execute(
            f"{count} INSERT INTO sandboxes ({', '.join(cols)}) SELECT {picks} FROM k, "
            "(SELECT * FROM sandboxes WHERE state = 'terminated' LIMIT 1)"
        )
        icols = [r[1] for r in db.execute("PRAGMA table_info(usage_intervals)") if r[1] != "id"]
        ipicks = ", ".join({"subject": "printf('sbh-%08d', n)", "sandbox_id": "printf('sbh-%08d', n)"}.get(c, c)
                           for c in icols)
        db.execute(
            f"{count} INSERT INTO usage_intervals ({', '.join(icols)}) SELECT {ipicks} FROM k, "
            "(SELECT * FROM usage_intervals WHERE end_ms IS NOT NULL AND kind = 'running' LIMIT 1)"
        )
        db.execute(
            f"{count} INSERT INTO usage_counts (owner, sandbox_id, template, at, commands, egress_bytes) "
            "SELECT owner, printf('sbh-%08d', n), template, at, 1, 100 FROM k, "
            "(SELECT * FROM usage_counts LIMIT 1)"
        )
        db.commit()
        made = db.execute("SELECT COUNT(*) FROM sandboxes").fetchone()[0]
        if made < history:
            sys.exit(f"seeding made {made} sandbox rows, not {history}")
    finally:
        db.close()


class Side:
    """One build on its own copy of the seeded store."""

    def __init__(self, name: str, binary: Path, seeded: Path, work: Path):
        self.name = name
        self.state = work / name
        self.tenant_sandbox: str | None = None
        subprocess.run(["cp", "-a", "--sparse=always", str(seeded), str(self.state)], check=True)
        t = time.perf_counter()
        self.d = Daemon(binary, state_dir=self.state, ready_within=300)
        self.start_s = time.perf_counter() - t
        self.admin = self.d.session()
        key = check(self.admin.post(self.d.base + "/v1/keys", data='{"name":"tenant"}'), 201)
        self.tenant = Lean(self.d.base, key["secret"])
        for s in (self.admin, self.admin):
            check(s.post(self.d.base + "/v1/sandboxes", data="{}"), 201)
        # The daemon's cleanup deletes the admin's sandboxes; this one is
        # the tenant's to delete.
        self.tenant_sandbox = check(self.tenant.post(self.d.base + "/v1/sandboxes", data="{}"), 201)["id"]
        self.times: dict[str, list[float]] = {"admin": [], "tenant": []}

    def scrape(self, who: str) -> None:
        s = self.admin if who == "admin" else self.tenant
        t = time.perf_counter()
        r = s.get(self.d.base + "/metrics")
        self.times[who].append((time.perf_counter() - t) * 1e3)
        if r.status_code != 200 or "hutch_sandboxes{" not in r.text:
            raise RuntimeError(f"{self.name}: GET /metrics -> {r.status_code}: {r.text[:300]}")

    def stop(self) -> None:
        if self.tenant_sandbox:
            r = self.tenant.delete(f"{self.d.base}/v1/sandboxes/{self.tenant_sandbox}")
            if r.status_code != 200:
                print(f"bench: {self.name}: delete {self.tenant_sandbox} -> {r.status_code}", file=sys.stderr)
        self.d.stop()
        shutil.rmtree(self.state, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--binary", type=Path, default=RELEASE)
    p.add_argument("--peer-binary", type=Path, required=True,
                   help="another build of hutch (with its hutch-agent beside it)")
    p.add_argument("--history", type=int, default=1_000_000)
    p.add_argument("--scrapes", type=int, default=30)
    a = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: sandboxes are real namespaces and cgroups")
    work = Path(tempfile.mkdtemp(prefix="hutch-metrics-bench-"))
    sides: list[Side] = []
    try:
        seeded = work / "seeded"
        t = time.perf_counter()
        # Seeded by the older build: the newer one's first start migrates.
        seed(a.peer_binary, seeded, a.history)
        print(f"seeded {a.history} ended sandboxes in {time.perf_counter() - t:.1f} s", flush=True)
        for name, binary in (("this", a.binary), ("peer", a.peer_binary)):
            sides.append(Side(name, binary, seeded, work))
        for _ in range(a.scrapes):
            for side in sides:
                for who in ("admin", "tenant"):
                    side.scrape(who)
        print(f"\n/metrics with {a.history} ended sandboxes in the store, median of {a.scrapes} scrapes "
              "(client side, ms):\n")
        print("| build | first start (s) | admin scrape | tenant scrape |")
        print("|---|---:|---:|---:|")
        for side in sides:
            med = {w: statistics.median(v) for w, v in side.times.items()}
            print(f"| {side.name} ({side.d.proc.args[0]}) | {side.start_s:.2f} | {med['admin']:.2f} | "
                  f"{med['tenant']:.2f} |")
        this, peer = sides
        for who in ("admin", "tenant"):
            ratio = statistics.median(peer.times[who]) / statistics.median(this.times[who])
            print(f"\n{who}: the peer took {ratio:.1f}x this build's time", end="")
        print()
        return 0
    finally:
        for side in sides:
            side.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    sys.exit(main())
