"""Large files stream: 256 MiB up and down through the SDK in a process of
its own whose peak resident memory must stay far below the file's size."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap

import hutch
import pytest

SIZE = 256 << 20
#: Most the SDK process may grow by while moving the file (its chunks are 1 MiB).
BOUND = 64 << 20

CHILD = textwrap.dedent(
    """
    import asyncio, hashlib, json, sys
    import hutch

    base, key, sandbox_id, size, mode = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    BLOCK = bytes(range(256)) * 4096  # 1 MiB

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise AssertionError(field)

    def blocks():
        for _ in range(size // len(BLOCK)):
            yield BLOCK

    def sync():
        with hutch.Hutch(base, key) as c:
            sb = c.sandboxes.get(sandbox_id)
            sb.files.write("warm", b"x")
            sb.files.read("warm")
            before = rss("VmHWM")
            sb.files.write("big.bin", blocks())
            h = hashlib.sha256()
            n = 0
            for chunk in sb.files.stream("big.bin"):
                h.update(chunk)
                n += len(chunk)
            return before, n, h.hexdigest()

    async def asynchronous():
        async with hutch.AsyncHutch(base, key) as c:
            sb = await c.sandboxes.get(sandbox_id)
            await sb.files.write("warm", b"x")
            await sb.files.read("warm")
            before = rss("VmHWM")

            async def ablocks():
                for b in blocks():
                    yield b

            await sb.files.write("big.bin", ablocks())
            h = hashlib.sha256()
            n = 0
            async for chunk in await sb.files.stream("big.bin"):
                h.update(chunk)
                n += len(chunk)
            return before, n, h.hexdigest()

    before, n, digest = sync() if mode == "sync" else asyncio.run(asynchronous())
    print(json.dumps({"before": before, "peak": rss("VmHWM"), "bytes": n, "sha256": digest}))
    """
)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_256_mib_moves_both_ways_in_bounded_memory(client: hutch.Hutch, daemon, admin_key, mode):
    h = hashlib.sha256()
    block = bytes(range(256)) * 4096
    for _ in range(SIZE >> 20):
        h.update(block)
    expected = h.hexdigest()
    with client.sandboxes.create(ttl="10m", memory_mb=1536, disk_mib=1024) as sb:
        p = subprocess.run(
            [sys.executable, "-c", CHILD, daemon.base, admin_key, sb.id, str(SIZE), mode],
            capture_output=True, text=True, timeout=300,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        out = json.loads(p.stdout)
        assert out["bytes"] == SIZE and out["sha256"] == expected
        assert sb.exec("stat -c %s big.bin").stdout == f"{SIZE}\n"
        grew = out["peak"] - out["before"]
        print(f"{mode}: peak RSS grew by {grew / (1 << 20):.1f} MiB moving {SIZE >> 20} MiB each way")
        assert grew < BOUND, f"the SDK process grew by {grew >> 20} MiB moving {SIZE >> 20} MiB"
