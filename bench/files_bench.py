#!/usr/bin/env python3
"""1 GiB through the raw files API of `hutch serve`, each way, beside the
floor measured in the same run.

Starts two release daemons of its own (target/x86_64-unknown-linux-gnu/
release/hutch), one after the other, each with its own temp state directory
(a disk layer per sandbox, in the daemon's btrfs storage):

  - `frames`: HUTCH_FILES_PASS=0, every byte through the agent's frames (the
    path before passed descriptors: client -> daemon -> agent socket ->
    agent -> file);
  - `passed`: the default, the agent opens the file inside the sandbox and
    passes its descriptor; the daemon reads and writes it itself.

In each, one sandbox (a 4 GiB disk: room for the file and its
replacement, far from a full disk's slower writes) takes `--runs` times: PUT of the same
1 GiB (random bytes, from /dev/shm) to a new file through
/v1/sandboxes/{id}/files (`write`), PUT again over it (`replace`), then GET
of it to /dev/null, all with curl (so the client is not the bottleneck);
then the file is removed. Every write starts after a `sync`, so that the
last one's write-back does not slow it.
The floor is the same bytes copied by `cat` from /dev/shm into a file on the
same btrfs file system (the daemon's storage), then read back by `cat` to
/dev/null: what the kernel costs without HTTP, the daemon or the sandbox
(page cache warm both ways, as for the API's read). Medians in MB/s
(10^6 bytes a second).

Run as root:
    cargo build --release -p hutch -p hutch-agent && python3 bench/files_bench.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import RELEASE, Daemon, check  # noqa: E402

GiB = 1 << 30
SRC = Path("/dev/shm/hutch-files-bench.bin")


def mbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def curl(args: list[str]) -> tuple[float, int, int, int]:
    """Runs curl; answers (seconds, bytes up, bytes down, HTTP status)."""
    out = subprocess.run(
        ["curl", "-sS", "-H", "Expect:", "-w", "%{time_total} %{size_upload} %{size_download} %{http_code}", *args],
        capture_output=True, text=True, timeout=600,
    )
    if out.returncode != 0:
        raise RuntimeError(f"curl failed: {out.stderr.strip()}")
    t, up, down, code = out.stdout.split()[-4:]
    return float(t), int(float(up)), int(float(down)), int(code)


def timed(cmd: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(["sh", "-c", cmd], check=True)
    return time.perf_counter() - t0


def measure(mode: str, runs: int, size: int, binary: Path, disk_mib: int) -> dict[str, list[float]]:
    env = {"HUTCH_FILES_PASS": "0"} if mode == "frames" else {}
    d = Daemon(binary, env_extra=env)
    out: dict[str, list[float]] = {"write": [], "replace": [], "read": [], "floor_write": [], "floor_read": []}
    try:
        s = d.session()
        sb = check(s.post(d.base + "/v1/sandboxes",
                          data=json.dumps({"ttl_seconds": 1800, "limits": {"disk_mib": disk_mib}})), 201)
        auth = ["-H", f"Authorization: Bearer {d.key}"]
        fs = d.root / "state" / "storage" / "fs"
        floor = fs / "bench-floor.bin"
        for i in range(runs):
            name = f"big{i}.bin"
            url = f"{d.base}/v1/sandboxes/{sb['id']}/files?path={name}"
            put = [*auth, "-H", "Content-Type: application/octet-stream", "-X", "PUT", "-T", str(SRC),
                   "-o", "/dev/null", url]
            for row in ("write", "replace"):
                # Each write starts with no other write-back in flight.
                subprocess.run(["sync"], check=True)
                t, up, _, code = curl(put)
                assert code in (200, 204) and up == size, (code, up)
                out[row].append(mbps(size, t))
            t, _, down, code = curl([*auth, "-o", "/dev/null", url])
            assert code == 200 and down == size, (code, down)
            out["read"].append(mbps(size, t))
            check(s.post(f"{d.base}/v1/sandboxes/{sb['id']}/exec", data=f'{{"argv":["rm","{name}"]}}'), 200)
            if fs.is_dir():
                subprocess.run(["sync"], check=True)
                out["floor_write"].append(mbps(size, timed(f"cat {SRC} > {floor}")))
                out["floor_read"].append(mbps(size, timed(f"cat {floor} > /dev/null")))
                floor.unlink()
        s.delete(f"{d.base}/v1/sandboxes/{sb['id']}")
    finally:
        d.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mib", type=int, default=1024, help="size of the file (MiB)")
    ap.add_argument("--hutch", type=Path, default=RELEASE, help="the hutch binary (hutch-agent beside it)")
    ap.add_argument("--disk-mib", type=int, default=4096, help="the sandbox's disk (room for two files)")
    ap.add_argument("--modes", default="frames,passed", help="which of frames,passed to run")
    args = ap.parse_args()
    size = args.mib << 20
    with open(SRC, "wb") as f:
        left = size
        while left:
            n = min(left, 64 << 20)
            f.write(os.urandom(n))
            left -= n
    try:
        results = {mode: measure(mode, args.runs, size, args.hutch, args.disk_mib) for mode in args.modes.split(",")}
    finally:
        SRC.unlink(missing_ok=True)
    med = statistics.median
    print(f"files API, {args.mib} MiB each way, median of {args.runs} runs (MB/s):")
    print(f"{'path':<34} {'write':>8} {'replace':>8} {'read':>8}")
    for mode, r in results.items():
        print(f"{mode + ' (API, curl)':<34} {med(r['write']):>8.0f} {med(r['replace']):>8.0f} {med(r['read']):>8.0f}")
    fl_w = [x for r in results.values() for x in r["floor_write"]]
    fl_r = [x for r in results.values() for x in r["floor_read"]]
    if fl_w:
        print(f"{'floor (cat to/from the same btrfs)':<34} {med(fl_w):>8.0f} {'':>8} {med(fl_r):>8.0f}")
    p = results.get("passed") or next(iter(results.values()))
    met = {row: "met" if med(p[row]) >= 1000 else "NOT met" for row in ("write", "replace", "read")}
    print(f"goal >= 1000 MB/s each way: write {met['write']}, replace {met['replace']}, read {met['read']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
