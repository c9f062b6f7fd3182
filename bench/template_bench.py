#!/usr/bin/env python3
"""`Template.build` of a small template through the unmodified E2B SDK
beside the same build through hutch's native API, in one run against one
daemon.

Starts its own release daemon (the Daemon of api_bench.py), makes an E2B
key, and for each round builds, with a file whose content is new each round
(so no step is cached):

- e2b:    Template().from_base_image().copy(file).run_cmd(...).set_envs(...)
          and Template.build(...) (request, the files-hash check and upload,
          the steps, status polling every 0.2 s as the SDK does) until ready
- native: POST /v1/templates/{id}/builds with a tar.gz of a Dockerfile
          (COPY, RUN, ENV) and the file, then GET .../builds/{build} every
          0.2 s until it succeeds

The two alternate round by round so both see the same machine. Prints
median and p95 of each, and their difference.

    cargo build --release && python3 bench/template_bench.py [--rounds 10] [--binary PATH]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import RELEASE, Daemon, ms, pct  # noqa: E402

WARMUP = 1
POLL = 0.2


def e2b_round(Template, ctx: Path) -> float:
    (ctx / "app.txt").write_text(uuid.uuid4().hex)
    t = (Template(file_context_path=str(ctx)).from_base_image()
         .copy("app.txt", "/home/user/app.txt")
         .run_cmd("wc -c /home/user/app.txt > /home/user/size")
         .set_envs({"MODE": "bench"}))
    t0 = time.perf_counter()
    Template.build(t, "bench-e2b")
    return time.perf_counter() - t0


def context(marker: str) -> bytes:
    files = {
        "Dockerfile": "COPY app.txt /home/user/app.txt\nRUN wc -c /home/user/app.txt > /home/user/size\nENV MODE=bench\n",
        "app.txt": marker,
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def native_round(s: requests.Session, base: str, tid: str) -> float:
    body = context(uuid.uuid4().hex)
    t0 = time.perf_counter()
    r = s.post(f"{base}/v1/templates/{tid}/builds", data=body, headers={"Content-Type": "application/gzip"})
    if r.status_code != 202:
        raise RuntimeError(f"build: {r.status_code} {r.text}")
    bid = r.json()["id"]
    while True:
        b = s.get(f"{base}/v1/templates/{tid}/builds/{bid}").json()
        if b["state"] == "succeeded":
            return time.perf_counter() - t0
        if b["state"] == "failed":
            raise RuntimeError(f"build failed: {b}")
        time.sleep(POLL)


def row(name: str, xs: list[float]) -> str:
    return f"{name:<34} {ms(pct(xs, 50))} {ms(pct(xs, 95))}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--binary", type=Path, default=RELEASE, help="the hutch to run (default: the release build)")
    args = ap.parse_args()
    binary = args.binary.resolve()
    d = Daemon(binary)
    ctx = Path(tempfile.mkdtemp(prefix="hutch-bench-ctx-"))
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HUTCH_")}
        out = subprocess.run(
            [str(binary), "key", "create", "--e2b", "--json", "--name", "template-bench",
             "--state-dir", str(d.root / "state")],
            env=env, capture_output=True, text=True, timeout=30, check=True,
        )
        key = json.loads(out.stdout)["secret"]
        os.environ.update({"E2B_API_URL": d.base, "E2B_SANDBOX_URL": d.base, "E2B_API_KEY": key})
        os.environ.pop("E2B_DOMAIN", None)
        from e2b import Template

        s = requests.Session()
        s.headers["Authorization"] = f"Bearer {key}"
        r = s.post(f"{d.base}/v1/templates", json={"name": "bench-native"})
        if r.status_code != 201:
            raise RuntimeError(f"template: {r.status_code} {r.text}")
        tid = r.json()["id"]
        for _ in range(WARMUP):
            e2b_round(Template, ctx)
            native_round(s, d.base, tid)
        e2b, native = [], []
        for _ in range(args.rounds):
            e2b.append(e2b_round(Template, ctx))
            native.append(native_round(s, d.base, tid))
        print(f"{args.rounds} rounds each, alternating; ms")
        print(f"{'':<34} {'median':>8} {'p95':>8}")
        print(row("e2b SDK: Template.build", e2b))
        print(row("native API: build", native))
        print(row("e2b minus native (paired)", [a - b for a, b in zip(e2b, native)]))
    finally:
        shutil.rmtree(ctx, ignore_errors=True)
        d.stop()


if __name__ == "__main__":
    main()
