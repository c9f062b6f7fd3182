"""Snapshot export through both clients: `snapshots.export` saves the image
archive (`GET /v1/snapshots/{id}/export`), and the daemon's refusals raise
the error families (`snapshot_not_exportable`: ConflictError; another key's
or unknown: NotFoundError)."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import uuid
from pathlib import Path

import httpx
import hutch
import pytest


def _tar(members: dict) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            if data is None:
                ti.type, ti.mode = tarfile.DIRTYPE, 0o755
                t.addfile(ti)
            else:
                ti.size, ti.mode = len(data), 0o644
                t.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _image(daemon, tmp_path: Path) -> str:
    """A one-layer store image (a marker file), imported with the CLI."""
    layer = _tar({"etc": None, "etc/marker": uuid.uuid4().hex.encode()})
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                         "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]}})
    cname = hashlib.sha256(config.encode()).hexdigest() + ".json"
    manifest = json.dumps([{"Config": cname, "RepoTags": ["x/y:1"], "Layers": ["l/layer.tar"]}])
    path = tmp_path / "image.tar"
    path.write_bytes(_tar({"manifest.json": manifest.encode(), cname: config.encode(), "l/layer.tar": layer}))
    name = f"sdkexp-{uuid.uuid4().hex[:8]}"
    p = daemon.cli("image", "import", "--local", str(path), "--name", name, timeout=120)
    assert p.returncode == 0, p.stderr
    return name


def _snapshot(daemon, key: str, sandbox_id: str) -> str:
    r = httpx.post(f"{daemon.base}/v1/sandboxes/{sandbox_id}/snapshots", json={},
                   headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_export_saves_the_archive_and_refusals_raise(client: hutch.Hutch, daemon, admin_key, tmp_path: Path,
                                                     user_key):
    image = _image(daemon, tmp_path)
    tpl = client.templates.create(f"sdkexp-{uuid.uuid4().hex[:8]}", image=image)
    try:
        with client.sandboxes.create(template=tpl.name, ttl="5m") as sb:
            sb.files.write("/workspace/kept.txt", b"from the sandbox")
            snap = _snapshot(daemon, admin_key, sb.id)
            out = tmp_path / "snap.tar"
            n = client.snapshots.export(snap, out)
            assert n == out.stat().st_size > 0
            assert b"".join(client.snapshots.export_stream(snap)) == out.read_bytes()
            with tarfile.open(out) as t:
                [entry] = json.loads(t.extractfile("manifest.json").read())
                top = t.extractfile(entry["Layers"][-1]).read()
            with tarfile.open(fileobj=io.BytesIO(top)) as layer:
                assert layer.extractfile("workspace/kept.txt").read() == b"from the sandbox"
            other = user_key()
            with hutch.Hutch(daemon.base, other.secret) as stranger:
                with pytest.raises(hutch.NotFoundError):
                    stranger.snapshots.export(snap, tmp_path / "never")
            assert not (tmp_path / "never").exists()
        # A sandbox on `base`: no image layers under its files.
        with client.sandboxes.create(ttl="5m") as sb:
            on_base = _snapshot(daemon, admin_key, sb.id)
        with pytest.raises(hutch.ConflictError) as e:
            client.snapshots.export(on_base, tmp_path / "base.tar")
        assert e.value.code == "snapshot_not_exportable"
        assert not (tmp_path / "base.tar").exists(), "a refused export leaves no file"
    finally:
        client.templates.delete(tpl.id)
        daemon.cli("image", "rm", image)


async def test_async_export(aclient: hutch.AsyncHutch, daemon, admin_key, tmp_path: Path):
    async with aclient.sandboxes.create(ttl="5m") as sb:
        on_base = _snapshot(daemon, admin_key, sb.id)
    with pytest.raises(hutch.ConflictError):
        await aclient.snapshots.export(on_base, tmp_path / "base.tar")
    with pytest.raises(hutch.NotFoundError):
        await aclient.snapshots.export("snap-0123456789abcdef", io.BytesIO())
