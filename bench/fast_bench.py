#!/usr/bin/env python3
"""The fast paths of one host, each beside its peer or floor, in one run.

Starts its own release `hutch serve` (as bench/api_bench.py does) and
prints, medians unless said otherwise:

  1. `hutch run -- true` vs bwrap (the same arguments as sandbox-bench's
     bwrap runner), interleaved, both spawned from this process;
  2. create -> first exec (`true`) from a warm pool, and cold;
  3. exec round trip (`true`) vs a bare fork+exec of /bin/true from here;
  4. 1,000 sandboxes created, run (`true`) and deleted by 8 clients;
  5. a quiet sandbox's exec p99 alone, and while a neighbour runs a fork
     bomb, a memory hog, CPU spinners and an output flood within its
     limits (`--abuse` picks some);
  6. with N idle sandboxes alive (--levels, default 250,1000,2000,4000):
     create -> first exec, exec round trip, delete, `hutch run -- true`,
     host memory per idle sandbox, the daemon's CPU while nothing is
     asked of it; then deleting all N with 8 clients. A fill stops at
     3 GiB of memory left, and the curve there.

Run as root after `cargo build --release -p hutch -p hutch-agent`:
    python3 bench/fast_bench.py [--levels 250,1000,4000,10000]
The machine is shared and noisy: compare the ratios, not the absolute
figures, and run it on a quiet host.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import RELEASE, Daemon, Lean, check, pct  # noqa: E402

BWRAP = [
    "bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/usr", "/usr",
    "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
    "--symlink", "usr/sbin", "/sbin", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--",
]
CLIENTS = 8


class PeerQos:
    """The PM QoS request `hutch serve --wake-hold` makes, held by the bench
    itself around a peer's row (a no-op without --wake-hold)."""

    def __init__(self, on: bool):
        self.on, self.fd = on, None

    def __enter__(self):
        if self.on:
            self.fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
            os.write(self.fd, struct.pack("i", 0))

    def __exit__(self, *_):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def med_ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1000:.2f} ms"


def timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def spawn(argv: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(argv, check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def row(name: str, ours: str, peer: str, ratio: float | None = None) -> None:
    r = f"{ratio:.2f}x" if ratio is not None else ""
    print(f"| {name} | {ours} | {peer} | {r} |", flush=True)


def run_vs_bwrap(binary: Path, n: int) -> tuple[list[float], list[float]]:
    ours, bw = [], []
    for _ in range(n):
        ours.append(spawn([str(binary), "run", "--", "true"]))
        bw.append(spawn(BWRAP + ["true"]))
    return ours, bw


def create(s: Lean, base: str, body: dict) -> dict:
    return check(s.post(base + "/v1/sandboxes", data=json.dumps(body)), 201)


def exec_true(s: Lean, base: str, sid: str) -> None:
    res = check(s.post(f"{base}/v1/sandboxes/{sid}/exec", data='{"argv":["true"]}'), 200)
    if res["exit_code"] != 0:
        raise RuntimeError(f"`true` exited {res['exit_code']}")


def delete(s: Lean, base: str, sid: str) -> None:
    check(s.delete(f"{base}/v1/sandboxes/{sid}"), 200)


def first_exec(s: Lean, base: str, body: dict) -> tuple[float, float]:
    """create -> first exec, then delete: (seconds to the exec's answer, delete seconds)."""
    t0 = time.perf_counter()
    sb = create(s, base, body)
    exec_true(s, base, sb["id"])
    t1 = time.perf_counter()
    d = timed(lambda: delete(s, base, sb["id"]))
    return t1 - t0, d


def exec_rts(s: Lean, base: str, sid: str, n: int) -> list[float]:
    return [timed(lambda: exec_true(s, base, sid)) for _ in range(n)]


def warm_ready(s: Lean, base: str, tid: str) -> int:
    return check(s.get(f"{base}/v1/templates/{tid}"), 200)["warm_ready"]


def wait_for(what: str, cond, within: float = 60) -> None:
    deadline = time.monotonic() + within
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.01)


# How long the daemon's CPU time is watched with nothing asked of it, at
# each level: what its sandboxes alone cost it (the reconciler's passes,
# the metric samples).
IDLE_WINDOW = 10.0


def daemon_cpu_share(d: Daemon, window: float) -> float:
    """The daemon's CPU time (user and system) over `window` seconds of
    wall time, in cores."""
    tick = os.sysconf("SC_CLK_TCK")

    def cpu() -> float:
        fields = Path(f"/proc/{d.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    c0, t0 = cpu(), time.perf_counter()
    time.sleep(window)
    return (cpu() - c0) / (time.perf_counter() - t0)


# The memory a fill leaves the host at least (or a tenth of what it had).
MEM_FLOOR = 3 * 2**30


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable")


def fan_out(d: Daemon, n: int, job) -> float:
    """Runs job(session, i) for i < n on CLIENTS threads; wall seconds."""
    local = threading.local()

    def one(i: int):
        if not hasattr(local, "s"):
            local.s = d.session()
        return job(local.s, i)

    t = time.perf_counter()
    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(one, range(n)))
    return time.perf_counter() - t


FLOOD = """
import json, sys
sys.path.insert(0, %r)
from api_bench import Lean
base, key, sid = sys.argv[1:4]
s = Lean(base, key)
while True:
    s.post(f"{base}/v1/sandboxes/{sid}/exec", data=json.dumps({"command": "timeout 2 yes", "timeout_seconds": 5}))
""" % str(Path(__file__).resolve().parent)


# What the noisy neighbour of the abuse row runs (`--abuse` picks some).
HOGS = {
    "fork": [":(){ :|:& };: 2>/dev/null"],  # fork bomb, up to its pids limit
    "memory": ["while :; do head -c 400M /dev/zero | tail >/dev/null; done"],  # memory hog
    "spin": ["while :; do :; done", "while :; do :; done"],  # CPU spinners
    "flood": [],  # an output flood, read by a client of its own (below)
}


def abuse(d: Daemon, runs: int, kinds: list[str]) -> tuple[list[float], list[float]]:
    s, base = d.session(), d.base
    quiet = create(s, base, {"ttl_seconds": 3600})
    noisy = create(s, base, {"ttl_seconds": 3600, "memory_mb": 256, "limits": {"vcpus": 1, "pids": 128}})
    try:
        exec_rts(s, base, quiet["id"], 20)
        alone = exec_rts(s, base, quiet["id"], runs)
        for h in [h for k in kinds for h in HOGS[k]]:
            check(s.post(f"{base}/v1/sandboxes/{noisy['id']}/exec",
                         data=json.dumps({"command": h, "background": True})), 200)
        # An output flood, read as it streams by a client of its own: a
        # process apart, as a neighbour is, so that its reading does not
        # take this process's interpreter from the measured client.
        flood = None
        if "flood" in kinds:
            flood = subprocess.Popen(
                [sys.executable, "-c", FLOOD, base, d.key, noisy["id"]],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            )
        try:
            time.sleep(1)  # the abuse is under way (a bench, not a test)
            if flood is not None and flood.poll() is not None:
                raise RuntimeError(f"the flood client exited {flood.returncode}")
            busy = exec_rts(s, base, quiet["id"], runs)
        finally:
            if flood is not None:
                flood.terminate()
                flood.wait(timeout=30)
        return alone, busy
    finally:
        for sb in (quiet, noisy):
            s.delete(f"{base}/v1/sandboxes/{sb['id']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", type=Path, default=RELEASE)
    ap.add_argument("--runs", type=int, default=100, help="runs of each latency row")
    ap.add_argument("--fanout", type=int, default=1000)
    ap.add_argument("--levels", default="250,1000,2000,4000",
                    help="numbers of idle sandboxes alive at which create, exec and delete are measured")
    ap.add_argument("--skip", default="", help="rows to leave out: run,warm,exec,fanout,abuse,levels")
    ap.add_argument("--abuse", default=",".join(HOGS),
                    help=f"what the abuse row's neighbour runs, of {','.join(HOGS)} (default: all)")
    ap.add_argument("--wake-hold", default=None,
                    help="the daemon's --wake-hold (e.g. 20ms); the peers' rows then run under the same "
                         "PM QoS request, held by this bench")
    ap.add_argument("--kept-cgroups", type=int, default=None,
                    help="the daemon's --kept-cgroups (default: its own; 0 to compare without kept cgroups)")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    levels = sorted(int(x) for x in a.levels.split(",") if x)
    kinds = [k for k in a.abuse.split(",") if k]
    if not kinds or any(k not in HOGS for k in kinds):
        sys.exit(f"--abuse {a.abuse!r}: a comma list of {','.join(HOGS)}")
    if shutil.which("bwrap") is None and "run" not in skip:
        sys.exit("bwrap not found: apt-get install bubblewrap (or --skip run)")

    # With --wake-hold the daemon keeps idle CPUs polling around its own
    # calls; the peers' rows (and `hutch run`, which has no daemon, beside
    # bwrap) run under the same request held by this bench, from before
    # their first wakeup: if anything, the peers are favoured.
    peer_qos = PeerQos(a.wake_hold is not None)
    if a.wake_hold:
        print(f"(--wake-hold {a.wake_hold}: idle CPUs poll around the daemon's calls and the peers' rows)", flush=True)
    print("| path | hutch | peer or floor | ratio |\n|---|---:|---:|---:|", flush=True)
    idle_run = None
    if "run" not in skip:
        with peer_qos:
            ours, bw = run_vs_bwrap(a.binary, a.runs)
        idle_run = statistics.median(ours)
        row("`hutch run -- true` vs bwrap", med_ms(ours), med_ms(bw), statistics.median(ours) / statistics.median(bw))

    headroom = max(levels, default=0) * 4
    kept = [] if a.kept_cgroups is None else ["--kept-cgroups", str(a.kept_cgroups)]
    if a.wake_hold:
        kept += ["--wake-hold", a.wake_hold]
    d = Daemon(a.binary, args=["--overcommit", "64", "--max-sandboxes", str(max(headroom, 1000)), *kept])
    try:
        s, base = d.session(), d.base
        if "warm" not in skip:
            tpl = check(s.post(base + "/v1/templates", data=json.dumps(
                {"name": "fast-bench-warm", "warm": {"min": 2, "max": 2}})), 201)
            warm, cold = [], []
            for _ in range(a.runs):
                wait_for("the warm pool", lambda: warm_ready(s, base, tpl["id"]) >= 1)
                warm.append(first_exec(s, base, {"template": "fast-bench-warm", "ttl_seconds": 600})[0])
                cold.append(first_exec(s, base, {"ttl_seconds": 600})[0])
            if s.delete(f"{base}/v1/templates/{tpl['id']}").status_code != 204:
                raise RuntimeError("template delete failed")
            row("create -> first exec, warm pool", med_ms(warm), "goal 2 ms")
            row("create -> first exec, cold", med_ms(cold), "goal 3 ms")
        if "exec" not in skip:
            sb = create(s, base, {"ttl_seconds": 600})
            exec_rts(s, base, sb["id"], 20)
            rts = exec_rts(s, base, sb["id"], a.runs * 3)
            with peer_qos:
                floor = [spawn(["/bin/true"]) for _ in range(a.runs * 3)]
            delete(s, base, sb["id"])
            row("exec round trip (`true`)", med_ms(rts), f"fork+exec {med_ms(floor)}",
                statistics.median(rts) / statistics.median(floor))
        if "fanout" not in skip:

            def round_trip(s: Lean, _i: int) -> None:
                sb = create(s, base, {"ttl_seconds": 600})
                exec_true(s, base, sb["id"])
                delete(s, base, sb["id"])

            wall = fan_out(d, a.fanout, round_trip)
            row(f"{a.fanout} create + exec + delete, {CLIENTS} clients", f"{wall:.2f} s", "goal 2 s")
        if "abuse" not in skip:
            alone, busy = abuse(d, a.runs * 3, kinds)
            what = "" if set(kinds) == set(HOGS) else f" ({', '.join(kinds)})"
            row(f"neighbour exec p99 under abuse{what}", f"{pct(busy, 99) * 1000:.2f} ms",
                f"quiet {pct(alone, 99) * 1000:.2f} ms", pct(busy, 99) / pct(alone, 99))
        if "levels" not in skip and levels:
            curve(d, a, levels, idle_run)
    finally:
        d.stop()
    return 0


def curve(d: Daemon, a, levels: list[int], idle_run: float | None) -> None:
    s, base = d.session(), d.base
    alive: list[str] = []
    lock = threading.Lock()
    mem0 = mem_available()
    rows: list = []
    try:
        measure_levels(d, a, levels, alive, lock, mem0, rows, s, base)
    except BaseException:
        # Sandboxes outlive the daemon: none is left behind.
        ids = list(alive)
        fan_out(d, len(ids), lambda s, i: s.delete(f"{base}/v1/sandboxes/{ids[i]}"))
        raise
    first_level = rows[0]
    ids = list(alive)
    wall = fan_out(d, len(ids), lambda s, i: delete(s, base, ids[i]))
    print_curve(a, rows, first_level, idle_run, ids, wall)


def measure_levels(d: Daemon, a, levels: list[int], alive: list[str], lock, mem0: int, rows: list, s: Lean,
                   base: str) -> None:
    # The fill stops short of a level rather than push the host into its
    # OOM killer: idle sandboxes cost kernel memory that grows with their
    # number (see the README, "A host that fills up").
    floor = max(MEM_FLOOR, mem0 // 10)
    full = threading.Event()
    for n in levels:
        def make(s: Lean, _i: int) -> None:
            if full.is_set() or mem_available() < floor:
                full.set()
                return
            # Idle sandboxes with a small limit, so the host's memory
            # and disk admissions (limits x --overcommit) are not what stops
            # the fill.
            sb = create(s, base, {"ttl_seconds": 3600, "memory_mb": 128, "limits": {"disk_mib": 64}})
            with lock:
                alive.append(sb["id"])

        fill = fan_out(d, n - len(alive), make)
        idle = daemon_cpu_share(d, IDLE_WINDOW)
        if full.is_set():
            print(f"  the fill stopped at {len(alive)} alive of {n}: {mem_available() / 2**30:.1f} GiB "
                  f"of memory left (floor {floor / 2**30:.1f} GiB)", flush=True)
            n = len(alive)
        per_mib = (mem0 - mem_available()) / max(len(alive), 1) / 2**20
        runs = max(a.runs // 2, 10)
        made = [first_exec(s, base, {"ttl_seconds": 600}) for _ in range(runs)]
        rts = exec_rts(s, base, alive[0], runs)
        hr = [spawn([str(a.binary), "run", "--", "true"]) for _ in range(max(runs // 2, 5))]
        r = (n, statistics.median([m[0] for m in made]), statistics.median(rts),
             statistics.median([m[1] for m in made]), statistics.median(hr), per_mib, fill, idle)
        rows.append(r)
        print(f"  {n} alive: create->first exec {r[1] * 1000:.2f} ms, exec {r[2] * 1000:.2f} ms, "
              f"delete {r[3] * 1000:.2f} ms, hutch run {r[4] * 1000:.2f} ms, {per_mib:.2f} MiB each, "
              f"daemon {idle * 100:.1f}% of a core while idle (filled in {fill:.1f} s)", flush=True)
        if full.is_set():
            break


def print_curve(a, rows: list, first_level, idle_run: float | None, ids: list[str], wall: float) -> None:
    print("\n| sandboxes alive | create -> first exec | exec round trip | delete | `hutch run -- true` "
          "| host MiB per idle sandbox | idle daemon, % of a core |\n|---:|---:|---:|---:|---:|---:|---:|")
    for n, c, e, de, h, m, _, idle in rows:
        print(f"| {n} | {c * 1000:.2f} ms | {e * 1000:.2f} ms | {de * 1000:.2f} ms | {h * 1000:.2f} ms | {m:.2f} "
              f"| {idle * 100:.1f} |")
    top = rows[-1]
    print()
    row(f"create with {top[0]} alive vs {first_level[0]}", f"{top[1] * 1000:.2f} ms",
        f"{first_level[1] * 1000:.2f} ms", top[1] / first_level[1])
    if idle_run is not None:
        row(f"`hutch run -- true` with {top[0]} alive vs an idle host", f"{top[4] * 1000:.2f} ms",
            f"{idle_run * 1000:.2f} ms", top[4] / idle_run)
    row(f"delete {len(ids)} sandboxes, {CLIENTS} clients", f"{wall:.1f} s", "goal 8 s at 4,000")
    row("host memory per idle sandbox", f"{top[5]:.2f} MiB", "goal <= 1 MiB")


if __name__ == "__main__":
    sys.exit(main())
