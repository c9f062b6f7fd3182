"""Files through the sync client: raw reads and writes (streamed), the base64
routes, listings with cursors, archives both ways, directories round trip,
file parts, and port access grants."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import time
from pathlib import Path

import httpx
import hutch
import pytest


def test_write_and_read_raw(sandbox: hutch.Sandbox, tmp_path: Path):
    f = sandbox.files
    f.write("a.txt", b"hi")
    assert f.read("a.txt") == b"hi" and f.read("/workspace/a.txt") == b"hi"
    f.write("t.txt", "text ü")
    assert f.read_text("t.txt") == "text ü"
    f.write("it.bin", (bytes([i]) * 1000 for i in range(256)))
    assert f.read("it.bin") == b"".join(bytes([i]) * 1000 for i in range(256))
    src = io.BytesIO(b"skip" + b"from a file object")
    src.seek(4)
    f.write("fo.txt", src)
    assert f.read("fo.txt") == b"from a file object"
    local = tmp_path / "up.bin"
    local.write_bytes(os.urandom(3 << 20))
    f.upload(local, "up.bin")
    assert b"".join(f.stream("up.bin", chunk_size=1 << 16)) == local.read_bytes()
    out = tmp_path / "down.bin"
    assert f.download("up.bin", out) == 3 << 20
    assert out.read_bytes() == local.read_bytes()
    buf = io.BytesIO()
    f.download("a.txt", buf)
    assert buf.getvalue() == b"hi"
    assert sandbox.exec("stat -c %a a.txt").stdout == "600\n"


def test_base64_routes(sandbox: hutch.Sandbox):
    data = bytes(range(256)) * 10
    sandbox.files.write_base64("b64.bin", data)
    assert sandbox.files.read_base64("b64.bin") == data
    assert sandbox.files.read("b64.bin") == data
    with pytest.raises(ValueError):
        sandbox.files.write_base64("big", b"x" * ((8 << 20) + 1))
    sandbox.files.write("big.bin", b"y" * ((8 << 20) + 1))
    with pytest.raises(hutch.FileError) as e:
        sandbox.files.read_base64("big.bin")
    assert e.value.code == "payload_too_large" and e.value.status == 413


def test_file_errors_carry_their_codes(sandbox: hutch.Sandbox, tmp_path: Path):
    with pytest.raises(hutch.FileError) as e:
        sandbox.files.read("../etc/passwd")
    assert e.value.code == "invalid_path"
    with pytest.raises(hutch.NotFoundError) as e:
        sandbox.files.write("no/such/dir/f", b"x")
    assert e.value.code == "not_found" and "create it first" in e.value.message
    with pytest.raises(hutch.FileError) as e:
        sandbox.files.list("/workspace/missing")
    assert e.value.code == "sandbox_path_not_directory"
    with pytest.raises(hutch.HutchError) as e:
        sandbox.files.read("missing.txt")
    assert e.value.status in (400, 404, 409), e.value
    with pytest.raises(hutch.HutchError):
        sandbox.files.download("missing.txt", tmp_path / "never")
    assert not list(tmp_path.iterdir())


def test_listings_page_with_cursors(sandbox: hutch.Sandbox):
    sandbox.exec("mkdir -p d/e && for i in 1 2 3 4 5; do echo $i > d/f$i; done && echo x > d/e/g")
    page = sandbox.files.list("d", limit=2)
    assert [e.path for e in page] == ["e", "e/g"] and page.next_cursor
    rest = sandbox.files.list("d", limit=2, cursor=page.next_cursor)
    assert [e.path for e in rest] == ["f1", "f2"]
    every = list(sandbox.files.iter("d", page_size=3, include_sha256=True))
    assert [e.path for e in every] == ["e", "e/g", "f1", "f2", "f3", "f4", "f5"]
    f1 = every[2]
    assert f1.type == "file" and f1.size == 2 and f1.sha256 == hashlib.sha256(b"1\n").hexdigest()
    assert every[0].type == "directory"
    top = sandbox.files.list("/workspace/d", recursive=False)
    assert [e.path for e in top] == ["e", "f1", "f2", "f3", "f4", "f5"] and top.next_cursor is None


def _tree(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): (None if p.is_dir() else p.read_bytes()) for p in root.rglob("*")}


def test_upload_dir_and_download_dir_round_trip(sandbox: hutch.Sandbox, tmp_path: Path):
    src = tmp_path / "src"
    (src / "pkg" / "deep" / "deeper").mkdir(parents=True)
    (src / "empty").mkdir()
    (src / "pkg" / "__init__.py").write_text("print('hi')\n")
    (src / "pkg" / "deep" / "deeper" / ("n" * 150 + ".txt")).write_text("long name\n")
    (src / "blob.bin").write_bytes(os.urandom((2 << 20) + 123))
    (src / "run.sh").write_text("#!/bin/sh\necho run\n")
    (src / "run.sh").chmod(0o755)
    res = sandbox.files.upload_dir(src, "src")
    assert res.files == 4 and res.bytes == sum(len(v) for v in _tree(src).values() if v)
    assert sandbox.exec("sh src/run.sh && ./src/run.sh").stdout == "run\nrun\n"
    assert sandbox.exec("python3 -B -c 'import pkg'", cwd="/workspace/src").stdout == "hi\n"
    # Again merges into what is there.
    (src / "later.txt").write_text("later\n")
    sandbox.files.upload_dir(src, "src")
    sandbox.exec("mkdir -p src/made/there && echo inside > src/made/there/f && ln -s pkg src/link")
    out = tmp_path / "out"
    got = sandbox.files.download_dir("src", out)
    expected = _tree(src)
    expected.update({"made": None, "made/there": None, "made/there/f": b"inside\n"})
    tree = _tree(out)
    assert os.readlink(out / "link") == "pkg" and got.symlinks == 1
    tree.pop("link")
    assert tree == expected
    assert os.stat(out / "run.sh").st_mode & 0o111
    # Into an existing directory: merged.
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "mine.txt").write_text("kept")
    sandbox.files.download_dir("src/made", tmp_path / "existing")
    assert _tree(tmp_path / "existing") == {"mine.txt": b"kept", "there": None, "there/f": b"inside\n"}
    with pytest.raises(ValueError, match="symlink"):
        (src / "sym").symlink_to("blob.bin")
        sandbox.files.upload_dir(src, "src2")
    res = sandbox.files.upload_dir(src, "src3", follow_symlinks=True)
    assert sandbox.files.read("src3/sym") == (src / "blob.bin").read_bytes()


def test_archives_up_and_down(sandbox: hutch.Sandbox, tmp_path: Path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for name, data in [("x/one.txt", b"1"), ("two.txt", b"22")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    tgz = buf.getvalue()
    res = sandbox.files.upload_archive("arch", tgz)
    assert (res.files, res.bytes) == (2, 3) and res.path.endswith("arch")
    path = tmp_path / "a.tgz"
    path.write_bytes(tgz)
    sandbox.files.upload_archive("arch2", path)
    sandbox.files.upload_archive("arch3", io.BytesIO(tgz))
    sandbox.files.upload_archive("arch4", iter([tgz[:10], tgz[10:]]))
    for d in ("arch", "arch2", "arch3", "arch4"):
        assert sandbox.files.read(f"{d}/x/one.txt") == b"1"
    raw = b"".join(sandbox.files.download_archive("arch"))
    with tarfile.open(fileobj=io.BytesIO(raw)) as t:
        assert sorted(t.getnames()) == ["two.txt", "x", "x/one.txt"]
    with pytest.raises(hutch.ArchiveError) as e:
        sandbox.files.upload_archive("bad", b"not a tar at all" * 100)
    assert e.value.code == "sandbox_archive_invalid"


def test_file_parts(sandbox: hutch.Sandbox, tmp_path: Path):
    local = tmp_path / "parts.bin"
    local.write_bytes(os.urandom((20 << 20) + 5))
    res = sandbox.files.upload_parts(local, "parts.bin")
    assert res.complete and res.size == res.received == (20 << 20) + 5
    sha = hashlib.sha256(local.read_bytes()).hexdigest()
    assert sandbox.exec("sha256sum parts.bin").stdout.split()[0] == sha
    res = sandbox.files.upload_parts(io.BytesIO(b"small"), "small.bin", part_size=2)
    assert res.complete and sandbox.files.read("small.bin") == b"small"
    whole = b"abcdef"
    digest = hashlib.sha256(whole).hexdigest()
    with pytest.raises(hutch.FileError) as e:
        sandbox.files.write_part("p.bin", offset=3, size=6, sha256=digest, data=b"def")
    assert e.value.code == "sandbox_file_part_out_of_order"
    r = sandbox.files.write_part("p.bin", offset=0, size=6, sha256=digest, data=b"abc")
    assert r.received == 3 and not r.complete
    r = sandbox.files.write_part("p.bin", offset=3, size=6, sha256=digest, data=b"def")
    assert r.complete and sandbox.files.read("p.bin") == whole


def test_port_access_grants(sandbox: hutch.Sandbox):
    sandbox.exec("mkdir -p site && echo served > site/index.html")
    server = sandbox.exec("exec python3 -m http.server 8080 --bind 127.0.0.1", cwd="/workspace/site",
                          background=True)
    g = sandbox.access.create(8080, expires_in="2m")
    assert g.port == 8080 and g.token and g.url.startswith(f"http://{sandbox.id}--8080.")
    assert g.path_url.endswith(f"/v1/sandboxes/{sandbox.id}/ports/8080/") and g.cookie_url.endswith("/_hutch/access")

    def fetch(headers):
        return httpx.get(g.path_url + "index.html", headers=headers, timeout=10)

    deadline = time.monotonic() + 20
    while (r := fetch(g.headers)).status_code == 502 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r.status_code == 200 and r.text == "served\n"
    listed = sandbox.access.list()
    assert [x.id for x in listed] == [g.id] and listed[0].token is None
    with pytest.raises(ValueError):
        listed[0].headers
    sandbox.access.revoke(g)
    sandbox.access.revoke(g.id)  # again: a no-op
    denied = fetch(g.headers)
    assert denied.status_code == 401 and denied.json()["code"] == "access_token_invalid"
    assert isinstance(hutch._errors.error_from_answer(401, denied.content), hutch.PortAccessError)
    sandbox.access.create(8080)
    sandbox.access.create(8080)
    assert len(sandbox.access.list()) == 2
    sandbox.access.revoke_all()
    assert sandbox.access.list() == []
    with pytest.raises(hutch.InvalidRequestError):
        sandbox.access.create(65535)
    server.kill()
