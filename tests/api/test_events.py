"""Events and webhooks against a real daemon: each event type produced by the
action that causes it, the SSE stream resumed after a disconnect, webhook
deliveries signed, retried and surviving a kill -9, the SSRF refusals, and
one key seeing none of another's."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from conftest import Client, Daemon, expect_error, expect_status, host_processes_of, wait_for
from test_builds import build, make_template

# The private daemons' settings: a short notice of expiry, http:// allowed
# to this host's loopback only (for the test's receiver), quick retries.
ENV = {
    "HUTCH_EXPIRING_NOTICE": "5s",
    "HUTCH_WEBHOOK_ALLOW_HTTP": "127.0.0.1/32",
    "HUTCH_WEBHOOK_RETRY_BASE": "500ms",
}


def started(d: Daemon) -> Daemon:
    d.extra_env.update(ENV)
    return d.start()


def events(c: Client, **params) -> list[dict]:
    """Every event the key sees, oldest first (all pages)."""
    out, cursor = [], None
    for _ in range(100):
        q = dict(params, limit=1000)
        if cursor:
            q["cursor"] = cursor
        r = c.get("/v1/events", params=q)
        expect_status(r, 200)
        page = r.json()
        out += page["events"]
        cursor = page.get("next_cursor")
        if not cursor:
            return out
    raise AssertionError("too many pages")


def types_of(c: Client, sid: str) -> list[str]:
    return [e["type"] for e in events(c, sandbox=sid)]


def wait_event(c: Client, kind: str, timeout: float = 30, **params) -> dict:
    def found():
        got = [e for e in events(c, type=kind, **params)]
        return got[-1] if got else None

    return wait_for(f"a {kind} event ({params})", found, timeout=timeout, interval=0.1)


# --------------------------------------------------------------------------
# Events


def test_each_sandbox_transition_is_an_event_in_order(own_daemon: Daemon):
    api = started(own_daemon).client("admin")
    sb = api.create(ttl_seconds=600)
    sid = sb["id"]
    wait_event(api, "sandbox.ready", sandbox=sid)
    expect_status(api.post(f"/v1/sandboxes/{sid}/extend", {"by": 60}), 200)
    expect_status(api.post(f"/v1/sandboxes/{sid}/suspend", {}), 200)
    expect_status(api.post(f"/v1/sandboxes/{sid}/resume", {}), 200)
    expect_status(api.post(f"/v1/sandboxes/{sid}/suspend", {"mode": "disk"}), 200)
    expect_status(api.post(f"/v1/sandboxes/{sid}/resume", {}), 200)
    expect_status(api.post(f"/v1/sandboxes/{sid}/snapshots", {}), 201)
    r = api.post(f"/v1/sandboxes/{sid}/fork", {"count": 1})
    expect_status(r, 201)
    child = r.json()["sandboxes"][0]["id"]
    expect_status(api.delete(f"/v1/sandboxes/{sid}"), 200)
    expect_status(api.delete(f"/v1/sandboxes/{child}"), 200)
    want = [
        "sandbox.created",
        "sandbox.ready",
        "sandbox.extended",
        "sandbox.suspended",
        "sandbox.resumed",
        "sandbox.paused",
        "sandbox.resumed",
        "sandbox.ready",
        "sandbox.snapshot.created",
        "sandbox.forked",
        "sandbox.deleted",
    ]
    got = wait_for("every event of the sandbox", lambda: (t := types_of(api, sid)) == want and t, timeout=15)
    assert got == want
    evs = events(api, sandbox=sid)
    ids = [e["id"] for e in evs]
    assert ids == sorted(ids) and len(set(ids)) == len(ids), ids
    e = evs[0]
    assert e["sandbox_id"] == sid and e["owner"] and e["at"].endswith("Z"), e
    assert evs[2]["expires_at"], evs[2]
    fork = evs[-2]
    assert fork["children"] == [child], fork
    assert types_of(api, child)[:2] == ["sandbox.created", "sandbox.ready"]
    # Filters: type (a list), time, and a refused unknown type.
    only = events(api, sandbox=sid, type="sandbox.paused,sandbox.deleted")
    assert [x["type"] for x in only] == ["sandbox.paused", "sandbox.deleted"]
    assert events(api, sandbox=sid, **{"from": evs[-1]["at"]})[-1]["id"] == evs[-1]["id"]
    expect_error(api.get("/v1/events", params={"type": "sandbox.nope"}), 400, "invalid_request")
    # Pages follow the cursor.
    r = api.get("/v1/events", params={"sandbox": sid, "limit": 2})
    page = r.json()
    assert [x["id"] for x in page["events"]] == ids[:2] and page["next_cursor"] == str(ids[1])


def test_expiry_is_announced_then_happens(own_daemon: Daemon):
    api = started(own_daemon).client("admin")
    sid = api.create(ttl_seconds=3)["id"]
    expiring = wait_event(api, "sandbox.expiring", sandbox=sid, timeout=10)
    expired = wait_event(api, "sandbox.expired", sandbox=sid, timeout=20)
    assert expiring["id"] < expired["id"] and expired["code"] == "sandbox_expired", (expiring, expired)
    assert types_of(api, sid).count("sandbox.expiring") == 1


def test_oom_failure_quota_and_revocation_are_events(own_daemon: Daemon):
    d = started(own_daemon)
    api = d.client("admin")
    # A command killed by the memory limit.
    sid = api.create(memory_mb=128, storage="memory")["id"]
    res = api.exec(sid, "head -c 400M /dev/zero > /tmp/fill", timeout_seconds=120)
    assert res["oom_killed"] is True, res
    oom = wait_event(api, "sandbox.oom", sandbox=sid)
    assert oom["kills"] >= 1 and oom["memory_mb"] == 128, oom
    api.delete(f"/v1/sandboxes/{sid}")
    # A sandbox whose processes die: failed, with the code.
    sid = api.create()["id"]
    pids = wait_for("the sandbox's processes", lambda: host_processes_of([sid]), timeout=10)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    failed = wait_event(api, "sandbox.failed", sandbox=sid)
    assert failed["code"] == "sandbox_agent_exited", failed
    # A key's quota refusing a create; the key's revocation.
    small = d.new_client("small", "--max-sandboxes", "1")
    small.create()
    expect_error(small.post("/v1/sandboxes", {"ttl_seconds": 60}), 429, "quota_exceeded")
    q = wait_event(small, "quota.exceeded")
    assert q["resource"] == "sandboxes" and q["limit"] == 1 and q["owner"] == small.key_id, q
    expect_status(api.delete(f"/v1/keys/{small.key_id}"), 204)
    small.revoked = True
    rev = wait_event(api, "key.revoked", owner=small.key_id)
    assert rev["key_id"] == small.key_id, rev


def test_template_builds_are_events(own_daemon: Daemon):
    api = started(own_daemon).client("admin")
    t = make_template(api)
    ok, _ = build(api, t["id"], {"Dockerfile": "RUN echo built\n"})
    bad, _ = build(api, t["id"], {"Dockerfile": "RUN false\n"})
    assert (ok["state"], bad["state"]) == ("succeeded", "failed")
    got = wait_for(
        "three build events",
        lambda: (e := [x for x in events(api) if x["type"].startswith("template.build.")]) and len(e) >= 4 and e,
        timeout=15,
    )
    assert [x["type"] for x in got] == [
        "template.build.started",
        "template.build.succeeded",
        "template.build.started",
        "template.build.failed",
    ]
    assert got[1]["template_id"] == t["id"] and got[1]["build_id"] == ok["id"] and got[1]["version"] >= 1
    assert got[3]["build_id"] == bad["id"] and got[3]["error"], got[3]


class Sse:
    """A reader of `/v1/events/stream`: events as dicts, until told to stop."""

    def __init__(self, c: Client, last: int | None = None, **params):
        headers = {"Authorization": f"Bearer {c.key}"}
        if last is not None:
            headers["Last-Event-ID"] = str(last)
        self.r = requests.get(c.base + "/v1/events/stream", params=params, headers=headers, stream=True, timeout=30)
        assert self.r.status_code == 200, self.r.text
        assert self.r.headers["content-type"].startswith("text/event-stream"), self.r.headers
        self.lines = self.r.iter_lines(decode_unicode=True)

    def next(self) -> dict:
        ev: dict = {}
        for line in self.lines:
            if line == "":
                if "data" in ev:
                    data = json.loads(ev["data"])
                    assert str(data["id"]) == ev["id"] and data["type"] == ev["event"], ev
                    return data
                ev = {}
                continue
            if line.startswith(":"):
                continue
            k, _, v = line.partition(":")
            ev[k] = v[1:] if v.startswith(" ") else v
        raise AssertionError("the stream ended")

    def close(self) -> None:
        self.r.close()


def test_the_stream_follows_live_and_resumes_after_a_disconnect(own_daemon: Daemon):
    api = started(own_daemon).client("admin")
    s = Sse(api)
    try:
        sid = api.create()["id"]
        seen = [s.next(), s.next()]
        assert [e["type"] for e in seen] == ["sandbox.created", "sandbox.ready"], seen
    finally:
        s.close()
    # Missed while disconnected: replayed from the store, then live again.
    expect_status(api.post(f"/v1/sandboxes/{sid}/extend", {"by": 10}), 200)
    expect_status(api.post(f"/v1/sandboxes/{sid}/suspend", {}), 200)
    wait_event(api, "sandbox.suspended", sandbox=sid)
    s = Sse(api, last=seen[-1]["id"], sandbox=sid)
    try:
        replayed = [s.next(), s.next()]
        assert [e["type"] for e in replayed] == ["sandbox.extended", "sandbox.suspended"], replayed
        assert replayed[0]["id"] > seen[-1]["id"]
        expect_status(api.post(f"/v1/sandboxes/{sid}/resume", {}), 200)
        live = s.next()
        assert live["type"] == "sandbox.resumed" and live["id"] > replayed[-1]["id"], live
    finally:
        s.close()
    expect_error(
        requests.get(api.base + "/v1/events/stream", headers={"Authorization": f"Bearer {api.key}", "Last-Event-ID": "x"}, timeout=10),
        400,
        "invalid_request",
    )


# --------------------------------------------------------------------------
# Webhooks


class Receiver:
    """An HTTP receiver in a thread: answers `fail` times with 500, then 204;
    keeps every request (headers, body)."""

    def __init__(self, fail: int = 0):
        self.fail = fail
        self.got: list[tuple[dict, bytes, int]] = []
        self.lock = threading.Lock()
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):
                n = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(n)
                with outer.lock:
                    code = 500 if outer.fail > 0 else 204
                    outer.fail -= 1
                    outer.got.append(({k.lower(): v for k, v in self.headers.items()}, body, code))
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a):
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}/hook"
        self.t = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.t.start()

    def requests(self) -> list[tuple[dict, bytes, int]]:
        with self.lock:
            return list(self.got)

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


def verify(secret: str, headers: dict, body: bytes) -> dict:
    """Checks `Hutch-Signature` as a receiver would; returns the event."""
    parts = dict(p.split("=", 1) for p in headers["hutch-signature"].split(","))
    want = hmac.new(secret.encode(), f"{parts['t']}.".encode() + body, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(parts["v1"], want), headers
    assert abs(int(parts["t"]) - time.time()) < 600
    ev = json.loads(body)
    assert headers["hutch-event-id"] == str(ev["id"]) and headers["hutch-delivery-id"], headers
    return ev


def deliveries(c: Client, wid: str) -> list[dict]:
    r = c.get(f"/v1/webhooks/{wid}/deliveries")
    expect_status(r, 200)
    return r.json()["deliveries"]


def test_deliveries_are_signed_and_retried_after_failures(own_daemon: Daemon):
    api = started(own_daemon).client("admin")
    rx = Receiver(fail=2)
    try:
        r = api.post("/v1/webhooks", {"url": rx.url, "events": ["sandbox.created"]})
        expect_status(r, 201)
        w = r.json()
        assert w["secret"].startswith("whsec_") and w["events"] == ["sandbox.created"], w
        assert "secret" not in api.get(f"/v1/webhooks/{w['id']}").json()
        # Audited as any create, naming what it made (never its secret).
        row = wait_for(
            "the create's audit row",
            lambda: next((e for e in api.get("/v1/audit").json()["entries"] if e["route"] == "/v1/webhooks"), None),
        )
        assert row["targets"]["created"] == w["id"] and w["secret"] not in json.dumps(row), row
        sid = api.create()["id"]
        d = wait_for(
            "the delivery to succeed on its third attempt",
            lambda: (x := deliveries(api, w["id"])) and x[0]["status"] == "delivered" and x[0],
            timeout=30,
            interval=0.1,
        )
        assert d["attempts"] == 3 and d["last_http_status"] == 204 and d["event_type"] == "sandbox.created", d
        got = rx.requests()
        assert [code for _, _, code in got] == [500, 500, 204]
        for headers, body, _ in got:
            ev = verify(w["secret"], headers, body)
            assert ev["type"] == "sandbox.created" and ev["sandbox_id"] == sid, ev
            assert headers["hutch-delivery-id"] == str(d["id"])
        # A wrong secret does not verify.
        with pytest.raises(AssertionError):
            verify("not-the-secret-at-all", got[0][0], got[0][1])
        # Only the types asked for were sent.
        assert len(deliveries(api, w["id"])) == 1
        expect_status(api.delete(f"/v1/webhooks/{w['id']}"), 204)
        expect_error(api.get(f"/v1/webhooks/{w['id']}"), 404, "not_found")
    finally:
        rx.close()


def test_pending_deliveries_survive_a_kill_9(own_daemon: Daemon):
    d = started(own_daemon)
    api = d.client("admin")
    rx = Receiver(fail=10**6)
    try:
        r = api.post("/v1/webhooks", {"url": rx.url, "events": ["*"], "secret": "s" * 32})
        expect_status(r, 201)
        wid = r.json()["id"]
        sid = api.create()["id"]
        wait_for("a failed first attempt", lambda: any(x["attempts"] >= 1 for x in deliveries(api, wid)), timeout=20)
        pending = deliveries(api, wid)
        assert pending and all(x["status"] == "pending" and x["next_attempt_at"] for x in pending), pending
        d.kill9()
        with rx.lock:
            rx.fail = 0
        d.start()
        done = wait_for(
            "every delivery to be delivered after the restart",
            lambda: (x := deliveries(api, wid)) and all(y["status"] == "delivered" for y in x) and x,
            timeout=30,
            interval=0.2,
        )
        assert {x["id"] for x in pending} <= {x["id"] for x in done}
        sent = {verify("s" * 32, h, b)["id"] for h, b, code in rx.requests() if code == 204}
        assert {x["event_id"] for x in pending} <= sent
        api.delete(f"/v1/sandboxes/{sid}")
    finally:
        rx.close()


def test_webhook_targets_are_checked(daemon: Daemon, api: Client):
    """The session's daemon allows no http:// range."""
    refused = [
        "http://127.0.0.1:9/hook",
        "http://localhost:9/hook",
        "https://127.0.0.1/hook",
        "https://[::1]/hook",
        "https://169.254.169.254/latest/meta-data",
        "http://169.254.169.254/latest/meta-data",
        "https://[fd00:ec2::254]/",
        "https://10.0.0.1/",
        "https://user:pw@example.com/",
        "ftp://example.com/",
        "https://exa mple.com/",
    ]
    for url in refused:
        expect_error(api.post("/v1/webhooks", {"url": url, "events": ["*"]}), 400, "webhook_url_refused")
    expect_error(api.post("/v1/webhooks", {"url": "https://example.com/", "events": []}), 400, "invalid_request")
    expect_error(api.post("/v1/webhooks", {"url": "https://example.com/", "events": ["nope"]}), 400, "invalid_request")
    expect_error(
        api.post("/v1/webhooks", {"url": "https://example.com/", "events": ["*"], "secret": "short"}), 400, "invalid_request"
    )
    assert api.get("/v1/webhooks").json()["webhooks"] == []


def test_metadata_is_refused_even_where_http_is_allowed(own_daemon: Daemon):
    d = own_daemon
    d.extra_env["HUTCH_WEBHOOK_ALLOW_HTTP"] = "0.0.0.0/0,::/0"
    d.start()
    api = d.client("admin")
    for url in ["http://169.254.169.254/", "http://[fd00:ec2::254]/", "http://169.254.1.1/", "http://[fe80::1]/"]:
        expect_error(api.post("/v1/webhooks", {"url": url, "events": ["*"]}), 400, "webhook_url_refused")


def test_a_second_key_sees_none_of_the_firsts(own_daemon: Daemon):
    d = started(own_daemon)
    a, b = d.new_client("first"), d.new_client("second")
    rx = Receiver()
    try:
        sid = a.create()["id"]
        wait_event(a, "sandbox.ready", sandbox=sid)
        r = a.post("/v1/webhooks", {"url": rx.url, "events": ["*"]})
        expect_status(r, 201)
        wid = r.json()["id"]
        a.delete(f"/v1/sandboxes/{sid}")
        wait_for("a delivery", lambda: deliveries(a, wid), timeout=15)
        assert events(b) == []
        assert events(b, sandbox=sid) == []
        expect_error(b.get("/v1/events", params={"owner": a.key_id}), 403, "forbidden")
        assert b.get("/v1/webhooks").json()["webhooks"] == []
        expect_error(b.get(f"/v1/webhooks/{wid}"), 404, "not_found")
        expect_error(b.get(f"/v1/webhooks/{wid}/deliveries"), 404, "not_found")
        expect_error(b.delete(f"/v1/webhooks/{wid}"), 404, "not_found")
        # The admin sees both, or one key's.
        admin = d.client("admin")
        assert {e["owner"] for e in events(admin, owner=a.key_id)} == {a.key_id}
        assert admin.get(f"/v1/webhooks/{wid}").status_code == 200
        # b's stream shows b's sandbox only.
        s = Sse(b)
        try:
            a.create()
            mine = b.create()["id"]
            first = s.next()
            assert first["sandbox_id"] == mine and first["owner"] == b.key_id, first
        finally:
            s.close()
    finally:
        rx.close()
