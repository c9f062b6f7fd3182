"""Templates, builds (from a directory and from a tar.gz, with live logs),
images, keys and usage, and the daemon's own routes, through the sync client."""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

import hutch
import pytest

from conftest import marker


def test_template_create_list_get_update_delete(client: hutch.Hutch):
    name = f"sdk-{marker()}"
    t = client.templates.create(
        name,
        image="base",
        class_="container",
        memory_mb=256,
        vcpus=0.5,
        disk_mib=256,
        pids=128,
        env={"MODE": "t"},
        default_ttl="5m",
        max_ttl="1h",
        warm=(0, 2),
        startup="sleep 1000",
        readiness={"command": "true", "timeout_seconds": 10},
        network="deny_all",
    )
    assert t.id.startswith("tpl-") and t.name == name and t.version == 1
    assert (t.memory_mb, t.limits.vcpus, t.limits.disk_mib, t.limits.pids) == (256, 0.5, 256, 128)
    assert t.env == {"MODE": "t"} and t.default_ttl_seconds == 300 and t.max_ttl_seconds == 3600
    assert t.warm == hutch.Warm(0, 2) and t.startup == "sleep 1000" and t.readiness.command == "true"
    assert t.network.egress == "deny_all" and t.class_ == "container"
    assert t.id in [x.id for x in client.templates.list()]
    assert client.templates.get(t.id) == t
    with client.sandboxes.create(name, wait="30s") as sb:
        assert sb.info.template_id == t.id and sb.exec("echo $MODE").stdout == "t\n"
        assert any(p.tag == "startup" for p in sb.processes())
    u = client.templates.update(t, env={"MODE": "u"}, startup=None, readiness=None)
    assert u.version == 2 and u.env == {"MODE": "u"} and u.startup is None and u.readiness is None
    assert client.templates.update(t.id, max_ttl="2h").max_ttl_seconds == 7200
    with pytest.raises(hutch.ConflictError) as e:
        client.templates.create(name)
    assert e.value.code == "template_name_taken"
    with pytest.raises(hutch.InvalidRequestError) as e:
        client.templates.create(f"sdk-{marker()}", image="no-such-image")
    assert e.value.code == "image_not_found"
    client.templates.delete(t)
    with pytest.raises(hutch.NotFoundError):
        client.templates.get(t.id)


def test_build_from_a_directory_with_live_logs(client: hutch.Hutch, tmp_path: Path):
    t = client.templates.create(f"sdk-{marker()}")
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(
        "COPY app/hello.txt /workspace/\nRUN echo building-now && cat /workspace/hello.txt\nCMD exec sleep 1000\n"
    )
    (ctx / "app").mkdir()
    (ctx / "app" / "hello.txt").write_text("hello from the context\n")
    lines: list = []
    b = client.templates.build(t, ctx, on_log=lines.append)
    assert b.state == "succeeded" and b.version == 2 and b.done
    text = "\n".join(lines)
    assert "Step 2/3: RUN echo building-now" in text and "building-now" in text, text
    assert [x.id for x in client.templates.builds.list(t)] == [b.id]
    assert client.templates.builds.get(t.id, b.id) == b
    assert "hello from the context" in "\n".join(client.templates.builds.logs(t, b.id))
    with client.sandboxes.create(t.name, wait="60s") as sb:
        assert sb.files.read("hello.txt") == b"hello from the context\n"
    images = {i.name: i for i in client.images.list()}
    image = images[f"{t.id}-v{b.version}"]
    assert image.layers >= 1 and b.id in image.source
    assert client.templates.get(t).image == image.name


def _tgz(files: dict) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_build_from_a_tar_gz_and_build_failures(client: hutch.Hutch, tmp_path: Path):
    t = client.templates.create(f"sdk-{marker()}")
    path = tmp_path / "ctx.tar.gz"
    path.write_bytes(_tgz({"Dockerfile": "RUN echo from-tgz\nCMD exec sleep 1000\n"}))
    b = client.templates.build(t.id, path)
    assert b.state == "succeeded"
    queued = client.templates.build(t.id, _tgz({"Dockerfile": "RUN echo bytes\nCMD exec sleep 1000\n"}), wait=False)
    assert queued.state in ("queued", "building") and not queued.done
    assert any("bytes" in line for line in client.templates.builds.logs(t, queued.id, follow=True))
    with pytest.raises(hutch.BuildError) as e:
        client.templates.build(t, _tgz({"Dockerfile": "RUN true\nFROM debian\n"}))
    assert e.value.code == "build_instruction_refused" and e.value.status == 400
    seen: list = []
    with pytest.raises(hutch.BuildError) as e:
        client.templates.build(t, io.BytesIO(_tgz({"Dockerfile": "RUN echo failing-step; exit 3\n"})), on_log=seen.append)
    assert e.value.code == "build_failed" and e.value.build.state == "failed" and "exit code 3" in e.value.build.error
    assert any("failing-step" in s for s in seen)
    with pytest.raises(hutch.ArchiveError) as e:
        client.templates.build(t, gzip.compress(b"not a tar"))
    assert e.value.code == "sandbox_archive_invalid"


def test_images_keys_usage_and_the_daemon(client: hutch.Hutch, daemon, user_key):
    k = user_key(max_sandboxes=2, max_memory_mb=2048)
    assert k.secret and not k.admin and k.quotas == hutch.Quotas(max_sandboxes=2, max_memory_mb=2048)
    assert k.id in [x.id for x in client.keys.list()]
    k2 = client.keys.update(k.id, quotas=hutch.Quotas(max_sandboxes=1))
    assert k2.quotas == hutch.Quotas(max_sandboxes=1)
    with hutch.Hutch(daemon.base, k.secret) as mine:
        u = mine.usage()
        assert u.key_id == k.id and u.sandboxes == 0 and u.quotas.max_sandboxes == 1
        mine.sandboxes.create(ttl=60)
        assert client.usage(k.id).sandboxes == 1
        with pytest.raises(hutch.PermissionDeniedError):
            mine.usage(k.id + "x")
        client.keys.revoke(k.id)
        with pytest.raises(hutch.AuthenticationError):
            mine.usage()
    e2b = user_key(e2b=True)
    assert e2b.secret.startswith("e2b_")
    assert client.health() is True
    assert "/v1/sandboxes" in client.openapi()["paths"]
    assert "hutch_" in client.metrics()
