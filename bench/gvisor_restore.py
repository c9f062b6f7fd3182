#!/usr/bin/env python3
"""Where a gVisor memory restore's time goes: runsc alone (no daemon), on a
bundle whose root is the host's / (read-only, a tmpfs upper), running python
that holds --mib MiB (--fill random|zero|ones) and writes a counter to a
host directory every 2 ms. The image is made once (`runsc checkpoint`) and
restored --n times; each restore reports:

  - restore_ms: `runsc restore --detach` to its exit;
  - first_tick_ms: to the restored process's first write (it runs again);
  - exec_ms: a `runsc exec true` after it;
  - the sentry's CPU time (user, sys) and the phases of its debug log,
    in ms from runsc's first log line: the sandbox process's start
    (boot0), its re-exec (boot), the restore RPC (loader), then the
    sentry's own "CPUID/Kernel/Memory load took" and the files reopened
    through the gofer (async).

Variations: --imgdir tmpfs|disk, --drop (page cache dropped first), --cpu
MILLIS and --mem MIB (the cgroup limits of a hutch sandbox, set by runsc from
the spec), --flags (runsc global flags), --fresh (`runsc run` of the same
bundle instead: the floor). GVR_NICE=-15 runs runsc reniced (a host shared
with builders); GVR_PLATFORM picks the platform (ptrace, as hutch).
Everything lives under /tmp/gvr and runsc's --root /tmp/gvr/state; the
script is the subreaper of the sandboxes it starts, so `runsc delete` does
not wait for init. Run as root:  python3 bench/gvisor_restore.py --mib 200
"""
import argparse
import ctypes
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path

libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: reap orphaned sentries at once

def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return

BASE = Path("/tmp/gvr")
STATE = BASE / "state"

def sh(*a, **kw):
    return subprocess.run(list(a), **kw)

def make_bundle(name, mib, fill, extra_mounts=(), cpu=0, mem=0):
    b = BASE / "b" / name
    if b.exists():
        return b
    (b / "rootfs").mkdir(parents=True); (b / "mem").mkdir(); (b / "out").mkdir()
    sh("mount", "-t", "tmpfs", "tmpfs", str(b / "mem"), check=True)
    (b / "mem" / "u").mkdir(); (b / "mem" / "w").mkdir()
    sh("mount", "-t", "overlay", "overlay", "-o", f"lowerdir=/,upperdir={b}/mem/u,workdir={b}/mem/w", str(b / "rootfs"), check=True)
    alloc = {"random": f"os.urandom({mib} << 20)", "zero": f"bytearray({mib} << 20)",
             "ones": f"b'\\x01' * ({mib} << 20)"}[fill]
    # The process ticks a counter file on the host (bind) every 2 ms: its first tick after a restore says it runs.
    script = (f"import os, time\nx = {alloc}\n"
              "open('/tmp/ready', 'w').close()\n"
              "fd = os.open('/out/tick', os.O_WRONLY | os.O_CREAT, 0o644)\n"
              "n = 0\n"
              "while True:\n    n += 1\n    os.pwrite(fd, b'%d\\n' % n, 0)\n    time.sleep(0.002)\n")
    spec = {"ociVersion": "1.0.2",
            "process": {"user": {"uid": 0, "gid": 0}, "args": ["python3", "-c", script],
                        "env": ["PATH=/usr/bin:/bin"], "cwd": "/"},
            "root": {"path": str(b / "rootfs"), "readonly": False},
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
                       {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"},
                       {"destination": "/out", "type": "bind", "source": str(b / "out"), "options": ["rbind", "rw"]},
                       *extra_mounts],
            "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]}}
    if cpu or mem:
        spec["linux"]["cgroupsPath"] = f"/gvr/{name}"
        res = spec["linux"]["resources"] = {}
        if cpu:
            res["cpu"] = {"quota": cpu * 100, "period": 100000}
        if mem:
            res["memory"] = {"limit": mem << 20}
    (b / "config.json").write_text(json.dumps(spec))
    return b

def runsc(flags):
    pre = ["nice", "-n", os.environ["GVR_NICE"]] if os.environ.get("GVR_NICE") else []
    return [*pre, "runsc", "--root", str(STATE), f"--platform={os.environ.get('GVR_PLATFORM', 'ptrace')}", "--host-uds=create", "--network=none", *flags]

def tick(b):
    try:
        return os.stat(b / "out" / "tick").st_mtime_ns, (b / "out" / "tick").read_text()
    except (FileNotFoundError, ValueError):
        return None

def wait_tick_change(b, before, deadline=30):
    t0 = time.monotonic()
    while True:
        t = tick(b)
        if t is not None and t != before and t[1].strip():
            return time.perf_counter()
        if time.monotonic() - t0 > deadline:
            raise RuntimeError("no tick")
        time.sleep(0.0005)

CPU = None
def cpu_of(cid, flags):
    """user+sys ms of the sandbox process (sentry, all threads) and the gofer, so far."""
    st = json.loads(sh(*runsc(flags), "state", cid, capture_output=True).stdout)
    pid = st["pid"]
    tck = os.sysconf("SC_CLK_TCK")
    def cpu(p):
        f = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) * 1000 // tck, int(f[11]) * 1000 // tck, int(f[12]) * 1000 // tck
    out = {"sentry": cpu(pid)}
    # the gofer: a runsc-gofer process with the same container id
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cl = open(f"/proc/{d}/cmdline").read()
            except OSError:
                continue
            if cl.startswith("runsc-gofer") and cid in cl and str(BASE) in cl:
                out["gofer"] = cpu(d)
    return out

def kill(flags, cid):
    sh(*runsc(flags), "kill", "--all", cid, "KILL", capture_output=True)
    reap()
    sh(*runsc(flags), "delete", "--force", cid, capture_output=True)
    reap()

def checkpoint(b, img, flags, cid="src"):
    kill(flags, cid)
    sh(*runsc(flags), "run", "--detach", "--bundle", str(b), cid, check=True, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (b / "out" / "tick").exists() or not (b / "out" / "tick").read_text().strip():
        if time.monotonic() > deadline:
            raise RuntimeError("not ready")
        time.sleep(0.05)
    time.sleep(0.3)
    if img.exists():
        shutil.rmtree(img)
    img.mkdir(parents=True)
    t0 = time.perf_counter()
    sh(*runsc(flags), "checkpoint", "--image-path", str(img), cid, check=True)
    took = time.perf_counter() - t0
    reap()
    kill(flags, cid)
    size = sum(f.stat().st_size for f in img.rglob("*") if f.is_file()) / (1 << 20)
    return took, size

RUN = [0]
def phases(d):
    """ms from runsc restore's first log line to each sandbox phase."""
    def ts(line):
        m = re.match(r"[IDWE]\d{4} (\d\d):(\d\d):(\d\d\.\d+)", line)
        return (int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3])) * 1e3 if m else None
    r = glob.glob(f"{d}/*restore.txt"); bt = glob.glob(f"{d}/*boot.txt")
    if not r or not bt:
        return {}
    t0 = ts(open(r[0]).readline())
    out = {}
    marks = [("boot", "main.go:217] Args"), ("loader", "loader.go:539] Platform"), ("cpuid", "CPUID load took"),
             ("kernel", "Kernel load took"), ("memory", "Memory load took"), ("async", "after async work"),
             ("started", "Process should have started")]
    for line in open(bt[0], errors="replace"):
        for k, pat in marks:
            if pat in line:
                t = ts(line)
                if t is not None:
                    out[k] = round(t - t0, 1)   # last occurrence wins (boot re-execs)
                if k == "boot" and "boot0" not in out:
                    out["boot0"] = out[k]
    for line in open(r[0], errors="replace"):
        if "Exiting with status" in line:
            out["exit"] = round(ts(line) - t0, 1)
    return out

def restore(b, img, flags, cid, drop=False, rflags=()):
    kill(flags, cid)
    RUN[0] += 1
    d = BASE / "logs" / f"{os.getpid()}-{RUN[0]}"
    d.mkdir(parents=True)
    flags = [*flags, f"--debug-log={d}/"]
    if drop:
        os.sync(); Path("/proc/sys/vm/drop_caches").write_text("3\n")
    before = tick(b)
    t0 = time.perf_counter()
    r = sh(*runsc(flags), "restore", "--detach", *rflags, "--image-path", str(img), "--bundle", str(b), cid,
           stdout=subprocess.DEVNULL, stderr=open(BASE / "restore.err", "w"))
    t1 = time.perf_counter()
    if r.returncode:
        raise RuntimeError((BASE / "restore.err").read_text()[-500:])
    t2 = wait_tick_change(b, before)
    global CPU
    CPU = cpu_of(cid, flags)
    t3 = time.perf_counter()
    e = sh(*runsc(flags), "exec", cid, "true").returncode
    t4 = time.perf_counter()
    assert e == 0
    kill(flags, cid)
    return (t1 - t0) * 1e3, (t2 - t0) * 1e3, (t4 - t3) * 1e3, CPU, phases(d)

def fresh_run(b, flags, cid, n):
    """create+start of the same bundle until the process's first tick."""
    out = []
    for _ in range(n):
        kill(flags, cid)
        (b / "out" / "tick").unlink(missing_ok=True)
        t0 = time.perf_counter()
        sh(*runsc(flags), "run", "--detach", "--bundle", str(b), cid, check=True, stdout=subprocess.DEVNULL)
        t1 = time.perf_counter()
        wait_tick_change(b, None, 120)
        t2 = time.perf_counter()
        out.append(((t1 - t0) * 1e3, (t2 - t0) * 1e3))
        kill(flags, cid)
    return out

def med(xs):
    return statistics.median(xs)

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=200)
    ap.add_argument("--fill", default="random")
    ap.add_argument("--imgdir", default="disk")  # disk | tmpfs
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--drop", action="store_true")
    ap.add_argument("--flags", default="")
    ap.add_argument("--tag", default="")
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--cpu", type=int, default=0, help="cpu quota, millis")
    ap.add_argument("--mem", type=int, default=0, help="memory limit MiB")
    ap.add_argument("--img", default="", help="image name to use (with --reuse)")
    ap.add_argument("--reuse", action="store_true", help="reuse an existing image")
    a = ap.parse_args()
    flags = a.flags.split() if a.flags else []
    name = f"{a.mib}-{a.fill}"
    bname = name + (f"-c{a.cpu}" if a.cpu else "") + (f"-m{a.mem}" if a.mem else "")
    b = make_bundle(bname, a.mib, a.fill, cpu=a.cpu, mem=a.mem)
    if a.fresh:
        rs = fresh_run(b, flags, "fresh", a.n)
        print(json.dumps({"what": "fresh", "name": name, "flags": a.flags,
                          "run_ms": [round(x[0]) for x in rs], "first_tick_ms": [round(x[1]) for x in rs],
                          "median_run": round(med([x[0] for x in rs])), "median_tick": round(med([x[1] for x in rs]))}))
        return
    root = Path("/dev/shm/gvr-img") if a.imgdir == "tmpfs" else Path("/var/tmp/gvr-img")
    img = root / (a.img or f"{name}{a.tag}")
    if a.reuse and (img / "checkpoint.img").exists():
        cp, size = None, sum(f.stat().st_size for f in img.rglob("*") if f.is_file()) / (1 << 20)
    else:
        cp, size = checkpoint(b, img, flags)
    rs = [restore(b, img, flags, "dst", a.drop) for _ in range(a.n)]
    print(json.dumps({"name": bname, "imgdir": a.imgdir, "drop": a.drop, "flags": a.flags,
                      "checkpoint_ms": cp and round(cp * 1e3), "image_mib": round(size, 1),
                      "restore_ms": [round(x[0]) for x in rs], "first_tick_ms": [round(x[1]) for x in rs],
                      "exec_ms": [round(x[2]) for x in rs], "cpu_tot_user_sys": [x[3]["sentry"] for x in rs], "phases": [x[4] for x in rs],
                      "median_phases": {k: med([x[4].get(k, 0) for x in rs]) for k in rs[0][4]},
                      "median_cpu": med([x[3]["sentry"][0] for x in rs]),
                      "median_restore": round(med([x[0] for x in rs])), "median_tick": round(med([x[1] for x in rs])),
                      "median_exec": round(med([x[2] for x in rs]))}))

if __name__ == "__main__":
    main()
