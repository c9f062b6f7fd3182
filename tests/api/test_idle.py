"""Idle timeouts that count work: a sandbox with `idle_timeout_seconds`
pauses (or ends, `on_idle: "delete"`) after that long with no API use and
no command running; a background command counts as running until it
exits; `GET` shows `idle_since` (null while a command runs) and is not use
itself."""

from __future__ import annotations

import pytest

from conftest import Client, Daemon, expect_error, expect_status, wait_for


def idle_state(sb: dict) -> str:
    """What `on_idle: "pause"` makes of it: paused to disk, or suspended in memory."""
    return "paused" if sb["storage"] == "disk" else "suspended"


def resume_after_pause(api: Client, daemon: Daemon, sid: str) -> None:
    """Resumes a sandbox the sweeper paused, as soon as it shows `paused`:
    the record says so before the pause's teardown (processes, network
    lease) ends, and the resume waits for that teardown
    (regression: a quick resume failed with sandbox_network_unavailable)."""
    r = api.post(f"/v1/sandboxes/{sid}/resume")
    expect_status(r, 200)
    assert r.json()["state"] == "running", r.json()


def test_an_idle_sandbox_is_paused_and_shows_idle_since(api: Client, daemon: Daemon):
    sb = api.create(idle_timeout_seconds=2)
    sid = sb["id"]
    try:
        assert sb["idle_timeout_seconds"] == 2 and sb["on_idle"] == "pause", sb
        got = api.sandbox(sid)
        assert got["idle_since"] is not None, got
        listed = [s for s in api.list_all() if s["id"] == sid]
        assert listed and listed[0]["idle_timeout_seconds"] == 2, listed
        final = wait_for("the idle sandbox's pause",
                         lambda: (s := api.sandbox(sid))["state"] != "running" and s, timeout=30)
        assert final["state"] == idle_state(sb), final
        assert final["idle_since"] is None
        # A resume wakes it; it runs until idle again.
        resume_after_pause(api, daemon, sid)
        assert api.sh(sid, "echo back") == "back\n"
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def test_a_running_background_command_keeps_it_until_it_exits(api: Client, daemon: Daemon):
    busy = api.create(idle_timeout_seconds=1)
    sid = busy["id"]
    try:
        api.background(sid, "sleep 5; touch /workspace/done")
        assert api.sandbox(sid)["idle_since"] is None
        # Only GETs from here: no use. It stays running while the command runs,
        # then goes idle, then is paused.
        final = wait_for("the pause after the command's exit",
                         lambda: (s := api.sandbox(sid))["state"] != "running" and s, timeout=60)
        assert final["state"] == idle_state(busy), final
        resume_after_pause(api, daemon, sid)
        # The command had finished before the pause: its file is there.
        assert api.exec(sid, "test -e /workspace/done")["exit_code"] == 0
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def test_on_idle_delete_ends_it(api: Client):
    sb = api.create(idle_timeout_seconds=1, on_idle="delete")
    sid = sb["id"]
    final = wait_for("the idle sandbox's end",
                     lambda: (s := api.sandbox(sid))["state"] in ("terminating", "terminated") and s, timeout=30)
    assert final.get("last_error_code") in (None, "sandbox_idle"), final


def test_use_through_the_api_keeps_it_running(api: Client):
    sb = api.create(idle_timeout_seconds=3)
    sid = sb["id"]
    try:
        # Commands more often than the timeout: never paused meanwhile.
        for _ in range(8):
            assert api.sh(sid, "sleep 1; echo ok") == "ok\n"
        assert api.sandbox(sid)["state"] == "running"
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


@pytest.mark.parametrize("body", [
    {"idle_timeout_seconds": 0},
    {"idle_timeout_seconds": 604801},
    {"on_idle": "delete"},
    {"idle_timeout_seconds": 60, "on_idle": "sleep"},
])
def test_idle_requests_are_validated(api: Client, body: dict):
    expect_error(api.post("/v1/sandboxes", {"ttl_seconds": 60, **body}), 400, "invalid_request")


def test_the_idle_timeout_comes_from_the_template_unless_the_create_says(api: Client):
    import uuid
    name = f"idle-{uuid.uuid4().hex[:8]}"
    r = api.post("/v1/templates", {"name": name, "idle_timeout_seconds": 1, "on_idle": "delete"})
    expect_status(r, 201)
    tpl = r.json()
    assert tpl["idle_timeout_seconds"] == 1 and tpl["on_idle"] == "delete", tpl
    try:
        # The create's own timeout replaces the template's: kept.
        kept = api.create(template=name, idle_timeout_seconds=3600)
        assert (kept["idle_timeout_seconds"], kept["on_idle"]) == (3600, "delete"), kept
        sb = api.create(template=name)
        sid = sb["id"]
        assert (sb["idle_timeout_seconds"], sb["on_idle"]) == (1, "delete"), sb
        wait_for("the template's idle delete",
                 lambda: api.sandbox(sid)["state"] in ("terminating", "terminated"), timeout=30)
        assert api.sandbox(kept["id"])["state"] == "running"
        api.delete(f"/v1/sandboxes/{kept['id']}")
        expect_error(api.request("PATCH", f"/v1/templates/{tpl['id']}", json={"idle_timeout_seconds": 0}), 400,
                     "invalid_request")
        r = api.request("PATCH", f"/v1/templates/{tpl['id']}", json={"on_idle": "pause"})
        expect_status(r, 200)
        assert r.json()["on_idle"] == "pause"
    finally:
        expect_status(api.delete(f"/v1/templates/{tpl['id']}"), (204, 404))
