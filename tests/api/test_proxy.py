"""The port proxy: access grants, the token and cookie checks, what is
stripped on the way in and added on the way out, WebSockets, server-sent
events, and connections closed at revocation and expiry.

The application is tests/api/proxy_app.py, run inside real sandboxes. The
host form (`<id>--<port>.sandboxes.localhost`) is reached by connecting to
the daemon's address with that Host header, as a browser with wildcard DNS
for *.localhost would.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import struct
import time
from pathlib import Path

import pytest
import requests

from conftest import Client, Daemon, expect_error, expect_status, wait_for

APP = Path(__file__).with_name("proxy_app.py")
PORT = 8080
V6_PORT = 8081
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
# Revocation and expiry must close open connections within this many seconds.
CLOSE_WITHIN = 2.0


# --------------------------------------------------------------------------
# Helpers


def start_app(api: Client, sid: str, port: int = PORT, bind: str = "127.0.0.1") -> None:
    """Runs proxy_app.py in the sandbox on `port` and waits until it listens."""
    data = base64.b64encode(APP.read_bytes()).decode()
    expect_status(api.post(f"/v1/sandboxes/{sid}/files/write", {"path": "/workspace/proxy_app.py", "data": data}), 204)
    api.background(sid, f"exec python3 /workspace/proxy_app.py {port} {bind}")
    probe = (
        "import socket,sys; s=socket.socket(socket.AF_INET6 if ':' in sys.argv[1] else socket.AF_INET); "
        "s.settimeout(1); s.connect((sys.argv[1], int(sys.argv[2])))"
    )
    target = "::1" if ":" in bind else "127.0.0.1"
    wait_for(f"the app on port {port}",
             lambda: api.exec(sid, argv=["python3", "-c", probe, target, str(port)])["exit_code"] == 0, timeout=15)


def grant(api: Client, sid: str, port: int = PORT, **body) -> dict:
    r = api.post(f"/v1/sandboxes/{sid}/access", {"port": port, **body})
    expect_status(r, 201)
    return r.json()


def host_of(daemon: Daemon, sid: str, port: int = PORT) -> str:
    return f"{sid}--{port}.sandboxes.localhost:{daemon.port}"


def via_host(daemon: Daemon, sid: str, path: str, token: str | None = None, port: int = PORT, method: str = "GET",
             headers: dict | None = None, **kw) -> requests.Response:
    """A request for the host form: to the daemon's address, with the proxy's Host."""
    h = {"Host": host_of(daemon, sid, port), **(headers or {})}
    if token is not None:
        h["X-Hutch-Sandbox-Token"] = token
    return requests.request(method, daemon.base + path, headers=h, timeout=30, allow_redirects=False, **kw)


def via_path(daemon: Daemon, sid: str, path: str, token: str | None = None, port: int = PORT, **kw) -> requests.Response:
    headers = dict(kw.pop("headers", None) or {})
    if token is not None:
        headers["X-Hutch-Sandbox-Token"] = token
    url = f"{daemon.base}/v1/sandboxes/{sid}/ports/{port}{path}"
    return requests.request(kw.pop("method", "GET"), url, headers=headers, timeout=30, allow_redirects=False, **kw)


def seen_headers(r: requests.Response) -> list[tuple[str, str]]:
    expect_status(r, 200)
    return [(k, v) for k, v in r.json()["headers"]]


def raw_connect(daemon: Daemon) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", daemon.port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_head(s: socket.socket) -> tuple[bytes, bytes]:
    """Reads a response head; returns (head, bytes already read past it)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(4096)
        if not chunk:
            raise AssertionError(f"connection closed before a response head: {buf!r}")
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    return head, rest


def raw_request(s: socket.socket, host: str, path: str, token: str, extra: str = "") -> None:
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nX-Hutch-Sandbox-Token: {token}\r\n{extra}\r\n".encode())


def ws_open(daemon: Daemon, sid: str, token: str) -> socket.socket:
    s = raw_connect(daemon)
    key = base64.b64encode(os.urandom(16)).decode()
    raw_request(s, host_of(daemon, sid), "/ws", token,
                f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n")
    head, rest = read_head(s)
    assert head.startswith(b"HTTP/1.1 101"), head
    want = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
    assert f"sec-websocket-accept: {want}".lower().encode() in head.lower(), head
    assert rest == b"", rest
    return s


def ws_send(s: socket.socket, text: str) -> None:
    payload = text.encode()
    mask = os.urandom(4)
    assert len(payload) < 126
    s.sendall(struct.pack("!BB", 0x81, 0x80 | len(payload)) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def ws_recv(s: socket.socket) -> str:
    head = recv_exact(s, 2)
    n = head[1] & 0x7F
    assert n < 126 and not head[1] & 0x80, head
    return recv_exact(s, n).decode()


def closed_within(s: socket.socket, seconds: float) -> float | None:
    """Reads (and drops) whatever comes until the peer closes; returns the
    seconds it took, or None if it stayed open for `seconds`."""
    t0 = time.monotonic()
    deadline = t0 + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        s.settimeout(left)
        try:
            if not s.recv(65536):
                return time.monotonic() - t0
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - t0
        except socket.timeout:
            return None


def open_sse(daemon: Daemon, sid: str, token: str) -> socket.socket:
    s = raw_connect(daemon)
    raw_request(s, host_of(daemon, sid), "/sse", token)
    head, rest = read_head(s)
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"text/event-stream" in head.lower(), head
    buf = rest
    while b"data: 1\n\n" not in buf:
        buf += s.recv(4096)
    return s


def open_keepalive(daemon: Daemon, sid: str, token: str) -> socket.socket:
    """A connection that served one request and is now idle, kept alive."""
    s = raw_connect(daemon)
    raw_request(s, host_of(daemon, sid), "/hello", token)
    head, rest = read_head(s)
    assert head.startswith(b"HTTP/1.1 200"), head
    while len(rest) < 5:
        rest += s.recv(4096)
    assert rest == b"hello", rest
    return s


# --------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def app_box(api: Client):
    """A sandbox running the app on 127.0.0.1:8080 and [::1]:8081."""
    sb = api.create()
    try:
        start_app(api, sb["id"])
        start_app(api, sb["id"], V6_PORT, "::1")
        yield sb
    finally:
        api.delete(f"/v1/sandboxes/{sb['id']}")


@pytest.fixture
def own_box(api: Client):
    """A sandbox of the test's own (suspended or deleted by it), with the app."""
    sb = api.create()
    try:
        start_app(api, sb["id"])
        yield sb
    finally:
        api.post(f"/v1/sandboxes/{sb['id']}/resume")
        api.delete(f"/v1/sandboxes/{sb['id']}")


# --------------------------------------------------------------------------
# Grants


def test_a_grant_names_its_urls_and_lives_at_most_five_minutes(daemon: Daemon, api: Client, app_box: dict):
    sid = app_box["id"]
    t0 = time.time()
    g = grant(api, sid)
    assert set(g) == {"id", "url", "path_url", "token", "expires_at", "port"}, g
    assert g["port"] == PORT
    assert g["url"] == f"http://{sid}--{PORT}.sandboxes.localhost:{daemon.port}/"
    assert g["path_url"] == f"{daemon.base}/v1/sandboxes/{sid}/ports/{PORT}/"
    assert len(base64.urlsafe_b64decode(g["token"] + "=")) == 32
    left = parse_time(g["expires_at"]) - t0
    assert 295 <= left <= 301, left
    short = grant(api, sid, expires_in_seconds=10)
    assert 8 <= parse_time(short["expires_at"]) - t0 <= 11
    assert short["token"] != g["token"] and short["id"] != g["id"]
    # Listed without tokens.
    r = api.get(f"/v1/sandboxes/{sid}/access")
    expect_status(r, 200)
    listed = {x["id"]: x for x in r.json()["grants"]}
    assert g["id"] in listed and short["id"] in listed
    assert all("token" not in x for x in listed.values())


def test_a_grant_never_outlives_its_sandbox(api: Client):
    sb = api.create(ttl_seconds=30)
    try:
        g = grant(api, sb["id"])
        assert parse_time(g["expires_at"]) <= parse_time(sb["expires_at"]) + 0.001, (g, sb)
    finally:
        api.delete(f"/v1/sandboxes/{sb['id']}")


def test_grant_requests_are_validated(api: Client, app_box: dict, daemon: Daemon):
    sid = app_box["id"]
    for port in (0, 65533, 65534, 65535):
        expect_error(api.post(f"/v1/sandboxes/{sid}/access", {"port": port}), 400, "invalid_request")
    expect_error(api.post(f"/v1/sandboxes/{sid}/access", {"port": 70000}), 400, "invalid_request")
    for secs in (0, 301, 3600):
        expect_error(api.post(f"/v1/sandboxes/{sid}/access", {"port": PORT, "expires_in_seconds": secs}), 400,
                     "invalid_request")
    expect_error(api.post(f"/v1/sandboxes/{sid}/access", {"port": PORT, "bogus": 1}), 400, "invalid_request")
    expect_error(api.post(f"/v1/sandboxes/{sid}/access", {}), 400, "invalid_request")
    expect_error(api.post("/v1/sandboxes/sb-0000000000000000/access", {"port": PORT}), 404, "not_found")
    # Another key's sandbox is not found, and its grants cannot be touched.
    other = daemon.new_client("proxy-other")
    expect_error(other.post(f"/v1/sandboxes/{sid}/access", {"port": PORT}), 404, "not_found")
    g = grant(api, sid)
    expect_error(other.delete(f"/v1/sandboxes/{sid}/access/{g['id']}"), 404, "not_found")
    expect_error(other.delete(f"/v1/sandboxes/{sid}/access"), 404, "not_found")
    expect_status(via_host(daemon, sid, "/hello", g["token"]), 200)
    expect_error(api.delete(f"/v1/sandboxes/{sid}/access/ag-0000000000000000"), 404, "not_found")
    # Without an API key, nothing.
    r = requests.post(f"{daemon.base}/v1/sandboxes/{sid}/access", json={"port": PORT}, timeout=10)
    expect_error(r, 401, "unauthorized")


def test_a_suspended_sandbox_gets_no_grant(api: Client, own_box: dict):
    sid = own_box["id"]
    expect_status(api.post(f"/v1/sandboxes/{sid}/suspend"), 200)
    expect_error(api.post(f"/v1/sandboxes/{sid}/access", {"port": PORT}), 409, "sandbox_session_not_running")


# --------------------------------------------------------------------------
# Tokens


def test_missing_wrong_and_foreign_tokens_are_refused(daemon: Daemon, api: Client, app_box: dict):
    sid = app_box["id"]
    g = grant(api, sid)
    other_port = grant(api, sid, V6_PORT)
    for via in (via_host, via_path):
        expect_error(via(daemon, sid, "/headers"), 401, "access_token_required")
        expect_error(via(daemon, sid, "/headers", ""), 401, "access_token_required")
        expect_error(via(daemon, sid, "/headers", "x" * 43), 401, "access_token_invalid")
        expect_error(via(daemon, sid, "/headers", g["token"][:-1]), 401, "access_token_invalid")
        expect_error(via(daemon, sid, "/headers", "x" * 5000), 401, "access_token_invalid")
        expect_error(via(daemon, sid, "/headers", other_port["token"]), 403, "access_token_wrong_target")
        expect_error(via(daemon, sid, "/headers", g["token"], port=V6_PORT), 403, "access_token_wrong_target")
        # A wrong header is not rescued by a valid cookie.
        r = via(daemon, sid, "/headers", "wrong", headers={"Cookie": f"hutch_sandbox_token={g['token']}"})
        expect_error(r, 401, "access_token_invalid")
        expect_status(via(daemon, sid, "/headers", g["token"]), 200)
    # The API key is no access token.
    expect_error(via_host(daemon, sid, "/headers", headers={"Authorization": f"Bearer {api.key}"}), 401,
                 "access_token_required")


def test_a_token_for_another_sandbox_is_refused(daemon: Daemon, api: Client, app_box: dict, own_box: dict):
    theirs = grant(api, own_box["id"])
    for via in (via_host, via_path):
        expect_error(via(daemon, app_box["id"], "/headers", theirs["token"]), 403, "access_token_wrong_target")
        expect_status(via(daemon, own_box["id"], "/headers", theirs["token"]), 200)


def test_an_expired_token_is_refused(daemon: Daemon, api: Client, app_box: dict):
    sid = app_box["id"]
    g = grant(api, sid, expires_in_seconds=1)
    expect_status(via_host(daemon, sid, "/hello", g["token"]), 200)
    # The token ends at its own expiry: wait for that, then every path refuses it.
    wait_for("the token's expiry", lambda: via_host(daemon, sid, "/hello", g["token"]).status_code == 401)
    expect_error(via_host(daemon, sid, "/hello", g["token"]), 401, "access_token_expired")
    expect_error(via_path(daemon, sid, "/hello", g["token"]), 401, "access_token_expired")
    r = api.get(f"/v1/sandboxes/{sid}/access")
    assert g["id"] not in {x["id"] for x in r.json()["grants"]}


def test_a_revoked_token_is_refused_and_revoking_is_idempotent(daemon: Daemon, api: Client, app_box: dict):
    sid = app_box["id"]
    g, kept = grant(api, sid), grant(api, sid)
    expect_status(api.delete(f"/v1/sandboxes/{sid}/access/{g['id']}"), 204)
    expect_status(api.delete(f"/v1/sandboxes/{sid}/access/{g['id']}"), 204)
    expect_error(via_host(daemon, sid, "/hello", g["token"]), 401, "access_token_invalid")
    expect_status(via_host(daemon, sid, "/hello", kept["token"]), 200)
    expect_status(api.delete(f"/v1/sandboxes/{sid}/access"), 204)
    expect_error(via_host(daemon, sid, "/hello", kept["token"]), 401, "access_token_invalid")
    assert api.get(f"/v1/sandboxes/{sid}/access").json()["grants"] == []


def test_unknown_sandboxes_ports_and_reserved_ports(daemon: Daemon, api: Client, app_box: dict):
    sid = app_box["id"]
    g = grant(api, sid)
    unknown = "sb-0000000000000000"
    expect_error(via_host(daemon, unknown, "/", g["token"]), 404, "not_found")
    expect_error(via_path(daemon, unknown, "/", g["token"]), 404, "not_found")
    expect_error(via_host(daemon, "NOT_AN_ID", "/", g["token"]), 404, "not_found")
    for port in (0, 65533, 65535, 99999):
        expect_error(via_host(daemon, sid, "/", g["token"], port=port), 400, "invalid_request")
        expect_error(via_path(daemon, sid, "/", g["token"], port=port), 400, "invalid_request")
    # Nobody listens on 9999: a clear 502.
    g2 = grant(api, sid, 9999)
    r = via_host(daemon, sid, "/", g2["token"], port=9999)
    body = expect_error(r, 502, "sandbox_port_unreachable")
    assert "9999" in body["error"] and sid in body["error"], body
    expect_error(via_path(daemon, sid, "/x", g2["token"], port=9999), 502, "sandbox_port_unreachable")


def test_a_deleted_sandbox_revokes_its_grants(daemon: Daemon, api: Client, own_box: dict):
    sid = own_box["id"]
    g = grant(api, sid)
    expect_status(via_host(daemon, sid, "/hello", g["token"]), 200)
    api.destroy(sid)
    expect_error(via_host(daemon, sid, "/hello", g["token"]), 404, "not_found")


# --------------------------------------------------------------------------
# What reaches the application


STRIPPED = [
    ("X-Hutch-Owner", "forged"),
    ("X-HUTCH-SANDBOX-ID", "forged"),
    ("x-hutch-anything", "forged"),
    ("X_Hutch_Owner", "forged"),
    ("x.hutch.foo", "forged"),
    ("Forwarded", "for=6.6.6.6;proto=https"),
    ("FORWARDED", "for=6.6.6.6"),
    ("X-Forwarded-For", "6.6.6.6"),
    ("x-forwarded-host", "evil.example"),
    ("X-FORWARDED-PROTO", "https"),
    ("X_Forwarded_For", "6.6.6.6"),
    ("x_forwarded_host", "evil.example"),
    ("X.Forwarded.For", "6.6.6.6"),
    ("X-Real-IP", "6.6.6.6"),
    ("Keep-Alive", "timeout=5"),
    ("Proxy-Authorization", "Basic Zm9yZ2Vk"),
    ("TE", "trailers"),
    ("Upgrade", "h2c"),
    ("Proxy-Connection", "keep-alive"),
    ("X-Listed-In-Connection", "forged"),
]
KEPT = [
    ("Authorization", "Bearer app-secret"),
    ("X_Api_Key", "k-123"),
    ("X-Custom", "yes"),
    ("Accept-Language", "fr"),
]


def test_stripped_headers_never_reach_the_application(daemon: Daemon, api: Client, app_box: dict):
    sid = app_box["id"]
    g = grant(api, sid)
    headers = dict(STRIPPED + KEPT)
    headers["Connection"] = "keep-alive, X-Listed-In-Connection"
    headers["Cookie"] = f"app_a=1; hutch_sandbox_token={g['token']}; app_b=2"
    for via in (via_host, via_path):
        r = via(daemon, sid, "/headers", g["token"], headers=headers)
        seen = seen_headers(r)
        names = {k.lower().replace("_", "-").replace(".", "-") for k, _ in seen}
        for name, _ in STRIPPED:
            assert name.lower().replace("_", "-").replace(".", "-") not in names, (name, seen)
        assert not any(n.startswith(("x-hutch-", "x-forwarded-")) for n in names), seen
        assert "forwarded" not in names and "connection" not in names, seen
        for name, value in KEPT:
            assert (name.lower(), value) in {(k.lower(), v) for k, v in seen}, (name, seen)
        cookies = [v for k, v in seen if k.lower() == "cookie"]
        assert cookies == ["app_a=1; app_b=2"], seen
        # The token reaches the application in no form at all.
        assert g["token"] not in r.text
        assert "6.6.6.6" not in r.text and "forged" not in r.text and "evil.example" not in r.text, r.text


def test_the_request_path_query_and_body_pass_through(daemon: Daemon, api: Client, app_box: dict):
    sid = app_box["id"]
    g = grant(api, sid)
    r = via_host(daemon, sid, "/headers/a%2Fb?x=1&y=%20", g["token"])
    expect_status(r, 200)
    assert r.json()["path"] == "/headers/a%2Fb?x=1&y=%20"
    r = via_path(daemon, sid, "/headers/a%2Fb?x=1", g["token"])
    assert r.json()["path"] == "/headers/a%2Fb?x=1"
    # The path form without its slash redirects to the grant's url.
    r = via_path(daemon, sid, "", g["token"])
    assert r.status_code == 308 and r.headers["Location"] == f"/v1/sandboxes/{sid}/ports/{PORT}/", r.headers
    # A 4 MiB body streams through and back.
    blob = os.urandom(4 << 20)
    r = via_host(daemon, sid, "/echo", g["token"], method="POST", data=blob)
    expect_status(r, 200)
    assert hashlib.sha256(r.content).digest() == hashlib.sha256(blob).digest()
    # Proxy routing wins over API routes on a proxy host name.
    r = via_host(daemon, sid, "/healthz", g["token"], method="POST")
    assert r.json()["path"] == "/healthz", r.text


def test_responses_get_the_policy_and_lose_what_touches_the_credential(daemon: Daemon, api: Client, app_box: dict):
    sid = app_box["id"]
    g = grant(api, sid)
    for via in (via_host, via_path):
        r = via(daemon, sid, "/set-headers", g["token"])
        expect_status(r, 200)
        raw = r.raw.headers
        csp = raw.getlist("Content-Security-Policy")
        assert csp == ["default-src 'self'", "script-src 'none'; object-src 'none'; frame-src 'self'"], csp
        assert raw.getlist("Cache-Control") == ["private, no-store"]
        assert "Clear-Site-Data" not in r.headers
        assert raw.getlist("Set-Cookie") == ["app_session=abc; Path=/; HttpOnly"]
        assert r.headers["X-App-Header"] == "kept"
        # Errors and plain answers get them too.
        r = via(daemon, sid, "/headers", g["token"])
        assert r.headers["Cache-Control"] == "private, no-store"


def test_a_nameless_set_cookie_cannot_plant_the_credential(daemon: Daemon, api: Client, app_box: dict):
    """Browsers send a cookie without a name as its value alone, so
    `Set-Cookie: =hutch_sandbox_token=x` comes back as the credential."""
    sid = app_box["id"]
    g = grant(api, sid)
    for via in (via_host, via_path):
        r = via(daemon, sid, "/set-nameless", g["token"])
        expect_status(r, 200)
        assert r.raw.headers.getlist("Set-Cookie") == ["=app_nameless=kept"]


def test_a_cookie_header_with_non_ascii_bytes_loses_the_credential_too(daemon: Daemon, api: Client, app_box: dict):
    sid = app_box["id"]
    g = grant(api, sid)
    # requests sends header values as Latin-1: the byte 0xE9 on the wire.
    cookie = f"app_a=caf\u00e9; hutch_sandbox_token={g['token']}; app_b=2"
    for via in (via_host, via_path):
        r = via(daemon, sid, "/headers", g["token"], headers={"Cookie": cookie})
        seen = seen_headers(r)
        assert g["token"] not in r.text, seen
        assert [v for k, v in seen if k.lower() == "cookie"] == ["app_a=caf\u00e9; app_b=2"], seen
    # With the credential only in that cookie, it still opens the port.
    r = via_host(daemon, sid, "/headers", headers={"Cookie": cookie})
    expect_status(r, 200)
    assert g["token"] not in r.text


def test_only_websocket_upgrades_are_tunnelled(daemon: Daemon, api: Client, app_box: dict):
    sid = app_box["id"]
    g = grant(api, sid)
    # Another protocol is not asked of the application: its Upgrade is removed.
    r = via_host(daemon, sid, "/headers", g["token"], headers={"Connection": "Upgrade", "Upgrade": "h2c"})
    names = {k.lower() for k, _ in seen_headers(r)}
    assert "upgrade" not in names and "connection" not in names, names
    # An application that switches anyway (the app's /ws answers 101 to
    # anything) is not joined to the client.
    s = raw_connect(daemon)
    raw_request(s, host_of(daemon, sid), "/ws", g["token"], "Upgrade: h2c\r\nConnection: Upgrade\r\n")
    head, _ = read_head(s)
    assert head.startswith(b"HTTP/1.1 502"), head
    s.close()
    # WebSocket still works.
    ws = ws_open(daemon, sid, g["token"])
    ws_send(ws, "hi")
    assert ws_recv(ws) == "hi"
    ws.close()


def test_a_service_bound_to_ipv6_loopback_is_reached(daemon: Daemon, api: Client, app_box: dict):
    g = grant(api, app_box["id"], V6_PORT)
    expect_status(via_host(daemon, app_box["id"], "/hello", g["token"], port=V6_PORT), 200)


# --------------------------------------------------------------------------
# The cookie


def test_the_cookie_flow_on_the_host_form(daemon: Daemon, api: Client, app_box: dict):
    sid = app_box["id"]
    g = grant(api, sid)
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    r = via_host(daemon, sid, "/_hutch/access", method="POST", data={"token": g["token"]})
    assert r.status_code == 303, r.text
    assert r.headers["Location"] == "/"
    cookie = r.headers["Set-Cookie"]
    attrs = [a.strip() for a in cookie.split(";")]
    assert attrs[0] == f"hutch_sandbox_token={g['token']}"
    lower = [a.lower() for a in attrs]
    assert "httponly" in lower and "samesite=strict" in lower and "path=/" in lower, cookie
    assert not any(a.startswith("domain") for a in lower), cookie
    assert "secure" not in lower, cookie
    # Behind TLS the cookie is Secure.
    r = via_host(daemon, sid, "/_hutch/access", method="POST", data={"token": g["token"]},
                 headers={"X-Forwarded-Proto": "https"})
    assert "secure" in [a.strip().lower() for a in r.headers["Set-Cookie"].split(";")]
    # With only the cookie, the request goes through; the cookie does not.
    r = via_host(daemon, sid, "/headers", headers={"Cookie": f"hutch_sandbox_token={g['token']}; mine=1"})
    seen = seen_headers(r)
    assert [v for k, v in seen if k.lower() == "cookie"] == ["mine=1"]
    assert g["token"] not in r.text
    # Wrong tokens, other methods and other encodings get no cookie.
    r = via_host(daemon, sid, "/_hutch/access", method="POST", data={"token": "nope"})
    expect_error(r, 401, "access_token_invalid")
    assert "Set-Cookie" not in r.headers
    expect_error(via_host(daemon, sid, "/_hutch/access", method="POST", data=b"other=1", headers=form), 401,
                 "access_token_required")
    expect_error(via_host(daemon, sid, "/_hutch/access", g["token"]), 400, "invalid_request")
    r = via_host(daemon, sid, "/_hutch/access", method="POST", json={"token": g["token"]})
    expect_error(r, 400, "invalid_request")
    r = via_host(daemon, sid, "/_hutch/access", method="POST", data=b"token=" + b"a" * 10000, headers=form)
    expect_error(r, 413, "payload_too_large")
    expect_error(via_host(daemon, sid, "/_hutch/other", g["token"]), 404, "not_found")


def test_the_cookie_flow_on_the_path_form(daemon: Daemon, api: Client, app_box: dict):
    sid = app_box["id"]
    g = grant(api, sid)
    s = requests.Session()
    r = s.post(g["path_url"] + "_hutch/access", data={"token": g["token"]}, allow_redirects=False, timeout=30)
    assert r.status_code == 303 and r.headers["Location"] == f"/v1/sandboxes/{sid}/ports/{PORT}/", r.headers
    assert f"path=/v1/sandboxes/{sid}/ports/{PORT}/" in r.headers["Set-Cookie"].lower()
    # A browser-like session follows the redirect with the cookie alone.
    r = s.get(g["path_url"] + "headers", timeout=30)
    seen = seen_headers(r)
    assert not any(k.lower() == "cookie" for k, _ in seen), seen
    # The cookie is scoped to this port's path: another port gets none.
    other = grant(api, sid, V6_PORT)
    r = s.get(other["path_url"] + "hello", timeout=30)
    expect_error(r, 401, "access_token_required")
    # Nor does the API see it as a credential.
    expect_error(s.get(f"{daemon.base}/v1/sandboxes", timeout=30), 401, "unauthorized")


# --------------------------------------------------------------------------
# WebSockets, server-sent events, and closing them


def test_a_websocket_echoes_through_the_proxy(daemon: Daemon, api: Client, app_box: dict):
    g = grant(api, app_box["id"])
    s = ws_open(daemon, app_box["id"], g["token"])
    try:
        for msg in ("hello", "second message", "x" * 100):
            ws_send(s, msg)
            assert ws_recv(s) == msg
    finally:
        s.close()


def test_server_sent_events_stream_unbuffered(daemon: Daemon, api: Client, app_box: dict):
    g = grant(api, app_box["id"])
    s = open_sse(daemon, app_box["id"], g["token"])
    try:
        # The stream never ends and each event is a few bytes: a proxy that
        # buffered would hand over nothing until its buffer filled (KiBs,
        # many seconds of events). Five reads of a few events each show
        # that every event is passed on as it comes.
        s.settimeout(5)
        reads = []
        while len(reads) < 5:
            chunk = s.recv(4096)
            assert chunk, "the stream ended"
            reads.append(chunk)
        body = b"".join(reads)
        assert len(body) < 2048, f"{len(body)} bytes in 5 reads: events were buffered"
        assert body.count(b"data:") >= 2, body
    finally:
        s.close()


def test_revocation_closes_open_connections_at_once(daemon: Daemon, api: Client, app_box: dict):
    sid = app_box["id"]
    g = grant(api, sid)
    bystander = grant(api, sid)
    ws, sse, idle = ws_open(daemon, sid, g["token"]), open_sse(daemon, sid, g["token"]), open_keepalive(daemon, sid, g["token"])
    other_ws = ws_open(daemon, sid, bystander["token"])
    try:
        ws_send(ws, "before")
        assert ws_recv(ws) == "before"
        expect_status(api.delete(f"/v1/sandboxes/{sid}/access/{g['id']}"), 204)
        for name, s in (("websocket", ws), ("event stream", sse), ("idle keep-alive", idle)):
            took = closed_within(s, CLOSE_WITHIN)
            assert took is not None, f"the {name} stayed open {CLOSE_WITHIN}s after revocation"
        # Another grant's connection is untouched.
        ws_send(other_ws, "still here")
        assert ws_recv(other_ws) == "still here"
    finally:
        for s in (ws, sse, idle, other_ws):
            s.close()


def test_revoking_all_grants_closes_their_connections(daemon: Daemon, api: Client, app_box: dict):
    sid = app_box["id"]
    a, b = grant(api, sid), grant(api, sid)
    ws, sse = ws_open(daemon, sid, a["token"]), open_sse(daemon, sid, b["token"])
    try:
        expect_status(api.delete(f"/v1/sandboxes/{sid}/access"), 204)
        assert closed_within(ws, CLOSE_WITHIN) is not None, "the websocket stayed open"
        assert closed_within(sse, CLOSE_WITHIN) is not None, "the event stream stayed open"
    finally:
        ws.close()
        sse.close()


def test_expiry_closes_open_connections(daemon: Daemon, api: Client, app_box: dict):
    sid = app_box["id"]
    g = grant(api, sid, expires_in_seconds=2)
    ws, sse, idle = ws_open(daemon, sid, g["token"]), open_sse(daemon, sid, g["token"]), open_keepalive(daemon, sid, g["token"])
    try:
        ws_send(ws, "alive")
        assert ws_recv(ws) == "alive"
        for name, s in (("websocket", ws), ("event stream", sse), ("idle keep-alive", idle)):
            took = closed_within(s, 2 + CLOSE_WITHIN)
            assert took is not None, f"the {name} outlived its grant"
        # Not closed before the grant's end (`expires_at` is written in whole
        # seconds, so allow that rounding; the daemon shares this clock).
        assert time.time() >= parse_time(g["expires_at"]) - 1, "closed before the grant expired"
    finally:
        for s in (ws, sse, idle):
            s.close()


def test_suspending_a_sandbox_revokes_and_closes(daemon: Daemon, api: Client, own_box: dict):
    sid = own_box["id"]
    g = grant(api, sid)
    ws = ws_open(daemon, sid, g["token"])
    try:
        expect_status(api.post(f"/v1/sandboxes/{sid}/suspend"), 200)
        assert closed_within(ws, CLOSE_WITHIN) is not None, "the websocket outlived the suspend"
    finally:
        ws.close()
    expect_status(api.post(f"/v1/sandboxes/{sid}/resume"), 200)
    expect_error(via_host(daemon, sid, "/hello", g["token"]), 401, "access_token_invalid")
    expect_status(via_host(daemon, sid, "/hello", grant(api, sid)["token"]), 200)


def test_deleting_a_sandbox_closes_its_websockets(daemon: Daemon, api: Client, own_box: dict):
    sid = own_box["id"]
    ws = ws_open(daemon, sid, grant(api, sid)["token"])
    try:
        api.destroy(sid)
        assert closed_within(ws, CLOSE_WITHIN) is not None, "the websocket outlived its sandbox"
    finally:
        ws.close()


# --------------------------------------------------------------------------


def parse_time(s: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def test_cli_prints_the_url_and_token(daemon: Daemon, app_box: dict):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HUTCH_")}
    import subprocess

    p = subprocess.run(
        [str(daemon.binary), "sandbox", "access", app_box["id"], str(PORT), "--expires-in", "30s", "--json",
         "--url", daemon.base, "--state-dir", str(daemon.state_dir)],
        env=env, capture_output=True, text=True, timeout=30,
    )
    assert p.returncode == 0, p.stderr
    g = json.loads(p.stdout)
    assert g["port"] == PORT and g["token"]
    expect_status(via_host(daemon, app_box["id"], "/hello", g["token"]), 200)
    p = subprocess.run(
        [str(daemon.binary), "sandbox", "access", app_box["id"], "65533",
         "--url", daemon.base, "--state-dir", str(daemon.state_dir)],
        env=env, capture_output=True, text=True, timeout=30,
    )
    assert p.returncode != 0 and "65532" in p.stderr, p.stderr


def test_a_restarted_daemon_reaches_ports_of_adopted_sandboxes_and_forgot_old_grants(own_daemon: Daemon):
    """After a restart the sandbox's init is no child of the daemon: the
    proxy finds it through the sandbox's cgroup. Grants lived in memory:
    the old token is refused."""
    d = own_daemon.start()
    api = d.client()
    sb = api.create()
    start_app(api, sb["id"])
    old = grant(api, sb["id"])
    expect_status(via_host(d, sb["id"], "/hello", old["token"]), 200)
    d.kill9()
    d.start()
    expect_error(via_host(d, sb["id"], "/hello", old["token"]), 401, "access_token_invalid")
    g = grant(api, sb["id"])
    r = via_host(d, sb["id"], "/hello", g["token"])
    expect_status(r, 200)
    assert r.text == "hello"
    ws = ws_open(d, sb["id"], g["token"])
    try:
        ws_send(ws, "after restart")
        assert ws_recv(ws) == "after restart"
    finally:
        ws.close()


def test_a_deny_all_sandbox_gets_no_grant(api: Client):
    """Nothing connects into a deny_all sandbox, the proxy included."""
    sb = api.create(network={"egress": "deny_all"})
    try:
        r = api.post(f"/v1/sandboxes/{sb['id']}/access", {"port": PORT})
        expect_error(r, 400, "sandbox_network_isolated")
        r = api.get(f"/v1/sandboxes/{sb['id']}/access")
        assert r.status_code == 200 and r.json()["grants"] == [], r.text
    finally:
        api.destroy(sb["id"])
