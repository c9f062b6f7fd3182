"""E2B's lifecycle webhooks (`/events/webhooks`), called as E2B's docs call
them (raw HTTP with `X-API-Key`), against a daemon of its own that lets
webhooks reach 127.0.0.1 over http: registered, listed, read, updated,
deleted; deliveries carry E2B's payload and an `e2b-signature` a receiver
verifies; a disabled webhook gets no more; another key sees none; the
SSRF rules refuse a target the operator does not allow. Sandboxes are
made and killed through the unmodified SDK."""

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from e2b import Sandbox

from conftest import E2bDaemon, wait_for

SECRET = "e2b-webhook-secret-for-the-tests"
TYPES = ["sandbox.lifecycle.created", "sandbox.lifecycle.killed",
         "sandbox.lifecycle.paused", "sandbox.lifecycle.resumed"]


class Receiver:
    """An HTTP receiver in a thread answering 204; keeps (headers, body)."""

    def __init__(self):
        self.got: list[tuple[dict, bytes]] = []
        self.lock = threading.Lock()
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with outer.lock:
                    outer.got.append(({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a):
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}/e2b"
        self.t = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.t.start()

    def events(self) -> list[dict]:
        """Each request's payload, its signature verified as E2B's docs say."""
        out = []
        with self.lock:
            got = list(self.got)
        for headers, body in got:
            want = base64.b64encode(hashlib.sha256(SECRET.encode() + body).digest()).decode().rstrip("=")
            assert headers.get("e2b-signature") == want, headers
            out.append(json.loads(body))
        return out

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture(scope="module")
def hooked():
    d = E2bDaemon(extra_env={"HUTCH_WEBHOOK_ALLOW_HTTP": "127.0.0.1/32"})
    try:
        yield d
    finally:
        try:
            d.kill_all()
        finally:
            d.stop()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def call(d, method, path, key=None, **kw):
    return requests.request(method, d.base + path, headers={"X-API-Key": key or d.key}, timeout=30, **kw)


def register(d, url, **extra):
    body = {"name": "my hook", "url": url, "enabled": True, "events": TYPES, "signatureSecret": SECRET, **extra}
    return call(d, "POST", "/events/webhooks", json=body)


def of_sandbox(r: Receiver, sid: str) -> list[dict]:
    return [e for e in r.events() if e["sandboxId"] == sid]


def test_lifecycle_events_arrive_signed_in_e2bs_shape(hooked, receiver):
    # No `events`: all five.
    body = {"name": "my hook", "url": receiver.url, "enabled": True, "signatureSecret": SECRET}
    r = call(hooked, "POST", "/events/webhooks", json=body)
    assert r.status_code == 201, r.text
    w = r.json()
    try:
        assert w["id"] and w["name"] == "my hook" and w["enabled"] is True and w["url"] == receiver.url
        assert w["teamID"] == w["teamId"] and w["teamId"] and w["createdAt"]
        assert sorted(w["events"]) == sorted(TYPES + ["sandbox.lifecycle.updated"])
        assert not any("secret" in k.lower() for k in w), w
        sb = Sandbox.create(timeout=120, **hooked.opts())
        sid = sb.sandbox_id
        wait_for("created", lambda: of_sandbox(receiver, sid), timeout=30, interval=0.1)
        sb.set_timeout(200)
        wait_for("updated", lambda: "sandbox.lifecycle.updated" in [e["type"] for e in of_sandbox(receiver, sid)],
                 timeout=30, interval=0.1)
        sb.pause()
        wait_for("paused", lambda: "sandbox.lifecycle.paused" in [e["type"] for e in of_sandbox(receiver, sid)],
                 timeout=60, interval=0.1)
        sb = Sandbox.connect(sid, **hooked.opts())
        wait_for("resumed", lambda: "sandbox.lifecycle.resumed" in [e["type"] for e in of_sandbox(receiver, sid)],
                 timeout=60, interval=0.1)
        sb.kill()
        wait_for("killed", lambda: "sandbox.lifecycle.killed" in [e["type"] for e in of_sandbox(receiver, sid)],
                 timeout=30, interval=0.1)
        evs = of_sandbox(receiver, sid)
        assert [e["type"] for e in evs] == [
            "sandbox.lifecycle.created", "sandbox.lifecycle.updated", "sandbox.lifecycle.paused",
            "sandbox.lifecycle.resumed", "sandbox.lifecycle.killed"], evs
        assert evs[1]["eventData"]["expires_at"], evs[1]
        for e in evs:
            assert set(e) >= {"version", "id", "type", "eventData", "sandboxBuildId", "sandboxExecutionId",
                              "sandboxId", "sandboxTeamId", "sandboxTemplateId", "timestamp"}, e
            assert e["version"] == "v2" and isinstance(e["id"], str) and e["id"]
            assert e["sandboxTeamId"] == w["teamId"] and e["timestamp"].endswith("Z")
        assert evs[0]["sandboxTemplateId"], evs[0]
        assert len({e["id"] for e in evs}) == len(evs)
    finally:
        call(hooked, "DELETE", f"/events/webhooks/{w['id']}")


def test_list_get_patch_delete_and_a_disabled_one_gets_nothing(hooked, receiver):
    w = register(hooked, receiver.url, events=["sandbox.lifecycle.created"]).json()
    wid = w["id"]
    try:
        assert wid in [x["id"] for x in call(hooked, "GET", "/events/webhooks").json()]
        got = call(hooked, "GET", f"/events/webhooks/{wid}")
        assert got.status_code == 200 and got.json()["events"] == ["sandbox.lifecycle.created"]
        # Another key sees none of it, and cannot touch it.
        other = hooked.make_key("e2b-hooks-other")
        assert call(hooked, "GET", "/events/webhooks", key=other).json() == []
        for m in ("GET", "DELETE"):
            assert call(hooked, m, f"/events/webhooks/{wid}", key=other).status_code == 404
        assert call(hooked, "PATCH", f"/events/webhooks/{wid}", key=other, json={"enabled": False}).status_code == 404
        # Disabled: a new sandbox is not announced.
        p = call(hooked, "PATCH", f"/events/webhooks/{wid}",
                 json={"enabled": False, "events": ["sandbox.lifecycle.created", "sandbox.lifecycle.killed"]})
        assert p.status_code == 200, p.text
        assert p.json()["enabled"] is False and p.json()["url"] == receiver.url
        assert sorted(p.json()["events"]) == ["sandbox.lifecycle.created", "sandbox.lifecycle.killed"]
        # A second, enabled webhook to the same receiver shows when the
        # events have been delivered (one worker, in order).
        marker = register(hooked, receiver.url + "?marker", events=["sandbox.lifecycle.killed"]).json()
        try:
            sb = Sandbox.create(timeout=60, **hooked.opts())
            sb.kill()
            wait_for("the marker", lambda: of_sandbox(receiver, sb.sandbox_id), timeout=30, interval=0.1)
            # Only the marker's: the disabled webhook was given no delivery.
            assert [e["type"] for e in of_sandbox(receiver, sb.sandbox_id)] == ["sandbox.lifecycle.killed"]
        finally:
            call(hooked, "DELETE", f"/events/webhooks/{marker['id']}")
        assert call(hooked, "DELETE", f"/events/webhooks/{wid}").status_code == 204
        assert call(hooked, "GET", f"/events/webhooks/{wid}").status_code == 404
        assert call(hooked, "DELETE", f"/events/webhooks/{wid}").status_code == 404
    finally:
        call(hooked, "DELETE", f"/events/webhooks/{wid}")


def test_bad_webhooks_are_refused(hooked):
    # Loopback outside the allowed range, and metadata: refused (SSRF rules).
    for url in ("http://127.0.0.2:9/x", "https://127.0.0.2/x", "http://169.254.169.254/latest"):
        r = register(hooked, url)
        assert r.status_code == 400, (url, r.status_code, r.text)
    assert register(hooked, "http://127.0.0.1:9/x", events=["sandbox.created"]).status_code == 400
    assert register(hooked, "http://127.0.0.1:9/x", signatureSecret=None).status_code == 400
    assert call(hooked, "GET", "/events/webhooks").json() == []
    assert requests.get(hooked.base + "/events/webhooks", timeout=10).status_code == 401
