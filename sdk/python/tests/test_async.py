"""The async client against the daemon: the same operations as the sync
tests, awaited (sandboxes, commands, streams, background processes, files,
archives, parts, grants, templates and builds, keys, errors)."""

from __future__ import annotations

import hashlib
import io
import os
import signal
from pathlib import Path

import hutch
import pytest

from conftest import marker


async def test_sandbox_lifecycle(aclient: hutch.AsyncHutch):
    tag = marker()
    async with aclient.sandboxes.create(ttl="5m", memory_mb=256, vcpus=1, disk_mib=256, pids=100, env={"E": "1"},
                                        metadata={"t": tag}, network="deny_all", wait=30) as sb:
        assert isinstance(sb, hutch.AsyncSandbox) and sb.state == "running"
        assert sb.info.network.egress == "deny_all" and sb.metadata == {"t": tag}
        assert (await sb.extend(60)).expires_at > sb.info.created_at
        assert (await sb.suspend()).state == "suspended"
        with pytest.raises(hutch.SandboxNotRunningError):
            await sb.exec("true")
        assert (await sb.resume()).state == "running"
        assert (await sb.refresh()).state == "running"
        page = await aclient.sandboxes.list(limit=1)
        assert [s.id for s in page] == [sb.id]
        assert sb.id in [s.id async for s in aclient.sandboxes.iter(page_size=2)]
        assert (await aclient.sandboxes.get(sb.id)).id == sb.id
    assert sb.state == "terminated"
    other = await aclient.sandboxes.create(ttl=60)
    assert (await aclient.sandboxes.delete(other.id)).state == "terminated"
    with pytest.raises(hutch.NotFoundError) as e:
        await aclient.sandboxes.get("sb-doesnotexist")
    assert e.value.code == "not_found"


async def test_commands(aclient: hutch.AsyncHutch):
    async with aclient.sandboxes.create(ttl="5m") as sb:
        r = await sb.exec("python3 -c 'print(6*7)'")
        assert r.stdout == "42\n" and r.exit_code == 0
        r = await sb.exec(["sh", "-c", "cat; exit 2"], stdin="x", cwd="/tmp", user="root", env={"A": "1"},
                          timeout="10s", keep_output=False)
        assert r.exit_code == 2 and r.stdout == "x" and not r.output_kept
        stream = await sb.exec_stream(["sh", "-c", "echo a; echo b >&2"])
        async with stream:
            types = [e.type async for e in stream]
        assert types[0] == "start" and types[-1] == "exit" and stream.exit.exit_code == 0
        assert (await (await sb.exec_stream("echo x")).collect()).stdout == "x\n"
        p = await sb.exec("sleep 100", background=True)
        assert isinstance(p, hutch.AsyncProcess)
        assert p.pid in [x.pid for x in await sb.processes()]
        async with await p.stream() as attached:
            await p.signal("TERM")
            assert (await attached.collect()).exit_code == 128 + signal.SIGTERM
        cat = await sb.exec("cat", background=True)
        async with await sb.process(cat.pid).stream() as attached:
            await cat.stdin("in\n")
            await cat.close_stdin()
            assert (await attached.collect()).stdout == "in\n"
        k = await sb.exec("sleep 100", background=True)
        async with await k.stream() as attached:
            await k.kill()
            assert (await attached.collect()).exit_code == 128 + signal.SIGKILL
        w = await sb.exec("sleep 0.3; echo w", background=True)
        assert (await w.wait()).stdout == "w\n"
        key = f"a-{marker()}"
        a = await sb.exec("echo 1 >> /tmp/c; wc -l < /tmp/c", idempotency_key=key)
        b = await sb.exec("echo 1 >> /tmp/c; wc -l < /tmp/c", idempotency_key=key)
        assert a.stdout == b.stdout == "1\n"
    r = await aclient.run("echo one-shot", network="deny_all")
    assert r.stdout == "one-shot\n" and r.sandbox_id


async def test_files(aclient: hutch.AsyncHutch, tmp_path: Path):
    async with aclient.sandboxes.create(ttl="5m") as sb:
        f = sb.files
        await f.write("a.txt", b"hi")
        assert await f.read("a.txt") == b"hi" and await f.read_text("a.txt") == "hi"

        async def gen():
            for i in range(4):
                yield bytes([65 + i]) * 100_000

        await f.write("gen.bin", gen())
        assert await f.read("gen.bin") == b"".join(bytes([65 + i]) * 100_000 for i in range(4))
        await f.write("sync-iter.bin", iter([b"a", b"b"]))
        assert b"".join([c async for c in await f.stream("sync-iter.bin")]) == b"ab"
        local = tmp_path / "l.bin"
        local.write_bytes(os.urandom(1 << 20))
        await f.upload(local, "l.bin")
        assert await f.download("l.bin", tmp_path / "d.bin") == 1 << 20
        assert (tmp_path / "d.bin").read_bytes() == local.read_bytes()
        buf = io.BytesIO()
        await f.download("a.txt", buf)
        assert buf.getvalue() == b"hi"
        await f.write_base64("b.bin", b"\0\1\2")
        assert await f.read_base64("b.bin") == b"\0\1\2"
        page = await f.list(limit=2)
        assert len(page) == 2 and page.next_cursor
        names = [e.path async for e in f.iter(page_size=2)]
        assert names == sorted(["a.txt", "gen.bin", "sync-iter.bin", "l.bin", "b.bin"], key=lambda n: n)
        src = tmp_path / "src"
        (src / "x" / "y").mkdir(parents=True)
        (src / "x" / "y" / "f.txt").write_text("deep\n")
        (src / "top.bin").write_bytes(os.urandom(70_000))
        res = await f.upload_dir(src, "src")
        assert res.files == 2
        got = await f.download_dir("src", tmp_path / "out")
        assert got.files == 2 and (tmp_path / "out" / "x" / "y" / "f.txt").read_text() == "deep\n"
        assert (tmp_path / "out" / "top.bin").read_bytes() == (src / "top.bin").read_bytes()
        raw = b"".join([c async for c in await f.download_archive("src")])
        await f.upload_archive("copy", raw)
        assert await f.read("copy/x/y/f.txt") == b"deep\n"
        data = os.urandom(3 << 20)
        res = await f.upload_parts(io.BytesIO(data), "parts.bin", part_size=1 << 20)
        assert res.complete and (await sb.exec("sha256sum parts.bin")).stdout.split()[0] == hashlib.sha256(data).hexdigest()
        (tmp_path / "p2").write_bytes(b"abc")
        assert (await f.upload_parts(tmp_path / "p2", "p2")).complete
        digest = hashlib.sha256(b"xy").hexdigest()
        assert not (await f.write_part("wp", offset=0, size=2, sha256=digest, data=b"x")).complete
        with pytest.raises(hutch.FileError) as e:
            await f.write_part("wp", offset=0, size=2, sha256=digest, data=b"zz")
        assert e.value.code == "sandbox_file_part_mismatch"
        with pytest.raises(hutch.FileError) as e:
            await f.read("../x")
        assert e.value.code == "invalid_path"
        g = await sb.access.create(8000, expires_in=30)
        assert g.token and [x.id for x in await sb.access.list()] == [g.id]
        await sb.access.revoke(g)
        await sb.access.create(8000)
        await sb.access.revoke_all()
        assert await sb.access.list() == []


async def test_templates_builds_keys(aclient: hutch.AsyncHutch, daemon, tmp_path: Path):
    t = await aclient.templates.create(f"sdk-{marker()}", env={"A": "1"}, warm={"min": 0, "max": 1})
    assert t.id in [x.id for x in await aclient.templates.list()]
    assert (await aclient.templates.get(t)).name == t.name
    assert (await aclient.templates.update(t.id, env={"A": "2"})).version == 2
    (tmp_path / "Dockerfile").write_text("RUN echo async-build\nCMD exec sleep 1000\n")
    seen = []

    async def on_log(line: str) -> None:
        seen.append(line)

    b = await aclient.templates.build(t, tmp_path, on_log=on_log)
    assert b.state == "succeeded" and any("async-build" in s for s in seen)
    assert [x.id for x in await aclient.templates.builds.list(t)] == [b.id]
    assert (await aclient.templates.builds.get(t, b.id)).state == "succeeded"
    assert any(["async-build" in s async for s in aclient.templates.builds.logs(t, b.id)])
    (tmp_path / "Dockerfile").write_text("RUN exit 7\n")
    with pytest.raises(hutch.BuildError) as e:
        await aclient.templates.build(t, tmp_path, on_log=seen.append)
    assert e.value.code == "build_failed"
    queued = await aclient.templates.build(t, tmp_path, wait=False)
    assert not queued.done
    await aclient.templates.delete(t)
    assert any(i.name.startswith(t.id) for i in await aclient.images.list())
    k = await aclient.keys.create(f"sdk-{marker()}", quotas={"max_sandboxes": 3})
    try:
        assert k.id in [x.id for x in await aclient.keys.list()]
        assert (await aclient.keys.update(k.id, quotas={"max_builds": 1})).quotas == hutch.Quotas(max_builds=1)
        async with hutch.AsyncHutch(daemon.base, k.secret) as mine:
            assert (await mine.usage()).key_id == k.id
            with pytest.raises(hutch.PermissionDeniedError):
                await mine.keys.list()
        assert (await aclient.usage(k.id)).key_id == k.id
    finally:
        await aclient.keys.revoke(k.id)
    assert await aclient.health() is True
    assert "paths" in await aclient.openapi()
    assert "hutch" in await aclient.metrics()


async def test_an_async_client_passed_in_carries_every_call(daemon, admin_key):
    import httpx

    seen = []

    async def hook(r: httpx.Request) -> None:
        seen.append((r.method, r.url.path))

    async with httpx.AsyncClient(event_hooks={"request": [hook]}) as h:
        c = hutch.AsyncHutch(daemon.base, admin_key, http_client=h)
        async with c.sandboxes.create(ttl="2m") as sb:
            assert (await sb.exec("echo through")).stdout == "through\n"
        await c.close()
        assert not h.is_closed
    assert ("POST", f"/v1/sandboxes/{sb.id}/exec") in seen and ("DELETE", f"/v1/sandboxes/{sb.id}") in seen
