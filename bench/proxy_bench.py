#!/usr/bin/env python3
"""Throughput and latency of the port proxy, with its peer measured in the
same run.

Starts its own daemon from the release binary
(target/x86_64-unknown-linux-gnu/release/hutch) on a free port with its own
temp state and run directories, creates one sandbox, and runs the same small
HTTP server (tests/api/proxy_app.py, Python's ThreadingHTTPServer, `GET
/hello` -> 5 bytes) twice:

  - inside the sandbox on 127.0.0.1:8080, reached through the proxy's host
    form (`<id>--8080.sandboxes.localhost`, token in X-Hutch-Sandbox-Token);
  - directly on the host's loopback (the peer: no proxy, no sandbox).

For each, and for 1 and 4 concurrent clients (separate processes, each one
keep-alive http.client connection), it sends `GET /hello` for a few seconds
and prints requests/second and median / p95 latency. A last row opens a new
connection per request (Connection: close), which adds the proxy's per
connection work: a thread that joins the sandbox's network namespace to
make the socket, and the connect.

The server is the same in both columns, so the difference is the proxy's
cost; the Python server itself caps both at a few thousand requests a second
on this class of machine. Run as root:
    cargo build --release && python3 bench/proxy_bench.py
"""

from __future__ import annotations

import argparse
import base64
import http.client
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import RELEASE, Daemon, check, free_port, ms, pct  # noqa: E402

APP = Path(__file__).resolve().parents[1] / "tests" / "api" / "proxy_app.py"
PORT = 8080


def worker(args: tuple) -> list[float]:
    """Sends GET /hello for `seconds`; returns each request's latency."""
    addr, headers, seconds, keepalive = args
    lat: list[float] = []
    conn = http.client.HTTPConnection(*addr, timeout=30)
    hdrs = dict(headers)
    if not keepalive:
        hdrs["Connection"] = "close"
    deadline = time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        if t0 >= deadline:
            break
        conn.request("GET", "/hello", headers=hdrs)
        r = conn.getresponse()
        body = r.read()
        if r.status != 200 or body != b"hello":
            raise RuntimeError(f"GET /hello -> {r.status} {body[:200]!r}")
        lat.append(time.perf_counter() - t0)
        if not keepalive:
            conn.close()
            conn = http.client.HTTPConnection(*addr, timeout=30)
    conn.close()
    return lat


def run(pool, addr, headers, clients: int, seconds: float, keepalive: bool = True) -> tuple[float, float, float]:
    # A short warm-up on every client connection first.
    pool.map(worker, [(addr, headers, 0.3, keepalive)] * clients)
    t0 = time.perf_counter()
    results = pool.map(worker, [(addr, headers, seconds, keepalive)] * clients)
    wall = time.perf_counter() - t0
    lat = [x for r in results for x in r]
    return len(lat) / wall, statistics.median(lat), pct(lat, 95)


def wait_listening(addr: tuple[str, int], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(addr, timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=4.0, help="measuring time per row")
    ap.add_argument("--binary", type=Path, default=RELEASE)
    args = ap.parse_args()

    d = Daemon(args.binary)
    host_app = None
    try:
        s = d.session()
        sb = check(s.post(d.base + "/v1/sandboxes", data='{"ttl_seconds":900}'), 201)
        sid = sb["id"]
        data = base64.b64encode(APP.read_bytes()).decode()
        r = s.post(f"{d.base}/v1/sandboxes/{sid}/files/write",
                   data=f'{{"path":"/workspace/proxy_app.py","data":"{data}"}}')
        if r.status_code != 204:
            raise RuntimeError(f"upload: {r.status_code} {r.text}")
        check(s.post(f"{d.base}/v1/sandboxes/{sid}/exec",
                     data=f'{{"command":"exec python3 /workspace/proxy_app.py {PORT}","background":true}}'), 200)
        grant = check(s.post(f"{d.base}/v1/sandboxes/{sid}/access", data=f'{{"port":{PORT}}}'), 201)

        host_port = free_port()
        host_app = subprocess.Popen([sys.executable, str(APP), str(host_port)], stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        wait_listening(("127.0.0.1", host_port))

        proxied = (("127.0.0.1", d.port),
                   {"Host": f"{sid}--{PORT}.sandboxes.localhost:{d.port}", "X-Hutch-Sandbox-Token": grant["token"]})
        direct = (("127.0.0.1", host_port), {"Host": f"127.0.0.1:{host_port}"})
        # The app in the sandbox may take a moment to listen.
        deadline = time.monotonic() + 15
        while True:
            try:
                worker((proxied[0], proxied[1], 0.01, True))
                break
            except (RuntimeError, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

        ctx = multiprocessing.get_context("fork")
        print(f"GET /hello, {args.seconds:.0f} s per row; same Python server in the sandbox (through the proxy) "
              f"and on the host's loopback (direct)")
        print(f"  {'':34} {'req/s':>8} {'median ms':>10} {'p95 ms':>8}")
        with ctx.Pool(4) as pool:
            for clients in (1, 4):
                for name, (addr, headers) in (("direct", direct), ("proxy", proxied)):
                    rps, med, p95 = run(pool, addr, headers, clients, args.seconds)
                    label = f"{name}, keep-alive, {clients} client{'s' if clients > 1 else ''}"
                    print(f"  {label:34} {rps:8.0f} {ms(med):>10} {ms(p95):>8}")
            for name, (addr, headers) in (("direct", direct), ("proxy", proxied)):
                rps, med, p95 = run(pool, addr, headers, 1, args.seconds / 2, keepalive=False)
                label = f"{name}, new connection each, 1 client"
                print(f"  {label:34} {rps:8.0f} {ms(med):>10} {ms(p95):>8}")
        check(s.delete(f"{d.base}/v1/sandboxes/{sid}"), 200)
    finally:
        if host_app is not None:
            host_app.kill()
            host_app.wait(timeout=10)
        d.stop()


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("run as root: sandboxes are real namespaces and cgroups")
    main()
