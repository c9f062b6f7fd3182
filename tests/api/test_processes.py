"""Running commands: list, signal, stdin, and reattach to their output."""

from __future__ import annotations

import json
import time

import pytest

from conftest import Client, expect_error, expect_status, ndjson_events, wait_for


def gone(api: Client, sid: str, pid: int) -> bool:
    return pid not in [p["pid"] for p in api.processes(sid)]


def test_processes_lists_running_commands(api: Client, sandbox: dict):
    sid = sandbox["id"]
    assert api.processes(sid) == []
    pid = api.background(sid, "sleep 300", cwd="/tmp")
    pid2 = api.background(sid, "sleep 301", user="root")
    procs = {p["pid"]: p for p in api.processes(sid)}
    assert set(procs) == {pid, pid2}, procs
    assert procs[pid]["cwd"] == "/tmp" and procs[pid]["user"] == "user"
    assert "sleep 300" in " ".join(procs[pid]["command"])
    assert procs[pid2]["user"] == "root"
    assert set(procs[pid]) == {"pid", "tag", "command", "user", "cwd"}


@pytest.mark.parametrize("sig", ["SIGTERM", 15, "TERM", "kill", 9])
def test_signal_ends_a_command(api: Client, sandbox: dict, sig):
    sid = sandbox["id"]
    pid = api.background(sid, "exec sleep 300")
    r = api.post(f"/v1/sandboxes/{sid}/processes/{pid}/signal", {"signal": sig})
    assert r.status_code == 204, r.text
    assert r.content == b""
    wait_for("the signalled command to end", lambda: gone(api, sid, pid), timeout=10)


def test_signal_refuses_unknown_signals_and_pids(api: Client, sandbox: dict):
    sid = sandbox["id"]
    pid = api.background(sid, "sleep 300")
    for bad in ("SIGBOGUS", 0, 65, None, [9]):
        expect_error(api.post(f"/v1/sandboxes/{sid}/processes/{pid}/signal", {"signal": bad}), 400, "invalid_request")
    expect_error(api.post(f"/v1/sandboxes/{sid}/processes/{pid}/signal", {}), 400, "invalid_request")
    expect_error(api.post(f"/v1/sandboxes/{sid}/processes/99999/signal", {"signal": "SIGTERM"}), 404, "not_found")
    # The refused signals did nothing.
    assert not gone(api, sid, pid)


def test_stdin_of_a_background_command(api: Client, sandbox: dict):
    sid = sandbox["id"]
    pid = api.background(sid, "cat > /workspace/in.txt")
    r = api.post(f"/v1/sandboxes/{sid}/processes/{pid}/stdin", {"data": "hello "})
    assert r.status_code == 204, r.text
    r = api.post(f"/v1/sandboxes/{sid}/processes/{pid}/stdin", {"data": "world\n", "eof": True})
    assert r.status_code == 204, r.text
    wait_for("cat to see EOF and exit", lambda: gone(api, sid, pid), timeout=10)
    assert api.sh(sid, "cat /workspace/in.txt") == "hello world\n"
    expect_error(api.post(f"/v1/sandboxes/{sid}/processes/{pid}/stdin", {"data": "late"}), 404, "not_found")
    expect_error(api.post(f"/v1/sandboxes/{sid}/processes/99999/stdin", {"data": "x"}), 404, "not_found")


def test_stream_replays_kept_output_then_live_output_then_exit(api: Client, sandbox: dict):
    sid = sandbox["id"]
    pid = api.background(sid, "echo one; echo err1 >&2; sleep 1.5; echo two; sleep 1; echo three; exit 4")
    time.sleep(0.7)  # "one" was printed while nobody was attached
    t0 = time.monotonic()
    r = api.get(f"/v1/sandboxes/{sid}/processes/{pid}/stream", stream=True, timeout=30)
    expect_status(r, 200)
    assert r.headers["Content-Type"].startswith("application/x-ndjson")
    events, arrivals = [], []
    for line in r.iter_lines(chunk_size=1):
        if line:
            events.append(json.loads(line))
            arrivals.append(time.monotonic() - t0)
    assert events[0]["type"] == "start" and events[0]["pid"] == pid, events
    assert events[-1]["type"] == "exit" and events[-1]["exit_code"] == 4, events
    # The command ran about 2.5 s; the exit event says how long.
    assert events[-1]["duration_ms"] >= 2000, events[-1]
    stdout = "".join(e["data"] for e in events if e["type"] == "stdout")
    stderr = "".join(e["data"] for e in events if e["type"] == "stderr")
    assert stdout == "one\ntwo\nthree\n", events
    assert stderr == "err1\n", events
    one = next(i for i, e in enumerate(events) if e.get("data", "").startswith("one"))
    assert arrivals[one] < 0.5, "the kept output was not replayed at once"


def test_stream_of_unknown_pid_is_404(api: Client, sandbox: dict):
    expect_error(api.get(f"/v1/sandboxes/{sandbox['id']}/processes/99999/stream"), 404, "not_found")


def test_process_routes_of_unknown_sandbox_are_404(api: Client):
    base = "/v1/sandboxes/sb-0000000000000000/processes"
    expect_error(api.get(base), 404, "not_found")
    expect_error(api.post(f"{base}/1/signal", {"signal": 9}), 404, "not_found")
    expect_error(api.post(f"{base}/1/stdin", {"data": "x"}), 404, "not_found")
    expect_error(api.get(f"{base}/1/stream"), 404, "not_found")
