#!/usr/bin/env python3
"""The gvisor class against the container class, one run:

  - create -> first exec (`true`) -> delete through `hutch serve`, for each
    class (20 sequential rounds): median / p95 of create, first exec, delete;
  - exec round trip (`true`) in one running sandbox of each class, 100 runs;
  - a syscall-heavy command (`python3 -c` stat-ing a file 100,000 times)
    in each class: the ptrace platform's cost per system call;
  - through the API: a memory snapshot of a gvisor sandbox (`deny_all`)
    holding a 200 MiB Python process, a create from it (runsc restore)
    and its first exec; a fork of 10 with memory of a sandbox holding a
    16 MiB one, and a pause to disk and resume (memory kept);
  - runsc checkpoint and restore of a sandbox holding a 200 MiB Python
    process (runsc directly, on a bundle of its own), and the image's size.

Starts its own daemon (bench/api_bench.py's), from the release binary or,
with --debug, the debug one. Run as root:
    cargo build --release && python3 bench/gvisor_bench.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import RELEASE, Daemon, check, ms, pct  # noqa: E402

DEBUG = RELEASE.parent.parent / "debug" / "hutch"


def template(s, base: str, cls: str) -> str:
    name = f"bench-{cls}"
    check(s.post(base + "/v1/templates", data=json.dumps({"name": name, "class": cls})), 201)
    return name


def rounds(s, base: str, tpl: str, n: int) -> list[tuple[float, float, float]]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = check(s.post(base + "/v1/sandboxes", data=json.dumps({"template": tpl, "ttl_seconds": 600})), 201)
        t1 = time.perf_counter()
        res = check(s.post(f"{base}/v1/sandboxes/{sb['id']}/exec", data='{"argv":["true"]}'), 200)
        assert res["exit_code"] == 0, res
        t2 = time.perf_counter()
        r = s.delete(f"{base}/v1/sandboxes/{sb['id']}")
        assert r.status_code in (200, 204), r.text
        t3 = time.perf_counter()
        out.append((t1 - t0, t2 - t1, t3 - t2))
    return out


def execs(s, base: str, sid: str, body: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        res = check(s.post(f"{base}/v1/sandboxes/{sid}/exec", data=body), 200)
        assert res["exit_code"] == 0, res
        out.append(time.perf_counter() - t0)
    return out


STATS = json.dumps({"argv": ["python3", "-c", "import os\nfor _ in range(100000): os.stat('/etc/passwd')"]})


def holding(s, base: str, tpl: str, mib: int) -> str:
    """A deny_all gvisor sandbox running python that holds `mib` MiB."""
    body = {"template": tpl, "ttl_seconds": 900, "memory_mb": max(512, 2 * mib + 256),
            "network": {"egress": "deny_all"}}
    sb = check(s.post(base + "/v1/sandboxes", data=json.dumps(body)), 201)
    script = (f"import os, time\nx = os.urandom({mib} << 20)\n"
              "open('/tmp/ready', 'w').close()\nwhile True: time.sleep(1)\n")
    check(s.post(f"{base}/v1/sandboxes/{sb['id']}/exec",
                 data=json.dumps({"argv": ["python3", "-c", script], "background": True})), 200)
    deadline = time.monotonic() + 120
    while True:
        res = check(s.post(f"{base}/v1/sandboxes/{sb['id']}/exec", data='{"argv":["test","-e","/tmp/ready"]}'), 200)
        if res["exit_code"] == 0:
            return sb["id"]
        if time.monotonic() > deadline:
            raise RuntimeError("python did not fill its memory")
        time.sleep(0.2)


def memory_api(s, base: str, tpl: str, state_dir: Path) -> None:
    """Memory snapshot, restore, fork of 10 and pause to disk through the API,
    then the daemon's own breakdown of each checkpoint (its log)."""
    sid = holding(s, base, tpl, 200)
    made = [sid]
    try:
        t0 = time.perf_counter()
        snap = check(s.post(f"{base}/v1/sandboxes/{sid}/snapshots", data='{"memory": true}'), 201)
        took = time.perf_counter() - t0
        img = state_dir / "memory" / snap["id"]
        size = sum(f.stat().st_size for f in img.rglob("*") if f.is_file()) / (1 << 20)
        print(f"gvisor    memory snapshot of a 200 MiB python (checkpoint, layer, restore in place): {ms(took)} ms,"
              f" image {size:.0f} MiB")
        t0 = time.perf_counter()
        nb = check(s.post(base + "/v1/sandboxes", data=json.dumps({"snapshot": snap["id"]})), 201)
        t1 = time.perf_counter()
        made.append(nb["id"])
        res = check(s.post(f"{base}/v1/sandboxes/{nb['id']}/exec", data='{"argv":["test","-e","/tmp/ready"]}'), 200)
        t2 = time.perf_counter()
        print(f"gvisor    create from it (runsc restore): {ms(t1 - t0)} ms; first exec {ms(t2 - t1)} ms;"
              f" state survived: {res['exit_code'] == 0}")
        t0 = time.perf_counter()
        r = check(s.post(f"{base}/v1/sandboxes/{nb['id']}/suspend", data='{"mode":"disk"}'), 200)
        t1 = time.perf_counter()
        assert r["state"] == "paused", r
        check(s.post(f"{base}/v1/sandboxes/{nb['id']}/resume", data="{}"), 200)
        t2 = time.perf_counter()
        print(f"gvisor    pause to disk (checkpoint) {ms(t1 - t0)} ms; resume (restore) {ms(t2 - t1)} ms")
        s.delete(f"{base}/v1/snapshots/{snap['id']}")
        small = holding(s, base, tpl, 16)
        made.append(small)
        t0 = time.perf_counter()
        kids = check(s.post(f"{base}/v1/sandboxes/{small}/fork", data='{"count": 10}'), 201)["sandboxes"]
        took = time.perf_counter() - t0
        made += [k["id"] for k in kids]
        ok = all(check(s.post(f"{base}/v1/sandboxes/{k['id']}/exec", data='{"argv":["test","-e","/tmp/ready"]}'),
                       200)["exit_code"] == 0 for k in kids)
        print(f"gvisor    fork of 10 with memory (16 MiB python): {ms(took)} ms; all continued: {ok}")
    finally:
        for m in made:
            s.delete(f"{base}/v1/sandboxes/{m}")
    log = state_dir.parent / "daemon.log"
    for line in log.read_text(errors="replace").splitlines():
        if "memory image" in line:
            print("    daemon:", json.loads(line).get("message", line) if line.startswith("{") else line)


def checkpoint_restore(mib: int) -> dict:
    """runsc alone: a bundle whose root is the host's / (read-only, a tmpfs
    upper), running python holding `mib` MiB; checkpoint, then restore."""
    root = Path(tempfile.mkdtemp(prefix="hutch-gvbench-"))
    state, img, bundle = root / "state", root / "image", root / "bundle"
    for d in (state, img, bundle / "rootfs", bundle / "mem"):
        d.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(bundle / "mem")], check=True)
    (bundle / "mem" / "u").mkdir()
    (bundle / "mem" / "w").mkdir()
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                    f"lowerdir=/,upperdir={bundle}/mem/u,workdir={bundle}/mem/w", str(bundle / "rootfs")], check=True)
    script = (f"import os, time\nx = os.urandom({mib} << 20)\n"
              "open('/tmp/ready', 'w').close()\nwhile True: time.sleep(1)\n")
    spec = {
        "ociVersion": "1.0.2",
        "process": {"user": {"uid": 0, "gid": 0}, "args": ["python3", "-c", script], "env": ["PATH=/usr/bin:/bin"],
                    "cwd": "/"},
        "root": {"path": str(bundle / "rootfs"), "readonly": False},
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
                   {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"}],
        "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]},
    }
    (bundle / "config.json").write_text(json.dumps(spec))
    runsc = ["runsc", "--root", str(state), "--platform=ptrace", "--network=none"]
    out = {}
    try:
        subprocess.run([*runsc, "run", "--detach", "--bundle", str(bundle), "gvb1"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while subprocess.run([*runsc, "exec", "gvb1", "test", "-e", "/tmp/ready"]).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("python did not fill its memory")
            time.sleep(0.2)
        t0 = time.perf_counter()
        subprocess.run([*runsc, "checkpoint", "--image-path", str(img), "gvb1"], check=True)
        out["checkpoint"] = time.perf_counter() - t0
        out["image_mib"] = sum(f.stat().st_size for f in img.rglob("*") if f.is_file()) / (1 << 20)
        subprocess.run([*runsc, "delete", "--force", "gvb1"], capture_output=True)
        t0 = time.perf_counter()
        subprocess.run([*runsc, "restore", "--detach", "--image-path", str(img), "--bundle", str(bundle), "gvb2"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out["restore"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        ok = subprocess.run([*runsc, "exec", "gvb2", "test", "-e", "/tmp/ready"]).returncode == 0
        out["first_exec_after_restore"] = time.perf_counter() - t0
        out["state_survived"] = ok
    finally:
        for c in ("gvb1", "gvb2"):
            subprocess.run([*runsc, "kill", "--all", c, "KILL"], capture_output=True)
            subprocess.run([*runsc, "delete", "--force", c], capture_output=True)
        subprocess.run(["umount", "-l", str(bundle / "rootfs")], capture_output=True)
        subprocess.run(["umount", "-l", str(bundle / "mem")], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--debug", action="store_true", help="use the debug build")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--execs", type=int, default=100)
    ap.add_argument("--memory-only", action="store_true", help="only the API's memory snapshots, fork and pause")
    args = ap.parse_args()
    d = Daemon(DEBUG if args.debug else RELEASE)
    try:
        s = d.session()
        if args.memory_only:
            memory_api(s, d.base, template(s, d.base, "gvisor"), d.root / "state")
            return 0
        for cls in ("container", "gvisor"):
            tpl = template(s, d.base, cls)
            rs = rounds(s, d.base, tpl, args.rounds)
            print(f"{cls:9} create -> first exec -> delete, {len(rs)} rounds (ms, median / p95):")
            for i, what in enumerate(("create", "first exec", "delete")):
                xs = [r[i] for r in rs]
                print(f"    {what:12}{ms(statistics.median(xs))} /{ms(pct(xs, 95))}")
            xs = [r[0] + r[1] for r in rs]
            print(f"    {'create+exec':12}{ms(statistics.median(xs))} /{ms(pct(xs, 95))}")
            sb = check(s.post(d.base + "/v1/sandboxes", data=json.dumps({"template": tpl})), 201)
            xs = execs(s, d.base, sb["id"], '{"argv":["true"]}', args.execs)
            print(f"{cls:9} exec round trip (`true`), {len(xs)} runs: median {ms(statistics.median(xs))} ms,"
                  f" p95 {ms(pct(xs, 95))} ms")
            xs = execs(s, d.base, sb["id"], STATS, 3)
            print(f"{cls:9} 100,000 stat calls in python: median {ms(statistics.median(xs))} ms")
            s.delete(f"{d.base}/v1/sandboxes/{sb['id']}")
            if cls == "gvisor":
                memory_api(s, d.base, tpl, d.root / "state")
    finally:
        d.stop()
    cr = checkpoint_restore(200)
    print(f"runsc checkpoint of a 200 MiB python: {ms(cr['checkpoint'])} ms, image {cr['image_mib']:.0f} MiB;"
          f" restore {ms(cr['restore'])} ms; first exec after {ms(cr['first_exec_after_restore'])} ms;"
          f" state survived: {cr['state_survived']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
