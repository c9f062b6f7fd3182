"""Tenants are strangers: a second key tries every route on the first key's
sandboxes, templates, builds, images, access grants and E2B tokens, and gets
nothing; keys have quotas and the host has a capacity, both checked before
anything is made; revoking a key ends its sandboxes and cuts their E2B
tokens off; the admin key sees and ends every owner's things.

Everything here runs against a real daemon with real sandboxes."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import threading
import time
import uuid

import pytest
import requests

from conftest import Client, Daemon, expect_error, expect_status, wait_for

E2B_WAIT = 60


def tname(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


# --------------------------------------------------------------------------
# Two tenants on the session's daemon


@pytest.fixture(scope="module")
def alice(daemon: Daemon) -> Client:
    return daemon.new_client("alice")


@pytest.fixture(scope="module")
def bob(daemon: Daemon) -> Client:
    return daemon.new_client("bob")


@pytest.fixture(scope="module")
def alice_world(daemon: Daemon, alice: Client) -> dict:
    """Alice's things: a sandbox with a file and a background command, a
    template, an access grant."""
    sb = alice.create(ttl_seconds=900)
    alice.sh(sb["id"], "echo secret > /workspace/secret.txt")
    pid = alice.background(sb["id"], "sleep 600")
    t = alice.post("/v1/templates", {"name": tname("alice")})
    expect_status(t, 201)
    g = alice.post(f"/v1/sandboxes/{sb['id']}/access", {"port": 8080})
    expect_status(g, 201)
    return {"sandbox": sb, "pid": pid, "template": t.json(), "grant": g.json()}


def body_for(method: str) -> dict | None:
    """A plausible body for any write route: whatever the route, it must
    refuse another owner's thing before it looks at the body."""
    if method in ("post", "put", "patch"):
        return {"command": "cat /workspace/secret.txt", "path": "/workspace/secret.txt", "port": 8080,
                "by": 3600, "signal": "KILL", "data": "", "name": tname("x")}
    return None


def test_another_key_reaches_nothing_of_the_first_on_any_route(daemon: Daemon, alice: Client, bob: Client,
                                                             alice_world: dict):
    """Every route of the OpenAPI document that names a thing, called by bob
    with alice's ids, answers exactly what it answers for ids that name
    nothing: an error, and no way to tell alice's things exist."""
    sb, tpl, grant = alice_world["sandbox"], alice_world["template"], alice_world["grant"]
    real = {"{id}": sb["id"], "{pid}": str(alice_world["pid"]), "{grant}": grant["id"], "{port}": "8080",
            "{build}": "bld-0000000000000000", "{tpl}": tpl["id"], "{key}": alice.key_id}
    none = {"{id}": "sb-00000000000000ff", "{pid}": str(alice_world["pid"]), "{grant}": "ag-00000000000000ff",
            "{port}": "8080", "{build}": "bld-00000000000000ff", "{tpl}": "tpl-00000000000000ff",
            "{key}": "key-0000000000ff"}
    doc = expect_status_json(bob.get("/v1/openapi.json"))
    tried = 0
    for path, methods in doc["paths"].items():
        if "{" not in path:
            continue
        shaped = path
        if path.startswith("/v1/templates/"):
            shaped = shaped.replace("{id}", "{tpl}", 1)
        if path.startswith("/v1/keys/"):
            shaped = shaped.replace("{id}", "{key}", 1)

        def fill(ids: dict) -> str:
            out = shaped
            for k, v in ids.items():
                out = out.replace(k, v)
            return out

        for method in methods:
            body = {} if path.startswith("/v1/keys/") and method == "patch" else body_for(method)
            answers = []
            for ids in (real, none):
                r = bob.request(method.upper(), fill(ids), json=body, params={"path": "/workspace/secret.txt"})
                assert 400 <= r.status_code < 500, f"{method.upper()} {fill(ids)} as bob -> {r.status_code}: {r.text[:300]}"
                answers.append((r.status_code, r.json()["code"]))
                assert "secret\n" not in r.text, r.text
            tried += 1
            assert answers[0] == answers[1], (
                f"{method.upper()} {path}: bob can tell alice's thing exists: {answers[0]} vs {answers[1]} for nothing"
            )
    assert tried >= 30, f"only {tried} routes with ids were tried"
    # Nothing of Alice's changed.
    after = alice.sandbox(sb["id"])
    assert after["state"] == "running" and after["expires_at"] == sb["expires_at"], after
    assert alice.sh(sb["id"], "cat /workspace/secret.txt") == "secret\n"
    assert any(p["pid"] == alice_world["pid"] for p in alice.processes(sb["id"]))
    t = alice.get(f"/v1/templates/{tpl['id']}").json()
    assert t["version"] == tpl["version"] and t["name"] == tpl["name"], t
    grants = alice.get(f"/v1/sandboxes/{sb['id']}/access").json()["grants"]
    assert [g["id"] for g in grants] == [grant["id"]]


def expect_status_json(r: requests.Response) -> dict:
    expect_status(r, 200)
    return r.json()


def test_listings_show_only_the_callers_own(daemon: Daemon, alice: Client, bob: Client, alice_world: dict):
    sb, tpl = alice_world["sandbox"], alice_world["template"]
    assert sb["id"] not in [s["id"] for s in bob.list_all()]
    assert tpl["id"] not in [t["id"] for t in bob.get("/v1/templates").json()["templates"]]
    # A key may not ask for another owner's lists.
    for path in ("/v1/sandboxes", "/v1/templates"):
        expect_error(bob.get(path, params={"owner": alice.key_id}), 403, "forbidden")
        expect_error(bob.get(path, params={"owner": "*"}), 403, "forbidden")
    expect_error(bob.get("/v1/usage", params={"key": alice.key_id}), 403, "forbidden")
    expect_error(bob.get("/v1/keys"), 403, "forbidden")
    expect_error(bob.post("/v1/keys", {"name": "mine"}), 403, "forbidden")
    # The proxy does not take another sandbox's grant either.
    r = requests.get(f"{daemon.base}/v1/sandboxes/{sb['id']}/ports/8081/",
                     headers={"X-Hutch-Sandbox-Token": alice_world["grant"]["token"]}, timeout=30)
    assert r.status_code == 403 and r.json()["code"] == "access_token_wrong_target", r.text


def test_the_admin_key_sees_and_ends_every_owners_things(daemon: Daemon, api: Client):
    carol = daemon.new_client("carol")
    sb = carol.create()
    t = expect_status_json_created(carol.post("/v1/templates", {"name": tname("carol")}))
    listed = api.get("/v1/sandboxes", params={"owner": carol.key_id}).json()["sandboxes"]
    assert [s["id"] for s in listed] == [sb["id"]] and listed[0]["owner"] == carol.key_id
    everyone = api.list_all_of("*") if hasattr(api, "list_all_of") else api.get(
        "/v1/sandboxes", params={"owner": "*", "limit": 1000}).json()["sandboxes"]
    assert sb["id"] in [s["id"] for s in everyone]
    tpls = api.get("/v1/templates", params={"owner": carol.key_id}).json()["templates"]
    assert [x["id"] for x in tpls] == [t["id"]]
    assert api.get(f"/v1/templates/{t['id']}").json()["owner"] == carol.key_id
    assert api.get(f"/v1/sandboxes/{sb['id']}").json()["owner"] == carol.key_id
    # The admin may end it, but not use it: commands and files are the owner's.
    expect_error(api.exec_raw(sb["id"], {"command": "true"}), 404, "not_found")
    gone = api.delete(f"/v1/sandboxes/{sb['id']}")
    expect_status(gone, 200)
    assert gone.json()["state"] == "terminated"
    assert carol.sandbox(sb["id"])["state"] == "terminated"
    r = api.delete(f"/v1/templates/{t['id']}")
    assert r.status_code == 204, r.text
    expect_error(carol.get(f"/v1/templates/{t['id']}"), 404, "not_found")


def expect_status_json_created(r: requests.Response) -> dict:
    expect_status(r, 201)
    return r.json()


# --------------------------------------------------------------------------
# Revocation


def test_revoking_a_key_through_the_api_ends_its_sandboxes_at_once(daemon: Daemon, api: Client):
    dave = daemon.new_client("dave")
    sb = dave.create()
    expect_status(api.delete(f"/v1/keys/{dave.key_id}"), 204)
    dave.revoked = True
    expect_error(dave.get("/v1/sandboxes"), 401, "unauthorized")
    after = api.get(f"/v1/sandboxes/{sb['id']}").json()
    assert after["state"] == "terminated" and after["last_error_code"] == "key_revoked", after
    keys = {k["id"]: k for k in api.get("/v1/keys").json()["keys"]}
    assert keys[dave.key_id]["revoked_at"], keys[dave.key_id]
    # Again is not found; an admin key cannot revoke itself.
    expect_error(api.delete(f"/v1/keys/{dave.key_id}"), 404, "not_found")


def test_revoking_a_key_on_the_host_ends_its_sandboxes_at_the_next_tick(daemon: Daemon, api: Client):
    erin = daemon.new_client("erin")
    sb = erin.create()
    p = daemon.cli("key", "revoke", erin.key_id)
    assert p.returncode == 0, p.stderr
    erin.revoked = True
    wait_for("the revoked key's sandbox to end",
             lambda: api.get(f"/v1/sandboxes/{sb['id']}").json()["state"] == "terminated", timeout=15)
    assert api.get(f"/v1/sandboxes/{sb['id']}").json()["last_error_code"] == "key_revoked"


def e2b_create(daemon: Daemon, key: str) -> dict:
    r = requests.post(f"{daemon.base}/sandboxes", json={"templateID": "base", "timeout": 600},
                      headers={"X-API-KEY": key}, timeout=E2B_WAIT)
    assert r.status_code == 201, r.text
    return r.json()


def envd(daemon: Daemon, sb: dict, token: str | None = None, **headers) -> dict:
    h = {"E2b-Sandbox-Id": sb["sandboxID"], "X-Access-Token": token or sb["envdAccessToken"]}
    h.update(headers)
    return h


def connect_envelope(msg: dict) -> bytes:
    raw = json.dumps(msg).encode()
    return b"\x00" + len(raw).to_bytes(4, "big") + raw


def start_process(daemon: Daemon, headers: dict, cmd: str) -> requests.Response:
    body = connect_envelope({"process": {"cmd": "/bin/sh", "args": ["-c", cmd]}})
    return requests.post(f"{daemon.base}/process.Process/Start", data=body, timeout=30,
                         headers={**headers, "Content-Type": "application/connect+json"})


def test_revocation_cuts_off_a_keys_e2b_tokens(daemon: Daemon, api: Client):
    key_id, secret = daemon.new_key("e2b-frank", "--e2b")
    sb = e2b_create(daemon, secret)
    h = envd(daemon, sb)
    r = requests.get(f"{daemon.base}/files", params={"path": "/etc/hostname"}, headers=h, timeout=30)
    assert r.status_code == 200, r.text
    assert start_process(daemon, h, "echo hi").status_code == 200
    # Revoked on the host, with no API call: every envd entry point checks
    # the owner's key on each call.
    p = daemon.cli("key", "revoke", key_id)
    assert p.returncode == 0, p.stderr
    r = requests.get(f"{daemon.base}/files", params={"path": "/etc/hostname"}, headers=h, timeout=30)
    assert r.status_code in (401, 502), r.text
    r = start_process(daemon, h, "echo hi")
    assert r.status_code in (401, 502), r.text
    r = requests.post(f"{daemon.base}/files", params={"path": "/home/user/x"}, data=b"x", headers=h, timeout=30)
    assert r.status_code in (401, 502), r.text
    # The admin key sees it ended, with the reason.
    wait_for("the revoked key's E2B sandbox to end",
             lambda: api.get(f"/v1/sandboxes/{sb['sandboxID']}").json()["state"] == "terminated", timeout=15)
    assert api.get(f"/v1/sandboxes/{sb['sandboxID']}").json()["last_error_code"] == "key_revoked"


def test_e2b_tokens_and_routes_reach_only_their_own_sandbox(daemon: Daemon):
    _, a_key = daemon.new_key("e2b-a", "--e2b")
    _, b_key = daemon.new_key("e2b-b", "--e2b")
    a, b = e2b_create(daemon, a_key), e2b_create(daemon, b_key)
    try:
        for method, path in [("GET", "/sandboxes/{id}"), ("DELETE", "/sandboxes/{id}"),
                             ("POST", "/sandboxes/{id}/timeout"), ("POST", "/sandboxes/{id}/pause"),
                             ("POST", "/sandboxes/{id}/connect"), ("GET", "/sandboxes/{id}/metrics")]:
            r = requests.request(method, daemon.base + path.format(id=a["sandboxID"]), json={"timeout": 10},
                                 headers={"X-API-KEY": b_key}, timeout=30)
            assert r.status_code == 404, f"{method} {path} with another key -> {r.status_code} {r.text}"
        listed = requests.get(f"{daemon.base}/v2/sandboxes", headers={"X-API-KEY": b_key}, timeout=30).json()
        assert a["sandboxID"] not in [s["sandboxID"] for s in listed]
        # B's token names B's sandbox only.
        h = envd(daemon, a, token=b["envdAccessToken"])
        r = requests.get(f"{daemon.base}/files", params={"path": "/etc/hostname"}, headers=h, timeout=30)
        assert r.status_code == 401, r.text
        assert start_process(daemon, h, "id").status_code == 401
    finally:
        for sb, key in ((a, a_key), (b, b_key)):
            requests.delete(f"{daemon.base}/sandboxes/{sb['sandboxID']}", headers={"X-API-KEY": key}, timeout=30)


def signature(path: str, op: str, user: str, token: str, expiration: int) -> str:
    raw = f"{path}:{op}:{user}:{token}:{expiration}".encode()
    return "v1_" + base64.b64encode(hashlib.sha256(raw).digest()).decode().rstrip("=")


def test_a_signed_url_runs_as_the_user_it_was_signed_for_only(daemon: Daemon):
    _, key = daemon.new_key("e2b-signed", "--e2b")
    sb = e2b_create(daemon, key)
    try:
        token = sb["envdAccessToken"]
        exp = int(time.time()) + 300
        path = "/home/user/signed.txt"
        r = requests.post(f"{daemon.base}/files", params={"path": path}, data=b"hello",
                          headers=envd(daemon, sb), timeout=30)
        assert r.status_code == 200, r.text
        q = {"path": path, "username": "user", "signature": signature(path, "read", "user", token, exp),
             "signature_expiration": str(exp)}
        headers = {"E2b-Sandbox-Id": sb["sandboxID"]}
        r = requests.get(f"{daemon.base}/files", params=q, headers=headers, timeout=30)
        assert r.status_code == 200 and r.content == b"hello", r.text
        # The same URL with another user named in Basic auth: refused.
        root = {**headers, "Authorization": "Basic " + base64.b64encode(b"root:").decode()}
        r = requests.get(f"{daemon.base}/files", params=q, headers=root, timeout=30)
        assert r.status_code == 401, f"a URL signed for user was accepted for root: {r.status_code} {r.text}"
        # Nor as a write, nor for another path.
        r = requests.post(f"{daemon.base}/files", params=q, data=b"x", headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        r = requests.get(f"{daemon.base}/files", params={**q, "path": "/etc/shadow"}, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
    finally:
        requests.delete(f"{daemon.base}/sandboxes/{sb['sandboxID']}", headers={"X-API-KEY": key}, timeout=30)


# --------------------------------------------------------------------------
# E2B polled watchers: bounded per sandbox, ended with it


def create_watcher(daemon: Daemon, sb: dict) -> requests.Response:
    return requests.post(f"{daemon.base}/filesystem.Filesystem/CreateWatcher",
                         json={"path": "/home/user", "recursive": False}, timeout=30,
                         headers={**envd(daemon, sb), "Content-Type": "application/json"})


def test_polled_watchers_are_bounded_per_sandbox_and_end_with_it(daemon: Daemon):
    _, key = daemon.new_key("e2b-watch", "--e2b")
    first = e2b_create(daemon, key)
    for i in range(64):
        r = create_watcher(daemon, first)
        assert r.status_code == 200, f"watcher {i}: {r.text}"
    r = create_watcher(daemon, first)
    assert r.status_code == 429 and r.json()["code"] == "resource_exhausted", r.text
    ids = r.request.headers
    requests.delete(f"{daemon.base}/sandboxes/{first['sandboxID']}", headers={"X-API-KEY": key}, timeout=30)
    # Freed with the sandbox: another sandbox gets its own 64.
    second = e2b_create(daemon, key)
    try:
        for i in range(64):
            r = create_watcher(daemon, second)
            assert r.status_code == 200, f"watcher {i} of a new sandbox: {r.text}"
        wid = r.json()["watcherId"]
        # A watcher of one sandbox is unknown to another's token.
        third = e2b_create(daemon, key)
        r = requests.post(f"{daemon.base}/filesystem.Filesystem/GetWatcherEvents", json={"watcherId": wid},
                          headers={**envd(daemon, third), "Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 404, r.text
        requests.delete(f"{daemon.base}/sandboxes/{third['sandboxID']}", headers={"X-API-KEY": key}, timeout=30)
    finally:
        requests.delete(f"{daemon.base}/sandboxes/{second['sandboxID']}", headers={"X-API-KEY": key}, timeout=30)
    assert ids is not None


# --------------------------------------------------------------------------
# Quotas and the host's capacity


def test_a_sandbox_larger_than_the_host_is_refused_and_nothing_is_made(daemon: Daemon, api: Client):
    before = {s["id"] for s in api.list_all()}
    r = api.post("/v1/sandboxes", {"memory_mb": 262144})
    body = expect_error(r, 429, "sandbox_capacity_unavailable")
    assert "memory_mb" in body["error"], body
    assert {s["id"] for s in api.list_all()} == before


def test_key_quotas_refuse_past_their_caps_and_usage_tells_the_key(daemon: Daemon, api: Client):
    c = daemon.new_client("quota", "--max-sandboxes", "2", "--max-memory-mb", "1024",
                          "--max-ttl-seconds", "300")
    a = c.create(memory_mb=512, ttl_seconds=60)
    c.create(memory_mb=512, ttl_seconds=60)
    u = expect_status_json(c.get("/v1/usage"))
    assert (u["sandboxes"], u["memory_mb"]) == (2, 1024), u
    assert u["quotas"]["max_sandboxes"] == 2 and u["quotas"]["max_ttl_seconds"] == 300, u
    body = expect_error(c.post("/v1/sandboxes", {"memory_mb": 64, "ttl_seconds": 60}), 429, "quota_exceeded")
    assert "sandboxes" in body["error"], body
    c.destroy(a["id"])
    # Room for one more sandbox, but not for its memory.
    body = expect_error(c.post("/v1/sandboxes", {"memory_mb": 1024, "ttl_seconds": 60}), 429, "quota_exceeded")
    assert "memory_mb" in body["error"], body
    # The lifetime: on create, and on extend past creation + 300 s.
    body = expect_error(c.post("/v1/sandboxes", {"memory_mb": 64, "ttl_seconds": 301}), 429, "quota_exceeded")
    assert "ttl_seconds" in body["error"], body
    sb = c.create(memory_mb=64, ttl_seconds=60)
    expect_error(c.post(f"/v1/sandboxes/{sb['id']}/extend", {"by": 600}), 400, "invalid_request")
    # The admin changes the quotas through the API; they hold at once.
    r = api.request("PATCH", f"/v1/keys/{c.key_id}", json={"max_sandboxes": 2})
    expect_status(r, 200)
    assert r.json()["quotas"] == {"max_sandboxes": 2}, r.json()
    expect_error(c.post("/v1/sandboxes", {"memory_mb": 64, "ttl_seconds": 60}), 429, "quota_exceeded")
    # Nothing refused was made.
    assert len([s for s in c.list_all() if s["state"] != "terminated"]) == 2


def test_concurrent_creates_never_pass_a_quota_together(daemon: Daemon):
    c = daemon.new_client("race", "--max-sandboxes", "3")
    results: list[int] = []
    lock = threading.Lock()

    def one():
        r = c.clone().post("/v1/sandboxes", {"memory_mb": 64})
        with lock:
            results.append(r.status_code)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(results) == [201] * 3 + [429] * 5, results
    assert len([s for s in c.list_all() if s["state"] != "terminated"]) == 3


def test_builds_at_once_are_capped_per_key(daemon: Daemon):
    import io
    import tarfile

    c = daemon.new_client("builder", "--max-builds", "1")
    t = expect_status_json_created(c.post("/v1/templates", {"name": tname("q")}))

    def ctx(text: str) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            raw = text.encode()
            info = tarfile.TarInfo("Dockerfile")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
        return buf.getvalue()

    post = lambda: c.request("POST", f"/v1/templates/{t['id']}/builds", data=ctx("RUN sleep 5\n"),
                             headers={"Content-Type": "application/gzip"})
    first = post()
    assert first.status_code == 202, first.text
    body = expect_error(post(), 429, "quota_exceeded")
    assert "builds" in body["error"], body
    bid = first.json()["id"]
    wait_for("the first build to end",
             lambda: c.get(f"/v1/templates/{t['id']}/builds/{bid}").json()["state"] in ("succeeded", "failed"),
             timeout=120, interval=0.3)
    assert post().status_code == 202


def test_the_host_capacity_counts_every_owners_sandboxes(own_daemon: Daemon):
    d = own_daemon
    d.extra_env = {"HUTCH_MAX_SANDBOXES": "2"}
    d.start()
    api = d.client("admin")
    other = d.new_client("other")
    api.create(memory_mb=64)
    other.create(memory_mb=64)
    body = expect_error(api.post("/v1/sandboxes", {"memory_mb": 64}), 429, "sandbox_capacity_unavailable")
    assert "sandboxes" in body["error"], body
    expect_error(other.post("/v1/sandboxes", {"memory_mb": 64}), 429, "sandbox_capacity_unavailable")


# --------------------------------------------------------------------------
# Requests that must be refused cleanly (finding 14)


def test_malformed_requests_get_the_json_error_body(daemon: Daemon, api: Client, sandbox: dict):
    sid = sandbox["id"]
    for r, status, code in [
        (api.post(f"/v1/sandboxes/{sid}/processes/notapid/signal", {"signal": "KILL"}), 404, "not_found"),
        (api.get(f"/v1/sandboxes/{sid}/processes/99999999999/stream"), 404, "not_found"),
        (api.request("PUT", "/v1/sandboxes"), 405, "method_not_allowed"),
        (api.request("PATCH", f"/v1/sandboxes/{sid}"), 405, "method_not_allowed"),
        (api.get("/v1/nothing/here"), 404, "not_found"),
        (api.get("/v1/sandboxes", params={"limit": "many"}), 400, "invalid_request"),
    ]:
        expect_error(r, status, code)


def test_only_a_json_object_creates_a_sandbox(daemon: Daemon, api: Client):
    before = {s["id"] for s in api.list_all()}
    for data, ctype in [("[]", "application/json"), ('"x"', "application/json"), ("{}", "text/plain"),
                        ("memory_mb=64", "application/x-www-form-urlencoded")]:
        r = api.request("POST", "/v1/sandboxes", data=data, headers={"Content-Type": ctype})
        expect_error(r, 400, "invalid_request")
    expect_error(api.post("/v1/sandboxes", {"wait_seconds": 61}), 400, "invalid_request")
    assert {s["id"] for s in api.list_all()} == before


def test_a_command_that_exits_before_its_stdin_is_written_runs_once(api: Client, sandbox: dict):
    sid = sandbox["id"]
    key = f"k-{uuid.uuid4().hex}"
    # The command closes its stdin and exits at once; the input (4 MiB)
    # cannot be written. The command ran: its result is the key's, and a
    # retry replays it instead of running it again.
    body = {"command": "exec 0<&-; echo ran >> /workspace/runs", "stdin": "x" * (4 << 20) }
    first = api.exec_raw(sid, body, idempotency_key=key)
    expect_status(first, 200)
    again = api.exec_raw(sid, body, idempotency_key=key)
    assert again.status_code in (200, 409), again.text
    if again.status_code == 409:
        assert again.json()["code"] == "execution_outcome_unknown", again.text
    assert api.sh(sid, "wc -l < /workspace/runs").strip() == "1"


def test_hutch_key_manages_keys_through_the_api_for_an_admin_key(daemon: Daemon, api: Client, tmp_path):
    """`hutch key` with HUTCH_URL works from a machine without the daemon's
    database (an empty state directory here), for the admin key only."""
    env = {"HUTCH_URL": daemon.base, "HUTCH_API_KEY": api.key, "HUTCH_STATE_DIR": str(tmp_path),
           "PATH": os.environ["PATH"]}

    def hutch(*args: str, key: str | None = None) -> subprocess.CompletedProcess:
        e = dict(env, **({"HUTCH_API_KEY": key} if key else {}))
        return subprocess.run([str(daemon.binary), "key", *args], env=e, capture_output=True, text=True, timeout=30)

    p = hutch("create", "--name", "remote-made", "--max-sandboxes", "3", "--json")
    assert p.returncode == 0, p.stderr
    made = json.loads(p.stdout)
    assert made["secret"] and made["quotas"]["max_sandboxes"] == 3, made
    assert requests.get(daemon.base + "/v1/sandboxes", headers={"Authorization": f"Bearer {made['secret']}"},
                        timeout=10).status_code == 200
    p = hutch("quotas", made["id"], "--max-sandboxes", "1", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["quotas"]["max_sandboxes"] == 1, p.stderr
    listed = {k["id"]: k for k in json.loads(hutch("list", "--json").stdout)}
    assert listed[made["id"]]["name"] == "remote-made"
    # A key that is not the admin's manages nothing, and learns nothing.
    p = hutch("list", "--json", key=made["secret"])
    assert p.returncode == 1 and "forbidden" in p.stderr, p.stderr
    assert hutch("revoke", made["id"]).returncode == 0
    assert requests.get(daemon.base + "/v1/sandboxes", headers={"Authorization": f"Bearer {made['secret']}"},
                        timeout=10).status_code == 401
