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
import io
import os
import tarfile

import pytest

from conftest import Client, expect_error, expect_status

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
