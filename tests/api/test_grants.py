"""Grants to end users (`POST /v1/sandboxes/{id}/grants`): an `hg_` token
reaches one sandbox, for the operations it names, until it expires or its
key's grant secret is rotated; everything else is refused with
`grant_scope` (403), `grant_expired` (401) or as an unknown key (401).
"""

from __future__ import annotations

import base64
import uuid

import pytest
import requests
import websocket

from conftest import Client, Daemon, expect_error, expect_status, wait_for
from test_proxy import PORT, start_app, via_path

ALL = ["exec", "files:read", "files:write", "pty", f"ports:{PORT}"]


def mint(owner: Client, sid: str, scopes: list[str], ttl: int = 600) -> dict:
    r = owner.post(f"/v1/sandboxes/{sid}/grants", {"scopes": scopes, "ttl_seconds": ttl})
    expect_status(r, 201)
    g = r.json()
    assert g["token"].startswith("hg_") and g["sandbox_id"] == sid, g
    return g


def as_grant(daemon: Daemon, g: dict) -> Client:
    return Client(daemon.base, g["token"])


@pytest.fixture(scope="module")
def alice(daemon: Daemon) -> Client:
    return daemon.new_client(f"grants-alice-{uuid.uuid4().hex[:6]}")


@pytest.fixture(scope="module")
def bob(daemon: Daemon) -> Client:
    return daemon.new_client(f"grants-bob-{uuid.uuid4().hex[:6]}")


@pytest.fixture(scope="module")
def box(alice: Client):
    sb = alice.create(ttl_seconds=900)
    start_app(alice, sb["id"])
    yield sb
    alice.delete(f"/v1/sandboxes/{sb['id']}")


@pytest.fixture(scope="module")
def other_box(alice: Client):
    sb = alice.create(ttl_seconds=900)
    yield sb
    alice.delete(f"/v1/sandboxes/{sb['id']}")


def test_a_grant_works_for_each_scope_it_names(daemon: Daemon, alice: Client, box: dict):
    sid = box["id"]
    g = mint(alice, sid, ALL)
    assert g["scopes"] == ALL
    user = as_grant(daemon, g)
    assert user.sandbox(sid)["id"] == sid
    # exec, and a background command's stream
    assert user.sh(sid, "echo hi") == "hi\n"
    pid = user.background(sid, "sleep 30")
    assert any(p["pid"] == pid for p in user.processes(sid))
    expect_status(user.post(f"/v1/sandboxes/{sid}/processes/{pid}/signal", {"signal": "KILL"}), (200, 202, 204))
    # files
    data = base64.b64encode(b"from the end user").decode()
    expect_status(user.post(f"/v1/sandboxes/{sid}/files/write", {"path": "/workspace/g.txt", "data": data}), 204)
    r = user.post(f"/v1/sandboxes/{sid}/files/read", {"path": "/workspace/g.txt"})
    expect_status(r, 200)
    assert base64.b64decode(r.json()["data"]) == b"from the end user"
    # the port, through the authenticated proxy
    r = via_path(daemon, sid, "/hello", g["token"])
    expect_status(r, 200)
    # pty over a WebSocket, with the grant as bearer and as subprotocol
    url = daemon.base.replace("http://", "ws://", 1) + f"/v1/sandboxes/{sid}/pty?command=echo%20granted"
    for kw in ({"header": [f"Authorization: Bearer {g['token']}"]},
               {"subprotocols": ["hutch.pty", f"hutch.bearer.{g['token']}"]}):
        ws = websocket.create_connection(url, timeout=30, **kw)
        try:
            out = b""
            while b"granted" not in out:
                op, data = ws.recv_data()
                if op == websocket.ABNF.OPCODE_CLOSE:
                    break
                if op == websocket.ABNF.OPCODE_BINARY:
                    out += data
            assert b"granted" in out, out
        finally:
            ws.close()


def test_a_grant_is_refused_outside_its_scopes(daemon: Daemon, alice: Client, box: dict):
    sid = box["id"]
    user = as_grant(daemon, mint(alice, sid, ["files:read"]))
    expect_error(user.exec_raw(sid, {"command": "true"}), 403, "grant_scope")
    expect_error(user.post(f"/v1/sandboxes/{sid}/files/write", {"path": "/workspace/x", "data": ""}), 403,
                 "grant_scope")
    expect_error(via_path(daemon, sid, "/hello", user.key), 403, "access_token_wrong_target")
    with pytest.raises(websocket.WebSocketBadStatusException) as e:
        websocket.create_connection(
            daemon.base.replace("http://", "ws://", 1) + f"/v1/sandboxes/{sid}/pty",
            header=[f"Authorization: Bearer {user.key}"], timeout=30)
    assert e.value.status_code == 403
    # Not a sandbox route it names: listing, creating, deleting, keys,
    # templates, usage, port grants, suspend, MCP.
    for method, path, body in [
        ("GET", "/v1/sandboxes", None),
        ("POST", "/v1/sandboxes", {"ttl_seconds": 60}),
        ("DELETE", f"/v1/sandboxes/{sid}", None),
        ("POST", f"/v1/sandboxes/{sid}/extend", {"by": 60}),
        ("POST", f"/v1/sandboxes/{sid}/suspend", None),
        ("POST", f"/v1/sandboxes/{sid}/access", {"port": PORT}),
        ("GET", "/v1/keys", None),
        ("GET", "/v1/templates", None),
        ("GET", "/v1/usage", None),
        ("GET", "/v1/capabilities", None),
        ("POST", f"/v1/sandboxes/{sid}/grants", {"scopes": ["exec"], "ttl_seconds": 60}),
    ]:
        r = user.request(method, path, json=body)
        expect_error(r, 403, "grant_scope")
    # reading works
    assert user.sandbox(sid)["state"] == "running"
    # The sandbox is still there.
    assert alice.sandbox(sid)["state"] == "running"


def test_a_grant_cannot_mint_grants(daemon: Daemon, alice: Client, box: dict):
    sid = box["id"]
    user = as_grant(daemon, mint(alice, sid, ALL))
    r = user.post(f"/v1/sandboxes/{sid}/grants", {"scopes": ["exec"], "ttl_seconds": 60})
    expect_error(r, 403, "grant_scope")
    kid = alice.key_id
    expect_error(user.post(f"/v1/keys/{kid}/grant-secret/rotate"), 403, "grant_scope")


def test_a_grant_reaches_no_other_sandbox(daemon: Daemon, alice: Client, box: dict, other_box: dict):
    user = as_grant(daemon, mint(alice, box["id"], ALL))
    oid = other_box["id"]
    expect_error(user.get(f"/v1/sandboxes/{oid}"), 403, "grant_scope")
    expect_error(user.exec_raw(oid, {"command": "true"}), 403, "grant_scope")
    expect_error(user.post(f"/v1/sandboxes/{oid}/files/read", {"path": "/etc/hostname"}), 403, "grant_scope")
    expect_error(via_path(daemon, oid, "/hello", user.key), 403, "access_token_wrong_target")


def test_another_keys_grant_cannot_touch_the_first_keys_sandbox(daemon: Daemon, alice: Client, bob: Client,
                                                                box: dict):
    sid = box["id"]
    # Bob cannot mint for Alice's sandbox (it is not his: not found).
    r = bob.post(f"/v1/sandboxes/{sid}/grants", {"scopes": ["exec"], "ttl_seconds": 60})
    expect_error(r, 404, "not_found")
    # Nor rotate Alice's secret.
    expect_error(bob.post(f"/v1/keys/{alice.key_id}/grant-secret/rotate"), 404, "not_found")
    # Bob's grant for his own sandbox reaches nothing of Alice's.
    bsb = bob.create(ttl_seconds=300)
    try:
        user = as_grant(daemon, mint(bob, bsb["id"], ALL))
        expect_error(user.get(f"/v1/sandboxes/{sid}"), 403, "grant_scope")
        expect_error(user.exec_raw(sid, {"command": "true"}), 403, "grant_scope")
        expect_error(via_path(daemon, sid, "/hello", user.key), 403, "access_token_wrong_target")
    finally:
        bob.delete(f"/v1/sandboxes/{bsb['id']}")


def test_a_grant_is_refused_after_its_expiry(daemon: Daemon, alice: Client, box: dict):
    sid = box["id"]
    g = mint(alice, sid, ["exec", f"ports:{PORT}"], ttl=1)
    user = as_grant(daemon, g)
    # Usable until its expiry, then refused on every path.
    wait_for("the grant's expiry", lambda: user.get(f"/v1/sandboxes/{sid}").status_code == 401, timeout=10)
    expect_error(user.exec_raw(sid, {"command": "true"}), 401, "grant_expired")
    expect_error(via_path(daemon, sid, "/hello", g["token"]), 401, "access_token_expired")


def test_rotating_the_grant_secret_revokes_every_grant(daemon: Daemon, alice: Client, box: dict):
    sid = box["id"]
    g1, g2 = mint(alice, sid, ["exec", f"ports:{PORT}"]), mint(alice, sid, ["files:read"])
    assert as_grant(daemon, g1).sh(sid, "echo ok") == "ok\n"
    r = alice.post(f"/v1/keys/{alice.key_id}/grant-secret/rotate")
    expect_status(r, 200)
    assert r.json()["key_id"] == alice.key_id
    for g in (g1, g2):
        expect_error(as_grant(daemon, g).get(f"/v1/sandboxes/{sid}"), 401, "unauthorized")
    expect_error(via_path(daemon, sid, "/hello", g1["token"]), 401, "access_token_invalid")
    # A grant minted after the rotation works.
    g3 = mint(alice, sid, ["exec"])
    assert as_grant(daemon, g3).sh(sid, "echo again") == "again\n"
    # The admin key may rotate any key's secret.
    admin = daemon.client("admin")
    expect_status(admin.post(f"/v1/keys/{alice.key_id}/grant-secret/rotate"), 200)
    expect_error(as_grant(daemon, g3).get(f"/v1/sandboxes/{sid}"), 401, "unauthorized")


def test_forged_and_malformed_grants_are_unknown_keys(daemon: Daemon, alice: Client, box: dict):
    sid = box["id"]
    token = mint(alice, sid, ["exec"])["token"]
    # One character of the MAC changed.
    forged = token[:-2] + ("A" if token[-2] != "A" else "B") + token[-1]
    for bad in [forged, "hg_", "hg_" + "A" * 80, token + "AA"]:
        r = requests.get(f"{daemon.base}/v1/sandboxes/{sid}", headers={"Authorization": f"Bearer {bad}"}, timeout=30)
        expect_error(r, 401, "unauthorized")


def test_grant_requests_are_validated(alice: Client, box: dict):
    sid = box["id"]
    for body in [
        {"scopes": [], "ttl_seconds": 60},
        {"scopes": ["root"], "ttl_seconds": 60},
        {"scopes": ["exec", "exec"], "ttl_seconds": 60},
        {"scopes": ["ports:0"], "ttl_seconds": 60},
        {"scopes": ["ports:65536"], "ttl_seconds": 60},
        {"scopes": ["ports:http"], "ttl_seconds": 60},
        {"scopes": ["exec"], "ttl_seconds": 0},
        {"scopes": ["exec"], "ttl_seconds": 86401},
        {"scopes": ["exec"]},
    ]:
        expect_error(alice.post(f"/v1/sandboxes/{sid}/grants", body), 400, "invalid_request")


def test_mutating_calls_made_with_a_grant_are_audited_under_its_key(daemon: Daemon, alice: Client, box: dict):
    sid = box["id"]
    user = as_grant(daemon, mint(alice, sid, ["exec"]))
    user.sh(sid, "true")
    admin = daemon.client("admin")

    def row():
        r = admin.get("/v1/audit", params={"key": alice.key_id})
        if r.status_code != 200:
            return None
        return [x for x in r.json()["entries"]
                if x["route"] == "/v1/sandboxes/{id}/exec" and x["targets"].get("via") == "grant"
                and x["targets"].get("id") == sid]

    wait_for("the exec's audit row under the grant's key", row)
