"""/metrics (Prometheus text) and /v1/openapi.json."""

from __future__ import annotations

import re
import uuid

import requests

from conftest import Client, Daemon, expect_status, wait_for


def sample(text: str, name: str, labels: str = "") -> float:
    pat = "^" + re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" (\S+)$"
    m = re.search(pat, text, re.M)
    assert m, f"no sample {name}{{{labels}}} in metrics:\n{text[:3000]}"
    return float(m.group(1))


def test_metrics_count_sandboxes_commands_and_latencies(api: Client, sandbox: dict):
    sid = sandbox["id"]
    api.sh(sid, "true")
    pid = api.background(sid, "sleep 300")
    r = api.get("/metrics")
    expect_status(r, 200)
    assert r.headers["Content-Type"].startswith("text/plain")
    text = r.text
    assert sample(text, "hutch_sandboxes", 'state="running"') >= 1
    for st in ("starting", "suspended", "terminating", "terminated"):
        sample(text, "hutch_sandboxes", f'state="{st}"')
    assert sample(text, "hutch_sandbox_create_to_ready_seconds_count") >= 1
    assert sample(text, "hutch_sandbox_create_to_ready_seconds_sum") > 0
    assert sample(text, "hutch_sandbox_create_to_ready_seconds_bucket", 'le="+Inf"') >= 1
    assert sample(text, "hutch_exec_seconds_count") >= 1
    assert sample(text, "hutch_exec_seconds_bucket", 'le="+Inf"') == sample(text, "hutch_exec_seconds_count")
    assert sample(text, "hutch_commands_running") >= 1
    assert sample(text, "hutch_reconciler_lag_seconds") >= 0
    for line in text.splitlines():
        assert line.startswith("#") or re.match(r"^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[^}]*\})? \S+$", line), line
    api.post(f"/v1/sandboxes/{sid}/processes/{pid}/signal", {"signal": 9})


def test_openapi_document_is_openapi_3_1_and_names_the_routes(daemon: Daemon):
    r = Client(daemon.base, None).get("/v1/openapi.json")
    expect_status(r, 200)
    doc = r.json()
    assert doc["openapi"].startswith("3.1"), doc["openapi"]
    paths = doc["paths"]
    for p in ("/v1/sandboxes", "/v1/sandboxes/{id}", "/v1/sandboxes/{id}/exec", "/v1/sandboxes/{id}/extend",
              "/v1/sandboxes/{id}/suspend", "/v1/sandboxes/{id}/resume", "/v1/sandboxes/{id}/processes",
              "/v1/executions"):
        assert p in paths, f"{p} missing from the OpenAPI document"
    assert "bearer" in doc["components"]["securitySchemes"]


def test_unknown_routes_are_json_404(api: Client):
    r = api.get("/v1/nope")
    assert r.status_code == 404
    assert r.json()["code"] == "not_found"


def test_metrics_show_a_key_only_its_own_templates(daemon: Daemon, api: Client):
    """Per-template series (warm pool sizes) carry template names and ids:
    a key sees its own, the admin every owner's, and no key another's."""
    a, b = daemon.new_client("metrics-a"), daemon.new_client("metrics-b")
    name = f"secret-name-{uuid.uuid4().hex[:8]}"
    r = a.post("/v1/templates", {"name": name, "warm": {"min": 1, "max": 1}})
    expect_status(r, 201)
    tid = r.json()["id"]
    series = f'hutch_warm_pool_size{{template="{name}",template_id="{tid}"}}'

    def metrics(c: Client) -> str:
        r = c.get("/metrics")
        expect_status(r, 200)
        return r.text

    wait_for("A's warm pool in A's metrics", lambda: series + " 1" in metrics(a), timeout=60, interval=0.2)
    assert series in metrics(api)
    text = metrics(b)
    assert name not in text and tid not in text, text
    # B's aggregate figures are still there.
    sample(text, "hutch_warm_claims_total")
    sample(text, "hutch_sandboxes", 'state="running"')
    expect_status(a.delete(f"/v1/templates/{tid}"), 204)


def test_a_scrape_token_reads_metrics_and_nothing_else(own_daemon: Daemon):
    token = "scrape-" + uuid.uuid4().hex
    path = own_daemon.root / "metrics.token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    own_daemon.extra_env["HUTCH_METRICS_TOKEN_FILE"] = str(path)
    d = own_daemon.start()
    scrape = {"Authorization": f"Bearer {token}"}
    r = requests.get(d.base + "/metrics", headers=scrape, timeout=10)
    expect_status(r, 200)
    assert sample(r.text, "hutch_sandboxes", 'state="running"') >= 0
    # The token opens nothing else; no token or a wrong one opens nothing.
    for path_ in ("/v1/sandboxes", "/v1/keys", "/v1/usage"):
        r = requests.get(d.base + path_, headers=scrape, timeout=10)
        assert r.status_code == 401 and r.json()["code"] == "unauthorized", (path_, r.text)
    for headers in ({}, {"Authorization": f"Bearer {token}x"}, {"Authorization": f"Bearer {token[:-1]}"}):
        r = requests.get(d.base + "/metrics", headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["code"] == "unauthorized", (headers, r.text)
    # API keys still read their own view.
    expect_status(d.client().get("/metrics"), 200)


def test_ended_sandboxes_are_forgotten_after_the_retention(own_daemon: Daemon):
    """`--sandbox-retention`: an ended sandbox's record goes once it ended
    longer ago than that (at the daemon's start, then hourly); a live one
    stays, and the count of ended sandboxes follows. The usage totals do
    not forget what the pruned sandbox ran."""
    d = own_daemon
    d.start()
    api = d.client("admin")
    live = api.create()["id"]
    gone = api.create(idempotency_key="kept-a-while")["id"]
    api.sh(gone, "true")
    expect_status(api.delete(f"/v1/sandboxes/{gone}"), 200)
    assert api.sandbox(gone)["state"] == "terminated"
    text = api.get("/metrics").text
    assert sample(text, "hutch_sandboxes", 'state="terminated"') == 1
    key = next(k["id"] for k in api.get("/v1/keys").json()["keys"] if k["admin"])
    commands = sample(text, "hutch_usage_commands_total", f'key="{key}"')
    assert commands >= 1
    d.stop()
    d.extra_env["HUTCH_SANDBOX_RETENTION"] = "1ms"
    d.start()
    wait_for(
        f"the record of {gone} to be pruned",
        lambda: api.get(f"/v1/sandboxes/{gone}").status_code == 404,
        timeout=15,
        interval=0.1,
    )
    assert api.sandbox(live)["state"] == "running"
    text = api.get("/metrics").text
    assert sample(text, "hutch_sandboxes", 'state="terminated"') == 0
    assert sample(text, "hutch_sandboxes", 'state="running"') == 1
    assert sample(text, "hutch_usage_commands_total", f'key="{key}"') == commands
    # Its idempotency key is free again: a create with it makes a new one.
    again = api.create(idempotency_key="kept-a-while")["id"]
    assert again != gone
