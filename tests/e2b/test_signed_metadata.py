"""Signed /files URLs and X-Metadata-* headers stored as user.e2b.* xattrs."""

import os
import urllib.parse

import requests

from conftest import GVISOR_XATTRS, on_class


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


@on_class("gvisor", reason=GVISOR_XATTRS)
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


@on_class("gvisor", reason=GVISOR_XATTRS)
def test_write_files_metadata_applies_to_each(shared):
    infos = shared.files.write_files(
        [{"path": "meta/many/x", "data": "1"}, {"path": "meta/many/y", "data": "2"}], metadata={"k": "v"}
    )
    assert all(i.metadata == {"k": "v"} for i in infos)
    assert shared.files.get_info("meta/many/y").metadata == {"k": "v"}


@on_class("gvisor", reason=GVISOR_XATTRS)
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


def _exchange(sock, head: bytes, body: bytes = b""):
    """Sends a request's head, then its body as a second write (as fetch
    streams a form), and reads one response: (status, headers, body)."""
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
    return int(lines[0].split()[1]), headers, rest[:length]


def test_a_refused_upload_is_answered_after_its_body_on_a_connection_that_stays(daemon, shared):
    """A wrong signature or token is refused once the (small) body is read,
    so that a client still sending it reads the refusal (closing with unread
    bytes would reset the connection and lose the answer), and the
    connection carries the next request."""
    import socket

    url = urllib.parse.urlsplit(shared.download_url("signed/refused.txt"))
    host = f"127.0.0.1:{daemon['port']}"
    sid, token = shared.sandbox_id, shared._envd_access_token
    health = (f"GET /health HTTP/1.1\r\nHost: {host}\r\nE2b-Sandbox-Id: {sid}\r\n"
              f"X-Access-Token: {token}\r\n\r\n").encode()

    def post(target, body, extra=""):
        return (f"POST {target} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/octet-stream\r\n"
                f"Content-Length: {len(body)}\r\n{extra}\r\n").encode()

    body = os.urandom(100_000)
    with socket.create_connection(("127.0.0.1", daemon["port"]), timeout=30) as s:
        # A read signature used to write.
        status, headers, answer = _exchange(s, post(f"{url.path}?{url.query}", body), body)
        assert status == 401 and b"signature" in answer, (status, answer)
        assert headers.get("connection") != "close", headers
        # A wrong token.
        wrong = f"E2b-Sandbox-Id: {sid}\r\nX-Access-Token: wrong\r\n"
        status, headers, _ = _exchange(s, post("/files?path=refused.txt", body, wrong), body)
        assert status == 401 and headers.get("connection") != "close", (status, headers)
        # Bad parameters of an authenticated upload (no path for a raw body).
        good = f"E2b-Sandbox-Id: {sid}\r\nX-Access-Token: {token}\r\n"
        status, headers, _ = _exchange(s, post("/files", body, good), body)
        assert status == 400 and headers.get("connection") != "close", (status, headers)
        status, _, _ = _exchange(s, health)
        assert status == 204
    assert not shared.files.exists("refused.txt")


def test_a_refused_control_call_is_answered_after_its_body(daemon):
    """The control API's key check, likewise: a bad key's create is refused
    once its body is read, on a connection that stays."""
    import json
    import socket

    host = f"127.0.0.1:{daemon['port']}"
    body = json.dumps({"templateID": "base", "metadata": {"pad": "x" * 50_000}}).encode()
    head = (f"POST /v2/sandboxes HTTP/1.1\r\nHost: {host}\r\nX-API-KEY: e2b_{'0' * 40}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", daemon["port"]), timeout=30) as s:
        status, headers, _ = _exchange(s, head, body)
        assert status == 401 and headers.get("connection") != "close", (status, headers)
        status, _, _ = _exchange(s, f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        assert status == 200
