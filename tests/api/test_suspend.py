"""Suspend and resume: a suspended sandbox refuses commands (and the refusal
is stored for its Idempotency-Key), and files and processes survive."""

from __future__ import annotations

import uuid
from pathlib import Path

from conftest import Client, expect_error, expect_status, frozen, host_processes_of, wait_for


def test_suspend_refuses_exec_and_resume_keeps_files_and_processes(api: Client, sandbox: dict):
    sid = sandbox["id"]
    api.sh(sid, "echo before > /workspace/kept.txt")
    pid = api.background(sid, "sleep 300")
    r = api.post(f"/v1/sandboxes/{sid}/suspend")
    expect_status(r, 200)
    assert r.json()["state"] == "suspended"
    assert api.sandbox(sid)["state"] == "suspended"
    # Suspending again is a no-op.
    expect_status(api.post(f"/v1/sandboxes/{sid}/suspend"), 200)
    expect_error(api.exec_raw(sid, {"command": "touch /workspace/while-suspended"}), 409,
                 "sandbox_session_not_running")
    r = api.post(f"/v1/sandboxes/{sid}/resume")
    expect_status(r, 200)
    assert r.json()["state"] == "running"
    expect_status(api.post(f"/v1/sandboxes/{sid}/resume"), 200)
    assert api.sh(sid, "cat /workspace/kept.txt") == "before\n"
    assert api.exec(sid, "test -e /workspace/while-suspended")["exit_code"] != 0
    assert api.exec(sid, f"kill -0 {pid}")["exit_code"] == 0, "the background sleep did not survive"
    assert any(p["pid"] == pid for p in api.processes(sid))


def test_a_suspended_sandbox_really_stops_its_processes(api: Client, sandbox: dict):
    sid = sandbox["id"]
    api.background(sid, "while true; do date +%s%N >> /workspace/ticks; sleep 0.05; done")
    ticks = lambda: int(api.sh(sid, "cat /workspace/ticks 2>/dev/null | wc -l"))  # noqa: E731
    wait_for("the loop to tick", lambda: ticks() >= 2)
    assert not frozen(sid)
    expect_status(api.post(f"/v1/sandboxes/{sid}/suspend"), 200)
    try:
        # The kernel's own word: every process of the sandbox is stopped, the
        # loop among them (no wait can show that better than the freezer).
        assert frozen(sid), "suspended, but the sandbox's cgroup is not frozen"
        loop = [pid for pid in host_processes_of([sid]) if b"while true" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert loop, "the loop is not among the sandbox's processes"
    finally:
        expect_status(api.post(f"/v1/sandboxes/{sid}/resume"), 200)
    assert not frozen(sid)
    n = ticks()
    wait_for("the loop to tick again after resume", lambda: ticks() > n)


def test_a_suspended_sandbox_refuses_streamed_exec_with_a_json_error(api: Client, sandbox: dict):
    sid = sandbox["id"]
    expect_status(api.post(f"/v1/sandboxes/{sid}/suspend"), 200)
    try:
        for _ in range(10):
            r = api.exec_raw(sid, {"command": "touch /workspace/streamed"}, headers={"Accept": "application/x-ndjson"})
            expect_error(r, 409, "sandbox_session_not_running")
    finally:
        expect_status(api.post(f"/v1/sandboxes/{sid}/resume"), 200)
    assert api.exec(sid, "test -e /workspace/streamed")["exit_code"] != 0


def test_a_refusal_while_suspended_is_replayed_for_its_key_after_resume(api: Client, sandbox: dict):
    sid = sandbox["id"]
    key = f"susp-{uuid.uuid4()}"
    body = {"command": "touch /workspace/refused-key"}
    expect_status(api.post(f"/v1/sandboxes/{sid}/suspend"), 200)
    expect_error(api.exec_raw(sid, body, key), 409, "sandbox_session_not_running")
    expect_status(api.post(f"/v1/sandboxes/{sid}/resume"), 200)
    expect_error(api.exec_raw(sid, body, key), 409, "sandbox_session_not_running")
    assert api.exec(sid, "test -e /workspace/refused-key")["exit_code"] != 0, "the refused command ran"
    # Another body with the same key is still a conflict.
    expect_error(api.exec_raw(sid, {"command": "true"}, key), 409, "idempotency_conflict")


def test_suspend_and_resume_of_unknown_or_terminated_sandboxes(api: Client):
    expect_error(api.post("/v1/sandboxes/sb-0000000000000000/suspend"), 404, "not_found")
    expect_error(api.post("/v1/sandboxes/sb-0000000000000000/resume"), 404, "not_found")
    sb = api.create()
    api.destroy(sb["id"])
    expect_error(api.post(f"/v1/sandboxes/{sb['id']}/suspend"), 409, "sandbox_session_not_running")
    expect_error(api.post(f"/v1/sandboxes/{sb['id']}/resume"), 409, "sandbox_session_not_running")


def test_a_suspended_sandbox_can_be_deleted(api: Client):
    sb = api.create()
    api.background(sb["id"], "sleep 300")
    expect_status(api.post(f"/v1/sandboxes/{sb['id']}/suspend"), 200)
    assert api.destroy(sb["id"])["state"] == "terminated"
