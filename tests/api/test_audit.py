"""The audit log and the capabilities document, against a real daemon.

Audit: every mutating call (create, exec, files, snapshot, template, key
create and revoke, delete, and the E2B API's) is a row with the key's id
and name, the route's template and the ids it named, the client's address
and the outcome (status, and the error code of a failure); reads are not
recorded; only the admin key reads the log (others: 403 `forbidden`), and
no route changes it.

Capabilities: what `GET /v1/capabilities` advertises is what the daemon
allows: a create at the advertised maximum passes, one above is refused."""

from __future__ import annotations

import base64
import uuid

import pytest

from conftest import Client, Daemon, expect_error, expect_status, wait_for


def tname(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def audit(admin: Client, **params) -> list[dict]:
    """Every row matching `params`, newest first, through the cursor pages."""
    out, cursor = [], None
    for _ in range(1000):
        q = dict(params, limit=params.get("limit", 50))
        if cursor:
            q["cursor"] = cursor
        r = admin.get("/v1/audit", params=q)
        expect_status(r, 200)
        body = r.json()
        out += body["entries"]
        cursor = body.get("next_cursor")
        if not cursor:
            return out
    raise AssertionError("audit pages did not end")


def rows_until(admin: Client, key: str, route: str, method: str, n: int = 1) -> list[dict]:
    """The key's rows once `n` rows of `method route` are written (the
    writer appends in order: every earlier call's row is there too)."""
    found: list[dict] = []

    def ready():
        nonlocal found
        found = audit(admin, key=key)
        return sum(1 for e in found if e["route"] == route and e["method"] == method) >= n

    wait_for(f"the audit row of {method} {route}", ready, timeout=10)
    return found


@pytest.fixture(scope="module")
def admin(daemon: Daemon) -> Client:
    return daemon.client()


def admin_id(admin: Client) -> str:
    r = admin.get("/v1/keys")
    expect_status(r, 200)
    ids = [k["id"] for k in r.json()["keys"] if k["admin"]]
    assert len(ids) == 1, r.json()
    return ids[0]


def test_every_mutating_route_family_is_recorded_and_reads_are_not(daemon: Daemon, admin: Client):
    me = daemon.new_client(tname("audited"))
    name = None
    r = admin.get("/v1/keys")
    expect_status(r, 200)
    name = next(k["name"] for k in r.json()["keys"] if k["id"] == me.key_id)

    sb = me.create(ttl_seconds=600)
    sid = sb["id"]
    # Reads, which leave no row.
    me.sandbox(sid)
    me.list_all()
    expect_status(me.get(f"/v1/sandboxes/{sid}/files/list", params={"path": "/"}), 200)
    expect_status(me.get("/v1/usage"), 200)
    expect_status(me.get("/v1/capabilities"), 200)
    expect_status(me.request("HEAD", f"/v1/sandboxes/{sid}"), (200, 405))
    # Writes.
    assert me.exec(sid, "true")["exit_code"] == 0
    data = base64.b64encode(b"hello").decode()
    expect_status(me.post(f"/v1/sandboxes/{sid}/files/write", {"path": "/workspace/a.txt", "data": data}), (200, 201, 204))
    snap = me.post(f"/v1/sandboxes/{sid}/snapshots", {})
    t = me.post("/v1/templates", {"name": tname("tpl")})
    expect_status(t, 201)
    tid = t.json()["id"]
    expect_status(me.delete(f"/v1/templates/{tid}"), 204)
    # A failure: an exec in a sandbox that does not exist.
    missing = "sb-00000000000000ee"
    expect_error(me.exec_raw(missing, {"command": "true"}), 404, "not_found")
    if snap.status_code == 201:
        expect_status(me.delete(f"/v1/snapshots/{snap.json()['id']}"), (200, 204))
    me.destroy(sid)

    rows = rows_until(admin, me.key_id, "/v1/sandboxes/{id}", "DELETE")
    assert all(e["method"] not in ("GET", "HEAD", "OPTIONS") for e in rows), rows
    seen = [(e["method"], e["route"]) for e in reversed(rows)]
    want = [
        ("POST", "/v1/sandboxes"),
        ("POST", "/v1/sandboxes/{id}/exec"),
        ("POST", "/v1/sandboxes/{id}/files/write"),
        ("POST", "/v1/sandboxes/{id}/snapshots"),
        ("POST", "/v1/templates"),
        ("DELETE", "/v1/templates/{id}"),
        ("POST", "/v1/sandboxes/{id}/exec"),
    ] + ([("DELETE", "/v1/snapshots/{id}")] if snap.status_code == 201 else []) + [
        ("DELETE", "/v1/sandboxes/{id}"),
    ]
    assert seen == want, seen
    for e in rows:
        assert e["key_id"] == me.key_id and e["key_name"] == name, e
        assert e["client"] == "127.0.0.1", e
        assert isinstance(e["id"], int) and e["at"].endswith("Z"), e
    by_route = {(e["method"], e["route"], e["targets"].get("id")): e for e in rows}
    create = by_route[("POST", "/v1/sandboxes", None)]
    assert create["status"] == 201 and "error_code" not in create and create["targets"] == {"created": sid}, create
    tpl_row = by_route[("POST", "/v1/templates", None)]
    assert tpl_row["targets"] == {"created": tid}, tpl_row
    ok_exec = by_route[("POST", "/v1/sandboxes/{id}/exec", sid)]
    assert ok_exec["status"] == 200 and "error_code" not in ok_exec, ok_exec
    failed = by_route[("POST", "/v1/sandboxes/{id}/exec", missing)]
    assert (failed["status"], failed["error_code"]) == (404, "not_found"), failed
    snap_row = by_route[("POST", "/v1/sandboxes/{id}/snapshots", sid)]
    assert snap_row["status"] == snap.status_code, (snap_row, snap.text)
    if snap.status_code >= 400:
        assert snap_row["error_code"] == snap.json()["code"], snap_row
    else:
        assert snap_row["targets"] == {"id": sid, "created": snap.json()["id"]}, snap_row
    assert by_route[("DELETE", "/v1/templates/{id}", tid)]["status"] == 204


def test_key_create_and_revoke_are_the_admins_rows(daemon: Daemon, admin: Client):
    me = admin_id(admin)
    r = admin.post("/v1/keys", {"name": tname("made")})
    expect_status(r, 201)
    kid = r.json()["id"]
    # A refusal: an admin may not revoke itself.
    expect_status(admin.delete(f"/v1/keys/{me}"), 400)
    expect_status(admin.delete(f"/v1/keys/{kid}"), 204)
    rows = rows_until(admin, me, "/v1/keys/{id}", "DELETE", n=2)
    made = [e for e in rows if e["route"] == "/v1/keys" and e["method"] == "POST" and e["status"] == 201]
    assert made and made[0]["targets"] == {"created": kid}, rows
    revokes = [e for e in rows if e["route"] == "/v1/keys/{id}" and e["method"] == "DELETE"]
    assert {(e["targets"]["id"], e["status"], e.get("error_code")) for e in revokes[:2]} == {
        (kid, 204, None), (me, 400, "invalid_request")}, revokes
    assert all(e["key_id"] == me for e in rows)


def test_only_the_admin_reads_the_log_and_nothing_changes_it(daemon: Daemon, admin: Client):
    alice = daemon.new_client(tname("alice"))
    bob = daemon.new_client(tname("bob"))
    expect_error(bob.post("/v1/sandboxes/sb-00000000000000ef/exec", {"command": "true"}), 404, "not_found")
    rows_until(admin, bob.key_id, "/v1/sandboxes/{id}/exec", "POST")
    for who in (alice, bob):
        expect_error(who.get("/v1/audit"), 403, "forbidden")
        expect_error(who.get("/v1/audit", params={"key": bob.key_id}), 403, "forbidden")
    assert audit(admin, key=alice.key_id) == []
    # No route writes to the log, even for the admin.
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        r = admin.request(method, "/v1/audit")
        assert r.status_code == 405, (method, r.status_code, r.text)
    # The refused calls above are reads: bob's only row is his exec.
    assert [e["route"] for e in audit(admin, key=bob.key_id)] == ["/v1/sandboxes/{id}/exec"]
    # The writer's counters: rows written, none dropped or lost.
    text = admin.get("/metrics").text
    counters = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line.startswith("hutch_audit_")}
    assert counters["hutch_audit_written_total"] >= 1, counters
    assert counters["hutch_audit_dropped_total"] == 0 and counters["hutch_audit_failed_total"] == 0, counters


def test_pages_filters_and_bad_queries(daemon: Daemon, admin: Client):
    me = daemon.new_client(tname("pager"))
    for i in range(5):
        expect_error(me.post(f"/v1/sandboxes/sb-00000000000000{i:02x}/exec", {"command": "true"}), 404, "not_found")
    rows_until(admin, me.key_id, "/v1/sandboxes/{id}/exec", "POST", n=5)
    pages, cursor = [], None
    while True:
        q = {"key": me.key_id, "limit": 2, **({"cursor": cursor} if cursor else {})}
        body = admin.get("/v1/audit", params=q).json()
        pages.append([e["targets"]["id"][-2:] for e in body["entries"]])
        cursor = body.get("next_cursor")
        if not cursor:
            break
    assert pages == [["04", "03"], ["02", "01"], ["00"]], pages
    rows = audit(admin, key=me.key_id)
    mid = rows[2]["at"]
    assert [e["id"] for e in audit(admin, key=me.key_id, to=mid)] == [e["id"] for e in rows if e["at"] <= mid]
    assert [e["id"] for e in audit(admin, key=me.key_id, **{"from": mid})] == [e["id"] for e in rows if e["at"] >= mid]
    for bad in ({"from": "yesterday"}, {"cursor": "x"}, {"limit": 0}, {"key": "nobody"}, {"other": 1}):
        r = admin.get("/v1/audit", params=bad)
        assert r.status_code in (400, 404), (bad, r.status_code, r.text)


def test_e2b_calls_are_recorded(daemon: Daemon, admin: Client):
    key_id, secret = daemon.new_key(tname("e2b"), "--e2b")
    import requests

    s = requests.Session()
    s.headers["X-API-Key"] = secret
    r = s.post(daemon.base + "/sandboxes/nonexistent-0/timeout", json={"timeout": 30}, timeout=30)
    assert r.status_code == 404, r.text
    rows = rows_until(admin, key_id, "/sandboxes/{id}/timeout", "POST")
    e = rows[0]
    assert (e["status"], e["error_code"], e["targets"]) == (404, "not_found", {"id": "nonexistent-0"}), e


# --------------------------------------------------------------------------
# Capabilities


def test_capabilities_say_what_the_daemon_allows(daemon: Daemon):
    me = daemon.new_client(tname("caps"), "--max-memory-mb", "1000000")
    r = me.get("/v1/capabilities")
    expect_status(r, 200)
    caps = r.json()
    assert caps["api_version"] == "v1" and caps["version"], caps
    classes = {c["name"]: c for c in caps["classes"]}
    assert classes["container"]["available"] is True, classes
    assert sorted(classes) == ["container", "gvisor", "microvm", "process"], classes
    assert classes["microvm"]["available"] is False, classes
    for c in classes.values():
        assert c["available"] or c["reason"], classes
    features = caps["features"]
    for f in ("networks", "disk_storage", "snapshots", "fork", "memory_snapshots", "secrets", "fleet", "console",
              "mcp"):
        assert isinstance(features[f]["enabled"], bool), (f, features)
        if not features[f]["enabled"]:
            assert features[f]["reason"], (f, features)
    assert features["fleet"]["enabled"] is False, features
    # Memory snapshots are gvisor's, on a disk layer.
    assert features["memory_snapshots"]["enabled"] == (
        classes["gvisor"]["available"] and features["disk_storage"]["enabled"]), (classes, features)
    # Secrets are injected by the egress proxy, which needs networks.
    assert features["secrets"]["enabled"] == features["networks"]["enabled"], features
    # The key's holdings and quotas, as /v1/usage says them (which adds
    # its metered report).
    usage = me.get("/v1/usage").json()
    assert {k: usage[k] for k in caps["usage"]} == caps["usage"], (caps["usage"], usage)
    assert usage["key_id"] == me.key_id and "rows" not in caps["usage"], usage
    assert caps["usage"]["quotas"]["max_memory_mb"] == 1000000

    lim = caps["limits"]
    for name in ("memory_mb", "vcpus", "disk_mib", "pids", "ttl_seconds"):
        assert 0 < lim[name]["min"] <= lim[name]["max"], (name, lim)

    # Above each maximum: refused, nothing made.
    memory_max = int(lim["memory_mb"]["max"])
    over = [
        {"memory_mb": memory_max + 1},
        {"memory_mb": int(lim["memory_mb"]["min"]) - 1},
        {"limits": {"vcpus": lim["vcpus"]["max"] * 2}},
        {"limits": {"pids": int(lim["pids"]["max"]) + 1}},
        {"limits": {"disk_mib": int(lim["disk_mib"]["max"]) + 1}},
        {"ttl_seconds": int(lim["ttl_seconds"]["max"]) + 1},
    ]
    for body in over:
        r = me.post("/v1/sandboxes", {"storage": "memory", **body})
        assert r.status_code in (400, 429), (body, r.status_code, r.text)
        assert r.json()["code"] in ("invalid_request", "sandbox_capacity_unavailable"), (body, r.text)
    assert me.list_all() == []
    # At the maxima: accepted (the host holds one such sandbox: its memory
    # limit is the host's memory, a cap, not a reservation).
    sb = me.create(memory_mb=memory_max, ttl_seconds=int(lim["ttl_seconds"]["max"]),
                   limits={"pids": int(lim["pids"]["max"]), "vcpus": lim["vcpus"]["max"]})
    assert sb["memory_mb"] == memory_max, sb
    me.destroy(sb["id"])
    # What the features say is what the daemon does.
    if not features["networks"]["enabled"]:
        r = me.post("/v1/sandboxes", {"network": {"egress": "allow_all"}})
        expect_error(r, 400, "feature_unavailable")


def test_mcp_tool_calls_that_change_something_are_recorded(daemon: Daemon, admin: Client):
    """`/mcp` is one route for every operation: its mutating tool calls are
    rows of their own (`mcp:<tool>`), its reads (list_sandboxes) are not."""
    import asyncio

    from test_mcp import http_client

    me = daemon.new_client(tname("mcp"))

    async def go():
        async with http_client(daemon, me.key) as c:
            await c.list_tools()
            r = await c.call_tool("list_sandboxes", {})
            assert not r.is_error, r.content
            r = await c.call_tool("exec", {"command": "true", "sandbox_id": "sb-00000000000000ed"})
            assert r.is_error and r.structured_content["code"] == "not_found", r.content
            r = await c.call_tool("delete_sandbox", {"sandbox_id": "sb-00000000000000ed"})
            return r

    deleted = asyncio.run(go())
    rows = rows_until(admin, me.key_id, "mcp:delete_sandbox", "POST")
    assert [e["route"] for e in reversed(rows)] == ["mcp:exec", "mcp:delete_sandbox"], rows
    exec_row = rows[1]
    assert (exec_row["status"], exec_row["error_code"]) == (404, "not_found"), exec_row
    assert exec_row["targets"] == {"sandbox_id": "sb-00000000000000ed"}, exec_row
    assert exec_row["client"] == "127.0.0.1" and exec_row["key_id"] == me.key_id, exec_row
    assert (rows[0].get("error_code") is None) == (not deleted.is_error), (rows[0], deleted.content)


def test_a_clean_stop_writes_queued_rows_and_retention_prunes(own_daemon: Daemon):
    """Rows queued when the daemon is told to stop are written before it
    exits; a restart with a retention shorter than their age prunes them,
    and calls after the prune are recorded again."""
    d = own_daemon.start()
    admin = d.client()
    me = d.new_client(tname("kept"))
    expect_error(me.post("/v1/sandboxes/sb-00000000000000dd/exec", {"command": "true"}), 404, "not_found")
    # No wait for the writer: the stop must flush it.
    assert d.stop() == 0
    d.start()
    rows = audit(admin, key=me.key_id)
    assert [(e["route"], e["status"]) for e in rows] == [("/v1/sandboxes/{id}/exec", 404)], rows
    assert d.stop() == 0

    d.extra_env["HUTCH_AUDIT_RETENTION"] = "1ms"
    d.start()
    wait_for("the prune at start", lambda: audit(admin, key=me.key_id) == [], timeout=10)
    expect_error(me.post("/v1/sandboxes/sb-00000000000000dc/exec", {"command": "true"}), 404, "not_found")
    rows = rows_until(admin, me.key_id, "/v1/sandboxes/{id}/exec", "POST")
    assert [e["targets"]["id"] for e in rows] == ["sb-00000000000000dc"], rows


def test_a_call_whose_client_left_is_still_recorded(daemon: Daemon, admin: Client):
    """A client that hangs up before its answer still leaves its row: 499
    when the daemon dropped the call, else the status it finished with."""
    import requests

    me = daemon.new_client(tname("gone"))
    sb = me.create(ttl_seconds=300)
    try:
        with pytest.raises(requests.exceptions.ReadTimeout):
            me.post(f"/v1/sandboxes/{sb['id']}/exec", {"command": "sleep 3"}, timeout=0.5)
        rows = rows_until(admin, me.key_id, "/v1/sandboxes/{id}/exec", "POST")
        e = next(e for e in rows if e["route"] == "/v1/sandboxes/{id}/exec")
        assert e["status"] in (200, 499) and e["targets"]["id"] == sb["id"], e
    finally:
        me.destroy(sb["id"])
