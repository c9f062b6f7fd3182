"""Signed /files URLs and X-Metadata-* headers stored as user.e2b.* xattrs."""

import os
import urllib.parse

import requests


def test_signed_upload_and_download(shared):
    url = shared.upload_url("signed/up.txt")
    assert "signature=v1_" in url
    r = requests.post(url, files={"file": ("up.txt", b"signed body")}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()[0]["path"] == "/home/user/signed/up.txt"
    assert shared.files.read("signed/up.txt") == "signed body"

    r = requests.get(shared.download_url("signed/up.txt"), timeout=30)
    assert r.status_code == 200, r.text
    assert r.content == b"signed body"


def test_signed_url_with_expiration(shared):
    shared.files.write("signed/exp.txt", "fresh")
    r = requests.get(shared.download_url("signed/exp.txt", use_signature_expiration=120), timeout=30)
    assert r.status_code == 200 and r.content == b"fresh"
    # An expiration in the past: correctly signed, but expired.
    r = requests.get(shared.download_url("signed/exp.txt", use_signature_expiration=-10), timeout=30)
    assert r.status_code == 401 and "expired" in r.json()["message"]


def test_tampered_or_misused_signature_refused(shared):
    shared.files.write("signed/secret.txt", "s")
    url = shared.download_url("signed/secret.txt")
    parts = urllib.parse.urlsplit(url)
    q = dict(urllib.parse.parse_qsl(parts.query))
    # Another path with the same signature.
    other = dict(q, path="signed/other.txt")
    r = requests.get(parts._replace(query=urllib.parse.urlencode(other)).geturl(), timeout=30)
    assert r.status_code == 401
    # A flipped character.
    sig = q["signature"]
    bad = dict(q, signature=sig[:-1] + ("A" if sig[-1] != "A" else "B"))
    r = requests.get(parts._replace(query=urllib.parse.urlencode(bad)).geturl(), timeout=30)
    assert r.status_code == 401
    # A read signature does not allow a write.
    r = requests.post(url, files={"file": ("x", b"overwrite")}, timeout=30)
    assert r.status_code == 401
    # No signature and no token.
    r = requests.get(parts._replace(query=urllib.parse.urlencode({"path": q["path"]})).geturl(), timeout=30)
    assert r.status_code in (400, 401)
    assert shared.files.read("signed/secret.txt") == "s"


def test_write_metadata_round_trip(shared):
    info = shared.files.write("meta/a.txt", "m", metadata={"Owner": "alice", "stage": "raw"})
    assert info.metadata == {"owner": "alice", "stage": "raw"}
    got = shared.files.get_info("meta/a.txt")
    assert got.metadata == {"owner": "alice", "stage": "raw"}
    listed = {e.name: e.metadata for e in shared.files.list("meta")}
    assert listed["a.txt"] == {"owner": "alice", "stage": "raw"}
    moved = shared.files.rename("meta/a.txt", "meta/b.txt")
    assert moved.metadata == {"owner": "alice", "stage": "raw"}
    # Stored as real xattrs inside the sandbox.
    out = shared.commands.run(
        "python3 -c \"import os; print(os.getxattr('/home/user/meta/b.txt', 'user.e2b.owner').decode())\""
    )
    assert out.stdout.strip() == "alice"
    # A file without metadata reads back none.
    shared.files.write("meta/plain.txt", "p")
    assert shared.files.get_info("meta/plain.txt").metadata is None


def test_write_files_metadata_applies_to_each(shared):
    infos = shared.files.write_files(
        [{"path": "meta/many/x", "data": "1"}, {"path": "meta/many/y", "data": "2"}], metadata={"k": "v"}
    )
    assert all(i.metadata == {"k": "v"} for i in infos)
    assert shared.files.get_info("meta/many/y").metadata == {"k": "v"}


def test_metadata_header_over_plain_http(shared):
    url = shared.upload_url("meta/raw.bin")
    r = requests.post(
        url,
        data=b"raw",
        headers={"Content-Type": "application/octet-stream", "X-Metadata-Source": "curl"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.json()[0]["metadata"] == {"source": "curl"}
    assert shared.files.get_info("meta/raw.bin").metadata == {"source": "curl"}


def test_too_much_metadata_refused(shared):
    url = shared.upload_url("meta/big.bin")
    headers = {"Content-Type": "application/octet-stream"}
    headers.update({f"X-Metadata-k{i}": "v" for i in range(65)})
    r = requests.post(url, data=b"x", headers=headers, timeout=30)
    assert r.status_code == 400
    assert not shared.files.exists("meta/big.bin")


def test_gzip_octet_stream_upload_is_unpacked(shared):
    import gzip

    url = shared.upload_url("zipped/plain.txt")
    r = requests.post(
        url,
        data=gzip.compress(b"unpacked on arrival\n" * 100),
        headers={"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert shared.files.read("zipped/plain.txt") == "unpacked on arrival\n" * 100
    # A body that is not gzip is refused, and nothing is written.
    bad = requests.post(
        shared.upload_url("zipped/bad.txt"),
        data=b"not gzip at all",
        headers={"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
        timeout=30,
    )
    assert bad.status_code == 400, bad.text
    assert not shared.files.exists("zipped/bad.txt")
