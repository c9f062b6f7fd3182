"""API keys: every route but /healthz and /v1/openapi.json needs one; keys
made with `hutch key create` work until revoked; a key sees only its own
sandboxes."""

from __future__ import annotations

import pytest

from conftest import Client, Daemon, expect_error, expect_status

PROTECTED = [
    ("GET", "/v1/sandboxes"),
    ("POST", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes/sb-0000000000000000"),
    ("DELETE", "/v1/sandboxes/sb-0000000000000000"),
    ("POST", "/v1/sandboxes/sb-0000000000000000/exec"),
    ("POST", "/v1/sandboxes/sb-0000000000000000/extend"),
    ("POST", "/v1/sandboxes/sb-0000000000000000/suspend"),
    ("POST", "/v1/sandboxes/sb-0000000000000000/resume"),
    ("GET", "/v1/sandboxes/sb-0000000000000000/processes"),
    ("GET", "/v1/sandboxes/sb-0000000000000000/metrics"),
    ("POST", "/v1/executions"),
    ("GET", "/v1/events"),
    ("GET", "/v1/events/stream"),
    ("GET", "/v1/webhooks"),
    ("POST", "/v1/webhooks"),
    ("GET", "/v1/webhooks/wh-0000000000000000/deliveries"),
    ("DELETE", "/v1/webhooks/wh-0000000000000000"),
    ("GET", "/metrics"),
]


@pytest.mark.parametrize("method,path", PROTECTED, ids=[f"{m} {p}" for m, p in PROTECTED])
def test_missing_or_wrong_keys_are_401(daemon: Daemon, method: str, path: str):
    nokey = Client(daemon.base, None)
    r = nokey.request(method, path, json={"command": "true"})
    expect_error(r, 401, "unauthorized")
    assert r.headers.get("WWW-Authenticate", "").startswith("Bearer")
    for bad in ("hutch_" + "0" * 48, "", "Basic abc"):
        c = Client(daemon.base, None)
        c.session.headers["Authorization"] = f"Bearer {bad}" if not bad.startswith("Basic") else bad
        expect_error(c.request(method, path, json={"command": "true"}), 401, "unauthorized")


def test_healthz_and_openapi_need_no_key(daemon: Daemon):
    nokey = Client(daemon.base, None)
    r = nokey.get("/healthz")
    assert r.status_code == 200 and r.text.strip() == "ok"
    expect_status(nokey.get("/v1/openapi.json"), 200)


def test_a_created_key_works_until_revoked(daemon: Daemon):
    key_id, secret = daemon.new_key("revocable")
    c = Client(daemon.base, secret, daemon.clients)
    sb = c.create()
    assert c.sh(sb["id"], "echo hi") == "hi\n"
    p = daemon.cli("key", "list", "--json")
    assert p.returncode == 0, p.stderr
    assert any(k["id"] == key_id and k["name"] == "revocable" and "secret" not in k for k in
               __import__("json").loads(p.stdout))
    c.destroy(sb["id"])
    p = daemon.cli("key", "revoke", key_id)
    assert p.returncode == 0, p.stderr
    c.revoked = True
    expect_error(c.get("/v1/sandboxes"), 401, "unauthorized")
    expect_error(c.post("/v1/sandboxes", {}), 401, "unauthorized")


def test_a_key_cannot_see_another_keys_sandboxes(daemon: Daemon, api: Client, sandbox: dict):
    other = daemon.new_client("other-tenant")
    sid = sandbox["id"]
    expect_error(other.get(f"/v1/sandboxes/{sid}"), 404, "not_found")
    expect_error(other.exec_raw(sid, {"command": "touch /workspace/intruder"}), 404, "not_found")
    expect_error(other.post(f"/v1/sandboxes/{sid}/extend", {"by": 10}), 404, "not_found")
    expect_error(other.post(f"/v1/sandboxes/{sid}/suspend"), 404, "not_found")
    expect_error(other.post(f"/v1/sandboxes/{sid}/resume"), 404, "not_found")
    expect_error(other.get(f"/v1/sandboxes/{sid}/processes"), 404, "not_found")
    expect_error(other.delete(f"/v1/sandboxes/{sid}"), 404, "not_found")
    assert sid not in [s["id"] for s in other.list_all()]
    # The owner's sandbox is untouched.
    assert api.sandbox(sid)["state"] == "running"
    assert api.exec(sid, "test -e /workspace/intruder")["exit_code"] != 0
    # Idempotency keys are per owner too: the same create key makes two sandboxes.
    mine = api.create(idempotency_key="shared-key-create")
    theirs = other.create(idempotency_key="shared-key-create")
    assert mine["id"] != theirs["id"]
    api.destroy(mine["id"])
    other.destroy(theirs["id"])
