#!/usr/bin/env python3
"""Latency of `hutch serve` over HTTP, with its peer measured in the same run.

Starts its own daemon from the release binary
(target/x86_64-unknown-linux-gnu/release/hutch) on a free port with its own
temp state and run directories, and prints:

  - create -> first exec (`true`) -> delete, for 200 sequential and 100
    concurrent (8 threads) sandboxes: median / p95 / p99 of each phase and
    of the whole round;
  - exec round trip (`true`) in one running sandbox, 200 runs: median / p95;
  - the peer: plain fork+exec of /bin/true from Python (subprocess), median;
    and the HTTP floor of this client (GET /healthz on the same session).

Bars: create-to-first-exec median <= 10 ms; exec round trip median <= 1.5 ms.
Every client is a keep-alive http.client connection (requests adds about
0.35 ms of its own to every call here, which would hide the server's time).
Run as root:
    cargo build --release && python3 bench/api_bench.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import http.client

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from net_instances import NetInstance  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RELEASE = REPO / "target" / "x86_64-unknown-linux-gnu" / "release" / "hutch"
TIMEOUT = 30
BAR_CREATE_TO_EXEC_MS = 10.0
BAR_EXEC_MS = 1.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]


def ms(x: float) -> str:
    return f"{x * 1000:8.2f}"


def run_parent() -> str:
    """Where a bench daemon's run directory goes: HUTCH_BENCH_RUN_PARENT,
    else /dev/shm (a tmpfs on every Linux host)."""
    return os.environ.get("HUTCH_BENCH_RUN_PARENT") or "/dev/shm"


class Daemon:
    """A `hutch serve` of the bench's own (`args` added to its command
    line), ready once /healthz answers within `ready_within` seconds."""

    def __init__(
        self,
        binary: Path,
        env_extra: dict[str, str] | None = None,
        args: list[str] | None = None,
        ready_within: float = 30,
        state_dir: Path | None = None,
    ):
        if not binary.is_file():
            sys.exit(f"release binary not found at {binary}: run `cargo build --release` first")
        if not (binary.parent / "hutch-agent").is_file():
            sys.exit(f"hutch-agent not found next to {binary}")
        if os.geteuid() != 0:
            sys.exit("run as root: sandboxes are real namespaces and cgroups")
        self.root = Path(tempfile.mkdtemp(prefix="hutch-bench-"))
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("HUTCH_")}
        # The run directory on a tmpfs, as `hutch doctor` asks of a host
        # (systemd's /run is one; this VM's /run and /tmp are not): each
        # sandbox binds its socket there. HUTCH_BENCH_RUN_PARENT names
        # another parent (a disk's directory, to measure that cost).
        self.run_dir = Path(tempfile.mkdtemp(prefix="hutch-bench-run-", dir=run_parent()))
        env["HUTCH_RUN_DIR"] = str(self.run_dir)
        env.update(env_extra or {})
        # A network instance no other daemon on this host holds, unless
        # the caller named one: two benches, or a bench beside a test
        # session, never collide on instance 0.
        self.net = None
        if "HUTCH_NET_INSTANCE" not in env:
            self.net = NetInstance.claim()
            env["HUTCH_NET_INSTANCE"] = str(self.net.number)
        # A state directory of the caller's (one a bench seeded) is the
        # caller's to remove; the default one goes with the daemon.
        self.state_dir = state_dir or self.root / "state"
        self.log = open(self.root / "daemon.log", "wb")
        self.proc = subprocess.Popen(
            [str(binary), "serve", "--listen", f"127.0.0.1:{self.port}", "--state-dir", str(self.state_dir),
             *(args or [])],
            env=env, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, start_new_session=True,
        )
        deadline = time.monotonic() + ready_within
        while True:
            if self.proc.poll() is not None:
                sys.exit(f"hutch serve exited {self.proc.returncode}: {(self.root / 'daemon.log').read_text()[-2000:]}")
            try:
                if requests.get(self.base + "/healthz", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                sys.exit(f"hutch serve did not become healthy in {ready_within:.0f} s")
            time.sleep(0.05)
        # A daemon joining a fleet's database finds the admin key made: its
        # bench sets `key` itself.
        key_file = self.state_dir / "admin.key"
        self.key = key_file.read_text().strip() if key_file.exists() else None

    def session(self) -> "Lean":
        return Lean(self.base, self.key)

    def sandboxes_alive(self, s) -> int:
        """Sandboxes of the daemon not yet ended, pooled ones included
        (`hutch_sandboxes` of /metrics)."""
        r = s.get(self.base + "/metrics")
        if r.status_code != 200:
            raise RuntimeError(f"GET /metrics -> {r.status_code}")
        text = r.text
        ended = ('state="terminated"', 'state="lost"')
        return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
                   if line.startswith("hutch_sandboxes{") and not line.startswith(tuple(f"hutch_sandboxes{{{e}" for e in ended)))

    def stop(self) -> None:
        # Sandboxes outlive the daemon: delete every one first (a failed
        # round may have left some), so none lingers and the storage
        # unmounts with the daemon. A warm pool's sandboxes are not listed
        # to their owner: deleting the templates drains them.
        if self.proc.poll() is None and getattr(self, "key", None):
            try:
                s = self.session()
                gone = [s.delete(f"{self.base}/v1/sandboxes/{sb['id']}") for sb in
                        check(s.get(self.base + "/v1/sandboxes?live=true&limit=1000"), 200)["sandboxes"]]
                gone += [s.delete(f"{self.base}/v1/templates/{t['id']}") for t in
                         check(s.get(self.base + "/v1/templates"), 200)["templates"]]
                for r in gone:
                    # Said, not raised: the rest still goes. A sandbox
                    # whose delete failed outlives the daemon.
                    if r.status_code not in (200, 204):
                        print(f"bench: cleanup: {r.method} {r.url} -> {r.status_code}: {r.text[:300]}",
                              file=sys.stderr)
                deadline = time.monotonic() + 30
                while self.sandboxes_alive(s) and time.monotonic() < deadline:
                    time.sleep(0.1)
            except (OSError, RuntimeError) as e:
                print(f"bench: cleanup: {e}", file=sys.stderr)
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        self.log.close()
        # The daemon unmounts its storage on a clean stop; make sure.
        subprocess.run(["umount", "-l", str(self.state_dir / "storage" / "fs")], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self.net is not None:
            self.net.release()


class Reply:
    """What a Lean call answers: status, body, and the request for errors."""

    def __init__(self, method: str, url: str, status: int, body: bytes, headers=None):
        self.method, self.url, self.status_code, self.body = method, url, status, body
        self.headers = headers if headers is not None else {}

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self):
        return json.loads(self.body)

    def raise_for_status(self) -> None:
        if self.status_code >= 400:
            raise RuntimeError(f"{self.method} {self.url} -> {self.status_code}: {self.text[:500]}")


class Lean:
    """A keep-alive HTTP/1.1 client on http.client, with bearer auth."""

    def __init__(self, base: str, key: str):
        self.base = base
        host, port = base.removeprefix("http://").split(":")
        self.addr = (host, int(port))
        self.headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        self.conn = http.client.HTTPConnection(*self.addr, timeout=TIMEOUT)

    def _do(self, method: str, url: str, data=None, timeout=None) -> Reply:
        path = url[len(self.base):]
        for attempt in (0, 1):
            try:
                self.conn.request(method, path, body=data, headers=self.headers)
                r = self.conn.getresponse()
                return Reply(method, url, r.status, r.read(), r.headers)
            except (http.client.HTTPException, ConnectionError):
                self.conn.close()
                self.conn = http.client.HTTPConnection(*self.addr, timeout=TIMEOUT)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def post(self, url: str, data=None, timeout=None) -> Reply:
        return self._do("POST", url, data)

    def get(self, url: str, timeout=None) -> Reply:
        return self._do("GET", url)

    def delete(self, url: str, timeout=None) -> Reply:
        return self._do("DELETE", url)


def check(r: Reply, status: int) -> dict:
    if r.status_code != status:
        raise RuntimeError(f"{r.method} {r.url} -> {r.status_code}: {r.text[:500]}")
    return r.json()


def round_trip(s: "Lean", base: str) -> tuple[float, float, float]:
    """create -> exec `true` -> delete; returns (create, first exec, delete) seconds."""
    t0 = time.perf_counter()
    sb = check(s.post(base + "/v1/sandboxes", data='{"ttl_seconds":600}', timeout=TIMEOUT), 201)
    t1 = time.perf_counter()
    res = check(s.post(f"{base}/v1/sandboxes/{sb['id']}/exec", data='{"argv":["true"]}', timeout=TIMEOUT), 200)
    t2 = time.perf_counter()
    if res["exit_code"] != 0:
        raise RuntimeError(f"`true` exited {res['exit_code']}")
    check(s.delete(f"{base}/v1/sandboxes/{sb['id']}", timeout=TIMEOUT), 200)
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


def report_rounds(title: str, rounds: list[tuple[float, float, float]], wall: float) -> float:
    create = [r[0] for r in rounds]
    first = [r[0] + r[1] for r in rounds]
    delete = [r[2] for r in rounds]
    whole = [sum(r) for r in rounds]
    print(f"\n{title}: {len(rounds)} sandboxes in {wall:.2f} s ({len(rounds) / wall:.0f}/s)")
    print(f"  {'ms':24} {'median':>8} {'p95':>8} {'p99':>8}")
    for name, xs in (("create", create), ("create -> first exec", first), ("delete", delete),
                     ("create+exec+delete", whole)):
        print(f"  {name:24} {ms(statistics.median(xs))} {ms(pct(xs, 95))} {ms(pct(xs, 99))}")
    return statistics.median(first)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", type=Path, default=RELEASE)
    ap.add_argument("--sequential", type=int, default=200)
    ap.add_argument("--concurrent", type=int, default=100)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--exec-runs", type=int, default=200)
    args = ap.parse_args()

    d = Daemon(args.binary)
    try:
        print(f"hutch serve {args.binary} on {d.base}; {os.cpu_count()} CPUs")
        s = d.session()
        # Warm-up: the first sandbox pays for page-cache and allocator start.
        for _ in range(5):
            round_trip(s, d.base)

        t0 = time.perf_counter()
        seq = [round_trip(s, d.base) for _ in range(args.sequential)]
        seq_first = report_rounds("sequential", seq, time.perf_counter() - t0)

        local = threading.local()

        def one(_):
            if not hasattr(local, "s"):
                local.s = d.session()
            return round_trip(local.s, d.base)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.threads) as pool:
            conc = list(pool.map(one, range(args.concurrent)))
        conc_first = report_rounds(f"concurrent ({args.threads} threads)", conc, time.perf_counter() - t0)

        sb = check(s.post(d.base + "/v1/sandboxes", data='{"ttl_seconds":600}', timeout=TIMEOUT), 201)
        body = json.dumps({"argv": ["true"]})
        url = f"{d.base}/v1/sandboxes/{sb['id']}/exec"
        for _ in range(10):
            check(s.post(url, data=body, timeout=TIMEOUT), 200)
        execs = []
        for _ in range(args.exec_runs):
            t = time.perf_counter()
            check(s.post(url, data=body, timeout=TIMEOUT), 200)
            execs.append(time.perf_counter() - t)
        check(s.delete(f"{d.base}/v1/sandboxes/{sb['id']}", timeout=TIMEOUT), 200)
        print(f"\nexec round trip (`true`, {args.exec_runs} runs, one sandbox)")
        print(f"  median {ms(statistics.median(execs))} ms   p95 {ms(pct(execs, 95))} ms")

        # The floor of any request from this client: keep-alive GET /healthz.
        health = []
        for _ in range(args.exec_runs):
            t = time.perf_counter()
            s.get(d.base + "/healthz", timeout=TIMEOUT).raise_for_status()
            health.append(time.perf_counter() - t)
        print(f"\nHTTP floor: GET /healthz from the same connection, {len(health)} runs")
        print(f"  median {ms(statistics.median(health))} ms   p95 {ms(pct(health, 95))} ms")

        forks = []
        for _ in range(max(args.exec_runs, 200)):
            t = time.perf_counter()
            subprocess.run(["/bin/true"], check=True)
            forks.append(time.perf_counter() - t)
        print(f"\npeer: fork+exec of /bin/true from Python (subprocess.run), {len(forks)} runs")
        print(f"  median {ms(statistics.median(forks))} ms   p95 {ms(pct(forks, 95))} ms")

        exec_med = statistics.median(execs)
        print("\nbars")
        for name, got, bar in (
            ("create -> first exec median, sequential", seq_first * 1000, BAR_CREATE_TO_EXEC_MS),
            ("create -> first exec median, concurrent", conc_first * 1000, BAR_CREATE_TO_EXEC_MS),
            ("exec round trip median", exec_med * 1000, BAR_EXEC_MS),
        ):
            print(f"  {name:42} {got:7.2f} ms  bar {bar:5.1f} ms  {'met' if got <= bar else 'MISSED'}")
        print(f"  exec round trip / local fork+exec: {exec_med / statistics.median(forks):.1f}x")
        return 0
    finally:
        d.stop()


if __name__ == "__main__":
    sys.exit(main())
