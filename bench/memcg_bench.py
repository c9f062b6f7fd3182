#!/usr/bin/env python3
"""What one memory cgroup's life costs as the host's superblocks grow.

The kernel, as it takes a memory cgroup offline, walks every memcg-aware
list_lru on the host (two per mounted file system: dentries and inodes),
under the cgroup mutex that every cgroup mkdir, rmdir and migration also
takes. A sandbox has a memory cgroup and mounts several file systems, so
with N sandboxes alive each delete walks about 2 x (superblocks per
sandbox) x N lists, and creates queue behind it.

This program measures that cost without hutch: it holds S tmpfs mounts in
a private mount namespace (S superblocks), then times R rounds of: make a
memory cgroup, run a process in it that charges a dentry and an inode,
remove it. The floor is the same with no extra superblock. The kernel takes
a cgroup offline after rmdir returns, on a worker that holds the cgroup
mutex, so the cost lands on whichever cgroup operation comes next: the mean
per life (total over rounds) is the figure to compare; medians and p90 are
printed beside it.

With --reuse, each level also times the life a runtime that keeps emptied
cgroups gives a sandbox instead: rename a kept cgroup in, charge it, lower
its limit to reclaim what it holds (as hutch does), rename it back.

A caution: holding many superblocks raises, until the next boot, the
kernel's high-water mark of shrinker ids, and every memory cgroup made
afterwards gets a per-node map sized by it (about 1 KiB per 64 ids): after
a run at 40,000 each new memory cgroup took about 0.6 MiB of kernel memory
on this host. Measure memory per sandbox on a host that has not run this.

Run as root:
    python3 bench/memcg_bench.py [--levels 0,10000,20000,40000] [--rounds 200] [--reuse]
It cleans up what it makes (its cgroups and the mount namespace holder)
even when interrupted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HOLDER = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
MS_REC, MS_PRIVATE = 0x4000, 0x40000
if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
    sys.exit(f"make / private: errno {ctypes.get_errno()}")
top = sys.argv[1].encode()
if libc.mount(b"memcg-bench", top, b"tmpfs", 0, b"size=1m") != 0:
    sys.exit(f"tmpfs on {sys.argv[1]}: errno {ctypes.get_errno()}")
for i in range(int(sys.argv[2])):
    d = top + b"/" + str(i).encode()
    os.mkdir(d)
    if libc.mount(b"memcg-bench", d, b"tmpfs", 0, b"size=4k") != 0:
        sys.exit(f"mount {i}: errno {ctypes.get_errno()}")
print("ready", flush=True)
sys.stdin.read()
"""


def memory_parent() -> Path:
    """A parent directory for test memory cgroups: cgroup v1's memory
    hierarchy, or the v2 root with the memory controller enabled."""
    v1 = Path("/sys/fs/cgroup/memory")
    if (v1 / "memory.limit_in_bytes").exists():
        return v1
    v2 = Path("/sys/fs/cgroup")
    if "memory" in (v2 / "cgroup.subtree_control").read_text().split():
        return v2
    sys.exit("no memory cgroup controller found (v1 memory or v2 root with memory enabled)")


def charge(cgroup: Path, scratch_file: Path) -> None:
    """Charges `cgroup` a dentry and an inode from a process inside it."""
    pid = os.fork()
    if pid == 0:
        try:
            (cgroup / "cgroup.procs").write_text("0")
            scratch_file.touch()
            scratch_file.unlink()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def one_life(parent: Path, name: str, scratch: Path) -> float:
    """Seconds to make a memory cgroup, charge it a file's dentry and inode
    from a process inside, and remove it."""
    d = parent / name
    t0 = time.perf_counter()
    d.mkdir()
    charge(d, scratch / name)
    d.rmdir()
    return time.perf_counter() - t0


def one_reuse(parent: Path, name: str, scratch: Path) -> float:
    """Seconds for the same life on a kept cgroup: rename a spare in, charge
    it from a process inside, reclaim its charges and rename it back (what
    hutch's runtime does instead of mkdir and rmdir; see cgroup::Spares)."""
    spare, d = parent / "spare", parent / name
    t0 = time.perf_counter()
    spare.rename(d)
    charge(d, scratch / name)
    # Lower the limit (reclaim down to 1 MiB) and lift it again.
    limit = d / "memory.limit_in_bytes"
    limit.write_text(str(1 << 20))
    limit.write_text("-1")
    d.rename(spare)
    return time.perf_counter() - t0


def level(parent: Path, superblocks: int, rounds: int, scratch: Path, reuse: bool = False) -> list[float]:
    holder = None
    mnt = scratch / "mounts"
    try:
        if superblocks:
            mnt.mkdir(exist_ok=True)
            holder = subprocess.Popen(
                ["unshare", "-m", sys.executable, "-c", HOLDER, str(mnt), str(superblocks)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            if holder.stdout.readline().strip() != "ready":
                sys.exit(f"the mount holder failed (exit {holder.wait()})")
        group = parent / f"hutch-memcg-bench-{os.getpid()}"
        group.mkdir()
        try:
            if reuse:
                (group / "spare").mkdir()
                return [one_reuse(group, f"c{r}", scratch) for r in range(rounds)]
            return [one_life(group, f"c{r}", scratch) for r in range(rounds)]
        finally:
            if (group / "spare").exists():
                (group / "spare").rmdir()
            group.rmdir()
    finally:
        if holder:
            holder.stdin.close()
            holder.wait()
        if mnt.exists():
            mnt.rmdir()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="0,10000,20000,40000", help="extra superblocks held, comma separated")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument(
        "--reuse", action="store_true", help="also time lives on one kept cgroup (renamed in and out, emptied between)"
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root")
    parent = memory_parent()
    if args.reuse and not (parent / "memory.limit_in_bytes").exists():
        sys.exit("--reuse needs cgroup v1's memory hierarchy: cgroup v2 does not rename a cgroup")
    scratch = Path(f"/tmp/hutch-memcg-bench-{os.getpid()}")
    scratch.mkdir()
    try:
        print(f"memory cgroups under {parent}; {args.rounds} lives per level")
        print(f"{'superblocks':>12} {'mean ms':>8} {'median ms':>10} {'p90 ms':>8} {'total s':>8}")
        floor = None
        for n in (int(x) for x in args.levels.split(",")):
            for reuse in (False, True) if args.reuse else (False,):
                t = sorted(level(parent, n, args.rounds, scratch, reuse))
                med = statistics.median(t) * 1e3
                floor = floor or sum(t)
                print(
                    f"{n:>12} {sum(t) / len(t) * 1e3:>8.2f} {med:>10.2f} {t[int(len(t) * 0.9)] * 1e3:>8.2f}"
                    f" {sum(t):>8.2f}   ({sum(t) / floor:.1f}x the first level's total){'  kept cgroup' if reuse else ''}",
                    flush=True,
                )
    finally:
        scratch.rmdir()


if __name__ == "__main__":
    main()
