#!/usr/bin/env python3
"""The code interpreter through the unmodified `e2b-code-interpreter` SDK
beside the same work through hutch's native API, in one run against one
daemon.

Starts its own daemon (the Daemon of api_bench.py, on a network instance
no test daemon holds), builds the `code-interpreter` image once with
`hutch image build` (timed and printed: it is the first use's cost), then
for each round times:

- sdk first call: Sandbox.create() (template code-interpreter-v1) and its
  first run_code("1+1"), which waits for the default Python kernel;
- native first command: POST /v1/sandboxes of a template on the same
  image + exec `python -c 'print(1+1)'` (a fresh interpreter each time);

and, on one sandbox of each kind kept for the run:

- sdk round trip: run_code("1+1") on a warm context;
- native round trip: exec `python -c 'print(1+1)'`;

then both first-call flows again with a warm pool of one sandbox: the E2B
key's own template `code-interpreter-v1` (which takes the built-in's
place; its warm sandbox has started its server and default kernel) and
a native template on the same image with `warm.min` 1, each round waiting until the pool
has refilled.

The flows alternate round by round so both see the same machine. Prints
median and p95 of each.

    cargo build --release && python3 bench/interp_bench.py [--rounds 20] [--binary PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import RELEASE, TIMEOUT, Daemon, Lean, check, ms, pct  # noqa: E402

PYTHON = "/opt/hutch/python/bin/python"
# The built-in template's startup command (hutch_runtime::image::interp).
START = f"exec {PYTHON} /opt/hutch/interp/server.py"
ARGV = json.dumps({"argv": [PYTHON, "-c", "print(1+1)"]})


def sdk_first(Sandbox) -> tuple[float, float, object]:
    t0 = time.perf_counter()
    sb = Sandbox.create()
    t1 = time.perf_counter()
    ex = sb.run_code("1+1")
    t2 = time.perf_counter()
    if ex.text != "2":
        raise RuntimeError(f"run_code answered {ex}")
    return t1 - t0, t2 - t1, sb


def sdk_round(sb) -> float:
    t0 = time.perf_counter()
    ex = sb.run_code("1+1")
    t1 = time.perf_counter()
    if ex.text != "2":
        raise RuntimeError(f"run_code answered {ex}")
    return t1 - t0


def native_exec(s, base: str, sid: str) -> float:
    t0 = time.perf_counter()
    res = check(s.post(f"{base}/v1/sandboxes/{sid}/exec", data=ARGV, timeout=TIMEOUT), 200)
    t1 = time.perf_counter()
    if (res["exit_code"], res["stdout"]) != (0, "2\n"):
        raise RuntimeError(f"exec answered {res}")
    return t1 - t0


def native_first(s, base: str, template: str) -> tuple[float, float, str]:
    t0 = time.perf_counter()
    body = json.dumps({"template": template, "ttl_seconds": 600})
    sb = check(s.post(base + "/v1/sandboxes", data=body, timeout=TIMEOUT), 201)
    t1 = time.perf_counter()
    return t1 - t0, native_exec(s, base, sb["id"]), sb["id"]


def pool_ready(s, base: str, tid: str) -> None:
    """Waits (bounded) until the template's pool holds a ready sandbox."""
    deadline = time.monotonic() + 120
    while check(s.get(f"{base}/v1/templates/{tid}", timeout=TIMEOUT), 200)["warm_ready"] < 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the pool of {tid} did not refill in 120 s")
        time.sleep(0.1)


def row(name: str, xs: list[float]) -> str:
    return f"{name:<40} {ms(pct(xs, 50))} {ms(pct(xs, 95))}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--binary", type=Path, default=RELEASE, help="the hutch binary (default: the release build)")
    args = ap.parse_args()
    d = Daemon(args.binary)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HUTCH_")}
        state = str(d.root / "state")
        t0 = time.perf_counter()
        subprocess.run([str(args.binary), "image", "build", "code-interpreter", "--local", "--state-dir", state],
                       env=env, capture_output=True, text=True, timeout=1800, check=True)
        built = time.perf_counter() - t0
        out = subprocess.run(
            [str(args.binary), "key", "create", "--e2b", "--json", "--name", "interp-bench", "--state-dir", state],
            env=env, capture_output=True, text=True, timeout=30, check=True,
        )
        os.environ.update({"E2B_API_URL": d.base, "E2B_SANDBOX_URL": d.base,
                           "E2B_API_KEY": json.loads(out.stdout)["secret"]})
        os.environ.pop("E2B_DOMAIN", None)
        from e2b_code_interpreter import Sandbox

        s = d.session()
        template = check(s.post(d.base + "/v1/templates", data=json.dumps(
            {"name": "interp-bench", "image": "code-interpreter"}), timeout=TIMEOUT), 201)["name"]
        first_sdk, first_native = [], []
        for _ in range(args.rounds):
            c, x, sb = sdk_first(Sandbox)
            first_sdk.append((c, x))
            sb.kill()
            c, x, sid = native_first(s, d.base, template)
            first_native.append((c, x))
            check(s.delete(f"{d.base}/v1/sandboxes/{sid}", timeout=TIMEOUT), 200)
        _, _, sb = sdk_first(Sandbox)
        _, _, sid = native_first(s, d.base, template)
        for _ in range(3):
            sdk_round(sb)
            native_exec(s, d.base, sid)
        warm_sdk, warm_native = [], []
        for _ in range(args.rounds * 5):
            warm_sdk.append(sdk_round(sb))
            warm_native.append(native_exec(s, d.base, sid))
        sb.kill()
        check(s.delete(f"{d.base}/v1/sandboxes/{sid}", timeout=TIMEOUT), 200)
        # Warm pools: the E2B key's own `code-interpreter-v1` (it takes the
        # built-in's place) and the native template, one warm sandbox each.
        owner = Lean(d.base, os.environ["E2B_API_KEY"])
        warm_tpl = check(owner.post(d.base + "/v1/templates", data=json.dumps({
            "name": "code-interpreter-v1", "image": "code-interpreter", "warm": {"min": 1, "max": 1},
            "startup": {"command": START}, "readiness": {"port": 49999, "timeout_seconds": 60}}), timeout=TIMEOUT), 201)
        native_tpl = check(s.post(d.base + "/v1/templates", data=json.dumps(
            {"name": "interp-bench-warm", "image": "code-interpreter", "warm": {"min": 1, "max": 1}}),
            timeout=TIMEOUT), 201)
        warm_first_sdk, warm_first_native = [], []
        for _ in range(args.rounds):
            pool_ready(owner, d.base, warm_tpl["id"])
            c, x, sb = sdk_first(Sandbox)
            warm_first_sdk.append((c, x))
            sb.kill()
            pool_ready(s, d.base, native_tpl["id"])
            c, x, sid = native_first(s, d.base, native_tpl["name"])
            warm_first_native.append((c, x))
            check(s.delete(f"{d.base}/v1/sandboxes/{sid}", timeout=TIMEOUT), 200)
        print(f"binary {args.binary}; image build {built:.0f} s (once)")
        print(f"{args.rounds} first-call rounds, {args.rounds * 5} round trips, alternating; ms")
        print(f"{'':<40} {'median':>8} {'p95':>8}")
        print(row("sdk: create", [c for c, _ in first_sdk]))
        print(row('sdk: first run_code("1+1")', [x for _, x in first_sdk]))
        print(row("sdk: create + first run_code", [c + x for c, x in first_sdk]))
        print(row("native: create", [c for c, _ in first_native]))
        print(row("native: first exec python -c", [x for _, x in first_native]))
        print(row("native: create + first exec", [c + x for c, x in first_native]))
        print(row("sdk, warm pool: create + first run_code", [c + x for c, x in warm_first_sdk]))
        print(row("native, warm pool: create + first exec", [c + x for c, x in warm_first_native]))
        print(row('sdk: run_code("1+1"), warm context', warm_sdk))
        print(row("native: exec python -c 'print(1+1)'", warm_native))
    finally:
        d.stop()


if __name__ == "__main__":
    main()
