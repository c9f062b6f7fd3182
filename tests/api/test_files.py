"""Files: base64 reads and writes, raw byte streams, tar archives, files in
parts, listings, and a full disk.

Semantics follow "Read and write files", "Upload a directory as a tar
archive", "Write a file larger than 8 MiB" and "List files" of the Volcano
reference (/work/shared/reference/volcano-sandboxes.md), with hutch's paths:
absolute in the sandbox or relative to /workspace. Wire types are those of
crates/hutch-api (FileData, Listing, ArchiveResult, FilePart, FilePartResult).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import hmac
import io
import os
import socket
import tarfile
import threading
import zlib
from pathlib import Path
from typing import Iterable

import pytest
import requests

from conftest import REQUEST_TIMEOUT, Client, Daemon, expect_error, expect_status, host_processes_of, wait_for
from conftest import GVISOR_STATX, on_class

MiB = 1 << 20
FILE_DATA_CAP = 8 * MiB


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write(api: Client, sid: str, path: str, data: bytes):
    return api.post(f"/v1/sandboxes/{sid}/files/write", {"path": path, "data": b64(data)})


def read(api: Client, sid: str, path: str):
    return api.post(f"/v1/sandboxes/{sid}/files/read", {"path": path})


def listing(api: Client, sid: str, **params) -> dict:
    params = {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in params.items()}
    r = api.get(f"/v1/sandboxes/{sid}/files/list", params=params)
    expect_status(r, 200)
    return r.json()


def tar_of(entries: list[tuple], gz: bool = False) -> bytes:
    """entries: (name, bytes | None for a directory, mode) or (name, 'symlink', target)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data, extra in entries:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, extra
                tf.addfile(info)
            elif data == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, extra
                tf.addfile(info)
            elif data == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, extra
                tf.addfile(info)
            else:
                info.size, info.mode = len(data), extra
                tf.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    return gzip.compress(raw) if gz else raw


def upload(api: Client, sid: str, path: str, archive: bytes, name: str = "a.tar"):
    return api.request(
        "POST",
        f"/v1/sandboxes/{sid}/archives",
        files={"path": (None, path), "archive": (name, archive, "application/octet-stream")},
    )


# ---------------------------------------------------------------- read and write


@on_class("gvisor", reason=GVISOR_STATX)
def test_write_then_read_round_trips_and_belongs_to_the_user(api: Client, sandbox: dict):
    sid = sandbox["id"]
    data = b"hello\n\x00\xff binary"
    r = write(api, sid, "hello.txt", data)
    assert r.status_code in (200, 204), r.text
    r = read(api, sid, "hello.txt")
    expect_status(r, 200)
    assert base64.b64decode(r.json()["data"]) == data
    # Absolute and relative name the same file.
    r = read(api, sid, "/workspace/hello.txt")
    expect_status(r, 200)
    assert base64.b64decode(r.json()["data"]) == data
    assert api.sh(sid, "sha256sum hello.txt").split()[0] == sha(data)
    owner, mode = api.sh(sid, "stat -c '%u %a' hello.txt").split()
    assert owner == "1000", "the written file does not belong to the session user"
    assert int(mode, 8) & 0o077 == 0, f"the written file is readable by others: mode {mode}"
    # Overwrite.
    assert write(api, sid, "hello.txt", b"v2").status_code in (200, 204)
    assert base64.b64decode(read(api, sid, "hello.txt").json()["data"]) == b"v2"


def test_write_needs_the_parent_directory(api: Client, sandbox: dict):
    sid = sandbox["id"]
    r = write(api, sid, "missing/dir/file.txt", b"x")
    assert 400 <= r.status_code < 500, r.text
    api.sh(sid, "mkdir -p nested")
    assert write(api, sid, "nested/file.bin", b"x").status_code in (200, 204)
    assert api.sh(sid, "cat nested/file.bin") == "x"


@pytest.mark.parametrize("path", ["../etc/passwd", "/workspace/../etc/passwd", "a/../../b", "", "a\x00b"])
def test_malformed_paths_are_refused(api: Client, sandbox: dict, path: str):
    expect_error(write(api, sandbox["id"], path, b"x"), 400, "invalid_path")
    expect_error(read(api, sandbox["id"], path), 400, "invalid_path")


def test_read_of_a_missing_file_is_404(api: Client, sandbox: dict):
    expect_error(read(api, sandbox["id"], "nope.txt"), 404, "not_found")


def test_base64_data_is_capped_at_8_mib(api: Client, sandbox: dict):
    sid = sandbox["id"]
    ok = os.urandom(FILE_DATA_CAP)
    assert write(api, sid, "cap.bin", ok).status_code in (200, 204)
    assert api.sh(sid, "sha256sum cap.bin").split()[0] == sha(ok)
    r = write(api, sid, "over.bin", ok + b"x")
    assert r.status_code in (400, 413), r.text
    assert api.exec(sid, "test -e over.bin")["exit_code"] != 0
    r = api.post(f"/v1/sandboxes/{sid}/files/write", {"path": "bad.bin", "data": "not base64!"})
    expect_error(r, 400, "invalid_request")


def test_files_of_an_unknown_sandbox_are_404(api: Client):
    sid = "sb-0000000000000000"
    expect_error(read(api, sid, "x"), 404, "not_found")
    expect_error(write(api, sid, "x", b"x"), 404, "not_found")
    expect_error(api.get(f"/v1/sandboxes/{sid}/files", params={"path": "x"}), 404, "not_found")
    expect_error(api.get(f"/v1/sandboxes/{sid}/files/list"), 404, "not_found")


def test_files_survive_suspend_and_resume(api: Client, sandbox: dict):
    sid = sandbox["id"]
    assert write(api, sid, "kept.bin", b"kept").status_code in (200, 204)
    expect_status(api.post(f"/v1/sandboxes/{sid}/suspend"), 200)
    expect_status(api.post(f"/v1/sandboxes/{sid}/resume"), 200)
    assert base64.b64decode(read(api, sid, "kept.bin").json()["data"]) == b"kept"


# ---------------------------------------------------------------- raw streams


def test_raw_put_and_get_stream_bytes(api: Client, sandbox: dict):
    sid = sandbox["id"]
    data = os.urandom(3 * MiB + 123)
    r = api.request("PUT", f"/v1/sandboxes/{sid}/files", params={"path": "raw/blob.bin"},
                    data=data, headers={"Content-Type": "application/octet-stream"})
    if r.status_code >= 400:
        # Parents may have to exist, as for /files/write.
        api.sh(sid, "mkdir -p raw")
        r = api.request("PUT", f"/v1/sandboxes/{sid}/files", params={"path": "raw/blob.bin"},
                        data=data, headers={"Content-Type": "application/octet-stream"})
    assert r.status_code in (200, 201, 204), r.text
    assert api.sh(sid, "sha256sum raw/blob.bin").split()[0] == sha(data)
    r = api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/workspace/raw/blob.bin"}, stream=True)
    expect_status(r, 200)
    got = b"".join(r.iter_content(64 * 1024))
    assert len(got) == len(data) and got == data
    # Larger than the base64 cap: raw streams have none.
    big = os.urandom(12 * MiB)
    r = api.request("PUT", f"/v1/sandboxes/{sid}/files", params={"path": "big.bin"}, data=big)
    assert r.status_code in (200, 201, 204), r.text
    r = api.get(f"/v1/sandboxes/{sid}/files", params={"path": "big.bin"})
    expect_status(r, 200)
    assert r.content == big
    expect_error(api.get(f"/v1/sandboxes/{sid}/files", params={"path": "nope"}), 404, "not_found")
    expect_error(api.get(f"/v1/sandboxes/{sid}/files", params={"path": "../x"}), 400, "invalid_path")


def test_a_full_disk_is_409_sandbox_disk_full(api: Client):
    sb = api.create(limits={"disk_mib": 32})
    sid = sb["id"]
    try:
        r = api.request("PUT", f"/v1/sandboxes/{sid}/files", params={"path": "fill.bin"}, data=os.urandom(48 * MiB))
        expect_error(r, 409, "sandbox_disk_full")
        api.sh(sid, "rm -f fill.bin")
        codes = []
        for i in range(8):
            r = write(api, sid, f"chunk{i}.bin", os.urandom(6 * MiB))
            codes.append(r.status_code)
            if r.status_code >= 400:
                expect_error(r, 409, "sandbox_disk_full")
                break
        assert codes[-1] == 409, f"48 MiB fitted into a 32 MiB disk: {codes}"
    finally:
        api.destroy(sid)


# ---------------------------------------------------------------- archives


@on_class("gvisor", reason=GVISOR_STATX)
def test_archive_upload_writes_a_tree(api: Client, sandbox: dict):
    sid = sandbox["id"]
    entries = [
        ("src", None, 0o755),
        ("src/main.py", b"print('hi')\n", 0o755),
        ("src/lib", None, 0o700),
        ("src/lib/util.py", b"X = 1\n", 0o644),
        ("README", b"readme\n", 0o4755),  # setuid is dropped
    ]
    for gz in (False, True):
        dest = "repo-gz" if gz else "repo"
        r = upload(api, sid, dest, tar_of(entries, gz=gz), "repo.tgz" if gz else "repo.tar")
        expect_status(r, (200, 201))
        res = r.json()
        assert res["path"] in (dest, f"/workspace/{dest}"), res
        assert res["files"] in (3, 5), res  # files, or files and directories
        assert res["bytes"] == len(b"print('hi')\n") + len(b"X = 1\n") + len(b"readme\n"), res
        assert api.sh(sid, f"cat {dest}/src/main.py {dest}/src/lib/util.py {dest}/README") == \
            "print('hi')\nX = 1\nreadme\n"
        modes = api.sh(sid, f"cd {dest} && stat -c '%n %a %u' src src/main.py src/lib src/lib/util.py README")
        got = {line.split()[0]: (line.split()[1], line.split()[2]) for line in modes.splitlines()}
        assert got["src"] == ("755", "1000") and got["src/main.py"] == ("755", "1000"), got
        assert got["src/lib"] == ("700", "1000") and got["src/lib/util.py"] == ("644", "1000"), got
        assert got["README"] == ("755", "1000"), f"setuid not dropped: {got['README']}"


@pytest.mark.parametrize(
    "entries",
    [
        [("ok.txt", b"ok", 0o644), ("link", "symlink", "/etc/passwd")],
        [("ok.txt", b"ok", 0o644), ("hard", "hardlink", "ok.txt")],
        [("ok.txt", b"ok", 0o644), ("../escape.txt", b"x", 0o644)],
        [("ok.txt", b"ok", 0o644), ("/abs.txt", b"x", 0o644)],
    ],
    ids=["symlink", "hardlink", "dotdot", "absolute"],
)
def test_archives_with_forbidden_entries_write_nothing(api: Client, sandbox: dict, entries):
    sid = sandbox["id"]
    expect_error(upload(api, sid, "bad", tar_of(entries)), 400, "sandbox_archive_invalid")
    assert api.exec(sid, "test -e /workspace/bad || test -e /workspace/escape.txt || test -e /abs.txt")[
        "exit_code"] != 0, "a refused archive wrote something"


@pytest.mark.parametrize("dest", [".", "./", "/", "/workspace", "/workspace/."])
def test_archive_into_the_workspace_root_is_refused(api: Client, sandbox: dict, dest: str):
    r = upload(api, sandbox["id"], dest, tar_of([("f.txt", b"x", 0o644)]))
    expect_error(r, 400, "sandbox_archive_invalid")


def test_malformed_archives_and_forms_are_refused(api: Client, sandbox: dict):
    sid = sandbox["id"]
    expect_error(upload(api, sid, "junk", b"this is not a tar archive" * 100), 400, "sandbox_archive_invalid")
    r = api.request("POST", f"/v1/sandboxes/{sid}/archives", files={"path": (None, "x")})
    expect_error(r, 400, "sandbox_archive_invalid")


# ---------------------------------------------------------------- file parts


def put_part(api: Client, sid: str, path: str, whole: bytes, offset: int, end: int, digest: str | None = None):
    return api.post(f"/v1/sandboxes/{sid}/file-parts", {
        "path": path, "offset": offset, "size": len(whole), "sha256": digest or sha(whole),
        "data": b64(whole[offset:end]),
    })


@on_class("gvisor", reason=GVISOR_STATX)
def test_a_file_larger_than_8_mib_in_parts(api: Client, sandbox: dict):
    sid = sandbox["id"]
    whole = os.urandom(9 * MiB + 7)
    path = "cache/pkg.bin"  # missing parents are created
    r = put_part(api, sid, path, whole, 0, 8 * MiB)
    expect_status(r, 200)
    assert r.json() == {"path": r.json()["path"], "offset": 0, "size": len(whole), "received": 8 * MiB,
                        "complete": False}, r.json()
    # Nothing at the path until the last part.
    assert api.exec(sid, f"test -e {path}")["exit_code"] != 0
    # A part past the bytes received is out of order.
    expect_error(put_part(api, sid, path, whole, 8 * MiB + 1, len(whole)), 409, "sandbox_file_part_out_of_order")
    # Resending from earlier is fine.
    r = put_part(api, sid, path, whole, 4 * MiB, 8 * MiB)
    expect_status(r, 200)
    assert r.json()["received"] == 8 * MiB and r.json()["complete"] is False
    r = put_part(api, sid, path, whole, 8 * MiB, len(whole))
    expect_status(r, 200)
    assert r.json()["complete"] is True and r.json()["received"] == len(whole), r.json()
    assert api.sh(sid, f"sha256sum {path}").split()[0] == sha(whole)
    assert api.sh(sid, f"stat -c %u {path}").strip() == "1000"
    # Resending the finishing part answers the same completion.
    r = put_part(api, sid, path, whole, 8 * MiB, len(whole))
    expect_status(r, 200)
    assert r.json()["complete"] is True
    assert "sandbox-part" not in api.sh(sid, "ls -A cache")


def test_a_file_whose_digest_does_not_match_is_refused(api: Client, sandbox: dict):
    sid = sandbox["id"]
    whole = os.urandom(2 * MiB)
    wrong = sha(b"something else")
    expect_status(put_part(api, sid, "bad.bin", whole, 0, MiB, wrong), 200)
    expect_error(put_part(api, sid, "bad.bin", whole, MiB, len(whole), wrong), 409, "sandbox_file_part_mismatch")
    assert api.exec(sid, "test -e bad.bin")["exit_code"] != 0


def test_a_part_onto_a_directory_is_a_path_conflict(api: Client, sandbox: dict):
    sid = sandbox["id"]
    api.sh(sid, "mkdir -p adir")
    expect_error(put_part(api, sid, "adir", b"xy", 0, 2), 409, "sandbox_path_conflict")


# ---------------------------------------------------------------- listings


def test_list_files_with_types_sizes_modes_and_digests(api: Client, sandbox: dict):
    sid = sandbox["id"]
    api.sh(sid, "mkdir -p ls/src ls/logs && printf 'hello\\n' > ls/hello.txt && chmod 644 ls/hello.txt && "
                "printf 'print(1)\\n' > ls/src/main.py && chmod 755 ls/src/main.py && chmod 700 ls/src && "
                "ln -s hello.txt ls/latest && mkfifo ls/pipe")
    body = listing(api, sid, path="ls", include_sha256=True)
    entries = {e["path"]: e for e in body["entries"]}
    assert list(entries) == sorted(entries, key=lambda p: p.split("/")), "entries are not sorted by path"
    assert set(entries) == {"hello.txt", "latest", "logs", "pipe", "src", "src/main.py"}, entries
    assert entries["hello.txt"] == {**entries["hello.txt"], "type": "file", "size": 6, "mode": 0o644,
                                    "sha256": sha(b"hello\n")}
    assert entries["src/main.py"]["mode"] == 0o755 and entries["src/main.py"]["sha256"] == sha(b"print(1)\n")
    assert entries["src"]["type"] == "directory" and entries["src"]["size"] == 0 and entries["src"]["mode"] == 0o700
    assert entries["latest"]["type"] == "symlink" and "sha256" not in entries["latest"]
    assert entries["pipe"]["type"] == "other"
    # Without digests there are none; non-recursive lists direct entries only.
    assert all("sha256" not in e for e in listing(api, sid, path="ls")["entries"])
    flat = [e["path"] for e in listing(api, sid, path="/workspace/ls", recursive=False)["entries"]]
    assert flat == ["hello.txt", "latest", "logs", "pipe", "src"], flat


def test_list_files_pages_with_a_cursor(api: Client, sandbox: dict):
    sid = sandbox["id"]
    api.sh(sid, "mkdir -p pg && for i in $(seq 1 7); do echo $i > pg/f$i; done")
    everything = [e["path"] for e in listing(api, sid, path="pg")["entries"]]
    seen, cursor = [], None
    for _ in range(20):
        params = {"path": "pg", "limit": 3, **({"cursor": cursor} if cursor else {})}
        page = listing(api, sid, **params)
        assert len(page["entries"]) <= 3
        seen += [e["path"] for e in page["entries"]]
        cursor = page.get("next_cursor")
        if not cursor:
            break
    assert seen == everything and len(seen) == 7


def test_list_files_refusals(api: Client, sandbox: dict):
    sid = sandbox["id"]
    api.sh(sid, "echo x > afile && mkdir -p real && ln -sfn real via-link && mkdir -p locked && chmod 000 locked")
    for path in ("afile", "missing", "via-link"):
        expect_error(api.get(f"/v1/sandboxes/{sid}/files/list", params={"path": path}), 400,
                     "sandbox_path_not_directory")
    expect_error(api.get(f"/v1/sandboxes/{sid}/files/list", params={"path": "locked"}), 400,
                 "sandbox_path_unreadable")
    entries = {e["path"]: e for e in listing(api, sid)["entries"]}
    assert entries["locked"].get("unreadable") is True, entries["locked"]
    expect_error(api.get(f"/v1/sandboxes/{sid}/files/list", params={"limit": 0}), 400, "invalid_request")


# ---------------------------------------------------------------- streaming, bounded memory
#
# Issue 10, finding 2: the daemon buffered what it should stream. Every
# transfer now streams with a bounded buffer; the daemon's own peak RSS
# (VmHWM, read from /proc) must stay under 100 MiB while a test daemon of
# its own moves a GiB each way, inflates a gzip bomb, and takes a large
# archive and a large form in.

GiB = 1 << 30
RSS_BOUND_KIB = 100 * 1024


def vm_hwm_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


def envd_headers(d: Daemon, sid: str) -> dict:
    """The E2B in-sandbox headers of a sandbox: its id and access token
    (HMAC-SHA256 of the id under <state>/e2b.secret)."""
    secret = bytes.fromhex((d.state_dir / "e2b.secret").read_text().strip())
    token = hmac.new(secret, sid.encode(), hashlib.sha256).hexdigest()
    return {"E2b-Sandbox-Id": sid, "X-Access-Token": token}


def gzip_of_zeros(n: int, chunk: int = MiB):
    """A gzip stream of `n` zero bytes, made as it is sent."""
    z = zlib.compressobj(1, zlib.DEFLATED, 31)
    zeros = bytes(chunk)
    left = n
    while left:
        take = min(left, chunk)
        out = z.compress(zeros[:take])
        left -= take
        if out:
            yield out
    yield z.flush()


def tar_stream(files: list[tuple[str, int]], fill: bytes = b"x"):
    """An uncompressed tar of `files` (name, size), made as it is sent."""
    block = fill * (MiB // len(fill))
    for name, size in files:
        info = tarfile.TarInfo(name)
        info.size, info.mode = size, 0o644
        yield info.tobuf(format=tarfile.PAX_FORMAT)
        left = size
        while left:
            take = min(left, len(block))
            yield block[:take]
            left -= take
        if size % 512:
            yield bytes(512 - size % 512)
    yield bytes(1024)


def form_stream(fields: list[tuple[str, str | None, Iterable[bytes]]], boundary: str):
    """A multipart/form-data body of (name, filename, chunks), made as it is sent."""
    for name, filename, chunks in fields:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        yield f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode()
        yield from chunks
        yield b"\r\n"
    yield f"--{boundary}--\r\n".encode()


def healthz_while(d: Daemon, busy: threading.Event) -> tuple[threading.Thread, list]:
    """Asks /healthz again and again until `busy` is cleared; records each answer."""
    answers: list = []

    def run():
        s = requests.Session()
        while busy.is_set():
            try:
                answers.append(s.get(d.base + "/healthz", timeout=REQUEST_TIMEOUT).status_code)
            except requests.RequestException as e:
                answers.append(repr(e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, answers


@pytest.mark.slow
@pytest.mark.timeout(900)
@on_class("gvisor", reason=GVISOR_STATX)
def test_daemon_memory_stays_bounded_while_transfers_stream_a_gib_each_way(own_daemon: Daemon):
    d = own_daemon.start()
    api = d.client()
    sb = api.create(memory_mb=2048, limits={"disk_mib": 1536})
    sid = sb["id"]
    envd = envd_headers(d, sid)
    busy = threading.Event()
    busy.set()
    poller, health = healthz_while(d, busy)
    try:
        # 1 GiB in, gzip'd (1 MiB on the wire), through E2B's /files.
        r = requests.post(d.base + "/files", params={"path": "/home/user/big.bin"},
                          headers={**envd, "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
                          data=gzip_of_zeros(GiB), timeout=600)
        assert r.status_code == 200, r.text[:500]
        assert api.sh(sid, "stat -c %s /home/user/big.bin").strip() == str(GiB)

        # The same GiB out, as a tar of its directory, read as it comes.
        r = api.get(f"/v1/sandboxes/{sid}/archives", params={"path": "/home/user"}, stream=True, timeout=600)
        expect_status(r, 200)
        with tarfile.open(fileobj=r.raw, mode="r|") as tf:
            sizes = {m.name: m.size for m in tf}
        assert sizes.get("big.bin") == GiB, sizes
        api.sh(sid, "rm -f /home/user/big.bin")

        # A gzip bomb: 2 GiB of zeros in 2 MiB. Refused at the cap with
        # 413, nothing left behind.
        r = requests.post(d.base + "/files", params={"path": "/home/user/bomb.bin"},
                          headers={**envd, "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
                          data=gzip_of_zeros(2 * GiB), timeout=600)
        assert r.status_code == 413, (r.status_code, r.text[:500])
        assert r.json()["code"] == 413 and str(GiB) in r.json()["message"], r.text
        assert api.exec(sid, "test -e /home/user/bomb.bin")["exit_code"] != 0
        assert ".hutch-upload-" not in api.sh(sid, "ls -A /home/user")

        # An archive of 320 MiB (ten times the old in-memory cap) and a form
        # of 256 MiB, both streamed in.
        files = [(f"d/part{i}.bin", 32 * MiB) for i in range(10)]
        boundary = "hutch-test-boundary-7d3f"
        body = form_stream([("path", None, [b"big-archive"]), ("archive", "a.tar", tar_stream(files))], boundary)
        r = api.request("POST", f"/v1/sandboxes/{sid}/archives", data=body, timeout=600,
                        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
        expect_status(r, 200)
        assert (r.json()["files"], r.json()["bytes"]) == (10, 320 * MiB), r.json()
        assert api.sh(sid, "cat big-archive/d/* | wc -c").strip() == str(320 * MiB)
        api.sh(sid, "rm -rf big-archive")
        chunks = (bytes(MiB) for _ in range(256))
        body = form_stream([("file", "form.bin", chunks)], boundary)
        r = requests.post(d.base + "/files", params={"path": "/home/user/form.bin"}, data=body, timeout=600,
                          headers={**envd, "Content-Type": f"multipart/form-data; boundary={boundary}"})
        assert r.status_code == 200, r.text[:500]
        assert api.sh(sid, "stat -c %s /home/user/form.bin").strip() == str(256 * MiB)
    finally:
        busy.clear()
        poller.join(timeout=REQUEST_TIMEOUT + 5)
    peak = vm_hwm_kib(d.pid)
    print(f"daemon peak RSS (VmHWM): {peak} KiB")
    assert peak < RSS_BOUND_KIB, f"the daemon's peak RSS was {peak // 1024} MiB (bound {RSS_BOUND_KIB // 1024} MiB)"
    assert health and all(a == 200 for a in health), f"/healthz failed meanwhile: {[a for a in health if a != 200]}"


def test_a_raw_upload_whose_body_breaks_leaves_nothing(api: Client, daemon: Daemon, sandbox: dict):
    sid = sandbox["id"]
    api.sh(sid, "echo kept > kept.bin")
    for target in ("cut.bin", "kept.bin"):
        with socket.create_connection(("127.0.0.1", daemon.port), timeout=REQUEST_TIMEOUT) as s:
            s.sendall((f"PUT /v1/sandboxes/{sid}/files?path={target} HTTP/1.1\r\nHost: x\r\n"
                       f"Authorization: Bearer {api.key}\r\nContent-Length: {8 * MiB}\r\n\r\n").encode())
            s.sendall(os.urandom(3 * MiB))
        # The daemon sees the body end early; the temporary goes.
        wait_for("the upload's temporary to go", lambda: ".hutch-upload-" not in api.sh(sid, "ls -A"), timeout=30)
    assert api.exec(sid, "test -e cut.bin")["exit_code"] != 0, "a cut body was put in place"
    assert api.sh(sid, "cat kept.bin") == "kept\n", "a cut body replaced a file"


def test_archive_upload_needs_the_path_before_the_archive_and_bounds_part_headers(api: Client, sandbox: dict):
    sid = sandbox["id"]
    r = api.request("POST", f"/v1/sandboxes/{sid}/archives",
                    files=[("archive", ("a.tar", tar_of([("f.txt", b"x", 0o644)]))), ("path", (None, "late"))])
    expect_error(r, 400, "sandbox_archive_invalid")
    assert "before" in r.json()["error"]
    # A part whose headers never end is refused once it passes the bound,
    # not held until the body's cap.
    boundary = "b0undary"
    body = form_stream([("path", None, [b"x"])], boundary)
    endless = (b"X-Pad: " + b"a" * MiB for _ in range(64))
    def gen():
        yield from list(body)[:-1]
        yield f"--{boundary}\r\nContent-Disposition: form-data; name=\"archive\"\r\n".encode()
        yield from endless
    r = api.request("POST", f"/v1/sandboxes/{sid}/archives", data=gen(),
                    headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    expect_error(r, 400, "sandbox_archive_invalid")
    assert api.exec(sid, "test -e x")["exit_code"] != 0


def test_archive_entries_beyond_the_limits_are_refused(api: Client, sandbox: dict):
    sid = sandbox["id"]
    # A GNU long name of 300 MiB (300 KiB gzip'd): refused before it is
    # read, not read whole into the daemon's memory.
    hdr = tarfile.TarInfo("././@LongLink")
    hdr.type, hdr.size = tarfile.GNUTYPE_LONGNAME, 300 * MiB
    z = zlib.compressobj(1, zlib.DEFLATED, 31)
    packed = z.compress(hdr.tobuf(format=tarfile.GNU_FORMAT))
    for _ in range(300):
        packed += z.compress(bytes(MiB))
    packed += z.flush()
    expect_error(upload(api, sid, "ln", packed), 400, "sandbox_archive_invalid")
    # Content over 1 GiB, claimed by a header.
    big = tarfile.TarInfo("big")
    big.size = GiB + 1
    expect_error(upload(api, sid, "big", gzip.compress(big.tobuf(format=tarfile.GNU_FORMAT) + bytes(4096))), 413,
                 "sandbox_archive_too_large")
    assert api.exec(sid, "test -e ln || test -e big")["exit_code"] != 0


# ---------------------------------------------------------------- archive uploads and kill -9
#
# Issue 10, finding 8: an archive upload must leave the target exactly as it
# was or exactly as the archive makes it, even when the daemon is killed
# with -9 part way; a restarted daemon settles it when it adopts the sandbox.

FILES = 3000


def old_content(i: int) -> bytes:
    return f"old-{i}\n".encode()


def new_content(i: int) -> bytes:
    return f"new-{i}\n".encode() + b"." * 8000


def agent_root(sid: str) -> Path:
    """The sandbox's root as its PID 1 sees it, from the host."""
    for pid in host_processes_of([sid]):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        nspid = next((l.split()[1:] for l in status.splitlines() if l.startswith("NSpid:")), [])
        if nspid and nspid[-1] == "1":
            return Path(f"/proc/{pid}/root")
    raise AssertionError(f"no PID 1 of {sid} on the host")


def tree_digest(api: Client, sid: str, d: str) -> tuple[list[str], str]:
    names = api.sh(sid, f"cd {d} && LC_ALL=C ls -A").split()
    digest = api.sh(sid, f"cd {d} && LC_ALL=C cat $(LC_ALL=C ls -A) | sha256sum").split()[0]
    return names, digest


def expected(content) -> tuple[list[str], str]:
    names = sorted(f"f{i}" for i in range(FILES))
    h = hashlib.sha256()
    for n in names:
        h.update(content(int(n[1:])))
    return names, h.hexdigest()


def start_upload(d: Daemon, api: Client, sid: str) -> threading.Thread:
    archive = tar_of([(f"f{i}", new_content(i), 0o644) for i in range(FILES)])
    other = api.clone()

    def run():
        try:
            upload(other, sid, "t", archive)
        except requests.RequestException:
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def restart_and_check(d: Daemon, api: Client, sid: str, t: threading.Thread, root: Path) -> str:
    d.kill9()
    t.join(timeout=REQUEST_TIMEOUT)
    staged = [p.name for p in (root / "workspace/t").iterdir() if p.name.startswith(".hutch-archive-")]
    assert staged, "the kill came after the upload ended: nothing was interrupted"
    d.start()
    names, digest = tree_digest(api, sid, "/workspace/t")
    assert not [n for n in names if n.startswith(".hutch")], f"staging left after the restart: {names[:5]}"
    if (names, digest) == expected(old_content):
        return "old"
    assert (names, digest) == expected(new_content), "the target is neither exactly the old nor the new content"
    return "new"


def prepare(d: Daemon) -> tuple[Client, str, Path]:
    api = d.client()
    sid = api.create(memory_mb=1024, limits={"disk_mib": 512})["id"]
    api.sh(sid, f"mkdir -p t && cd t && for i in $(seq 0 {FILES - 1}); do echo old-$i > f$i; done")
    assert tree_digest(api, sid, "/workspace/t") == expected(old_content)
    return api, sid, agent_root(sid)


@pytest.mark.slow
def test_kill_9_while_an_archive_is_staged_leaves_the_old_tree(own_daemon: Daemon):
    d = own_daemon.start()
    api, sid, root = prepare(d)
    t = start_upload(d, api, sid)

    def staged_enough():
        for p in (root / "workspace/t").iterdir():
            if p.name.startswith(".hutch-archive-") and sum(1 for _ in p.iterdir()) >= 500:
                return True
        return False

    wait_for("500 files staged", staged_enough, timeout=120, interval=0.005)
    assert restart_and_check(d, api, sid, t, root) == "old"


@pytest.mark.slow
def test_kill_9_while_an_archive_is_moved_into_place_leaves_one_tree(own_daemon: Daemon):
    d = own_daemon.start()
    api, sid, root = prepare(d)
    t = start_upload(d, api, sid)
    first = root / "workspace/t/f0"

    def moving():
        try:
            return first.read_bytes().startswith(b"new-")
        except OSError:
            return False

    wait_for("the first file moved into place", moving, timeout=120, interval=0.0005)
    d.kill9()
    # The premise: the kill cut the commit half way.
    fresh = 0
    for i in range(FILES):
        try:
            fresh += (root / f"workspace/t/f{i}").read_bytes().startswith(b"new-")
        except FileNotFoundError:
            pass
    assert 0 < fresh < FILES, f"{fresh} of {FILES} files were new at the kill"
    restart_and_check(d, api, sid, t, root)


@on_class("gvisor", reason=GVISOR_STATX)
def test_e2b_files_take_gzip_forms_and_refuse_other_encodings(daemon: Daemon, api: Client, sandbox: dict):
    sid = sandbox["id"]
    envd = envd_headers(daemon, sid)
    boundary = "gz-form-boundary"
    parts = [("file", "a.txt", [b"alpha\n"]), ("file", "b.bin", [os.urandom(3 * MiB)])]
    body = b"".join(form_stream(parts, boundary))
    r = requests.post(daemon.base + "/files", data=gzip.compress(body), timeout=REQUEST_TIMEOUT,
                      headers={**envd, "Content-Type": f"multipart/form-data; boundary={boundary}",
                               "Content-Encoding": "gzip"})
    assert r.status_code == 200, r.text[:500]
    assert sorted(e["name"] for e in r.json()) == ["a.txt", "b.bin"]
    assert api.sh(sid, "cat /home/user/a.txt") == "alpha\n"
    assert api.sh(sid, "stat -c %s /home/user/b.bin").strip() == str(3 * MiB)
    r = requests.post(daemon.base + "/files", params={"path": "/home/user/br.bin"}, data=b"x", timeout=REQUEST_TIMEOUT,
                      headers={**envd, "Content-Type": "application/octet-stream", "Content-Encoding": "br"})
    assert r.status_code == 400, r.text
    # Malformed gzip: refused, nothing left.
    r = requests.post(daemon.base + "/files", params={"path": "/home/user/bad.bin"}, timeout=REQUEST_TIMEOUT,
                      data=b"\x1f\x8b" + os.urandom(4096),
                      headers={**envd, "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
    assert r.status_code == 400, r.text
    assert api.exec(sid, "test -e /home/user/bad.bin || test -e /home/user/br.bin")["exit_code"] != 0
    assert ".hutch-upload-" not in api.sh(sid, "ls -A /home/user")


def _exchange(sock: socket.socket, head: bytes, body: bytes = b"") -> tuple[int, dict]:
    """Sends a request's head, then its body as a second write (as fetch
    streams one), and reads one response: (status, headers)."""
    sock.sendall(head)
    if body:
        sock.sendall(body)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before an answer: {buf!r}"
        buf += chunk
    raw, rest = buf.split(b"\r\n\r\n", 1)
    lines = raw.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "the connection closed inside an answer"
        rest += chunk
    return int(lines[0].split()[1]), headers


def test_a_refused_upload_is_answered_after_its_small_body(api: Client, sandbox: dict):
    """A bad key or an unknown sandbox refuses a raw upload once its (small)
    body is read: a client still sending it reads the answer rather than a
    reset, and the connection carries the next request."""
    host = api.base.removeprefix("http://")
    addr, port = host.rsplit(":", 1)
    body = os.urandom(100_000)

    def put(sid: str, key: str) -> bytes:
        return (f"PUT /v1/sandboxes/{sid}/files?path=refused.bin HTTP/1.1\r\nHost: {host}\r\n"
                f"Authorization: Bearer {key}\r\nContent-Type: application/octet-stream\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()

    with socket.create_connection((addr, int(port)), timeout=30) as s:
        status, headers = _exchange(s, put(sandbox["id"], "hutch_wrong"), body)
        assert status == 401 and headers.get("connection") != "close", (status, headers)
        status, headers = _exchange(s, put("sb-0000000000000000", api.key), body)
        assert status == 404 and headers.get("connection") != "close", (status, headers)
        status, _ = _exchange(s, f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        assert status == 200
    expect_error(read(api, sandbox["id"], "refused.bin"), 404, "not_found")
