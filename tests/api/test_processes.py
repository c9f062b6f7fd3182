"""Running commands: list, signal, stdin, and reattach to their output."""

from __future__ import annotations


import pytest

from conftest import Client, EventStream, expect_error, expect_status, ndjson_events, stdout_of, wait_for


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
    assert set(procs[pid]) == {"pid", "tag", "command", "user", "cwd", "main_exited", "exit_code"}
    assert procs[pid]["main_exited"] is False and procs[pid]["exit_code"] is None


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
    # The command prints, marks that it did, and waits for the test to let it
    # go on: "one" is printed while nobody is attached, and "two" only after
    # the attach.
    pid = api.background(
        sid,
        "echo one; echo err1 >&2; touch /tmp/printed; "
        "while [ ! -e /tmp/go ]; do sleep 0.01; done; echo two; sleep 1; echo three; exit 4",
    )
    wait_for("the command's first lines", lambda: api.exec(sid, "test -e /tmp/printed")["exit_code"] == 0)
    r = api.get(f"/v1/sandboxes/{sid}/processes/{pid}/stream", stream=True, timeout=30)
    expect_status(r, 200)
    assert r.headers["Content-Type"].startswith("application/x-ndjson")
    stream = EventStream(r)
    # The kept output is replayed while the command still waits: it cannot
    # have printed anything more yet.
    events = stream.until("the kept output", lambda ev: stdout_of(ev) == "one\n")
    assert events[0]["type"] == "start" and events[0]["pid"] == pid, events
    assert not gone(api, sid, pid), "the command ended before the test let it go on"
    api.sh(sid, "touch /tmp/go")
    events = stream.rest()
    assert events[-1]["type"] == "exit" and events[-1]["exit_code"] == 4, events
    # The exit event says how long the command ran: at least its `sleep 1`.
    assert events[-1]["duration_ms"] >= 1000, events[-1]
    stdout = "".join(e["data"] for e in events if e["type"] == "stdout")
    stderr = "".join(e["data"] for e in events if e["type"] == "stderr")
    assert stdout == "one\ntwo\nthree\n", events
    assert stderr == "err1\n", events


def test_stream_of_unknown_pid_is_404(api: Client, sandbox: dict):
    expect_error(api.get(f"/v1/sandboxes/{sandbox['id']}/processes/99999/stream"), 404, "not_found")


def test_process_routes_of_unknown_sandbox_are_404(api: Client):
    base = "/v1/sandboxes/sb-0000000000000000/processes"
    expect_error(api.get(base), 404, "not_found")
    expect_error(api.post(f"{base}/1/signal", {"signal": 9}), 404, "not_found")
    expect_error(api.post(f"{base}/1/stdin", {"data": "x"}), 404, "not_found")
    expect_error(api.get(f"{base}/1/stream"), 404, "not_found")


# ---------------------------------------------------------------- background children (issue 10, finding 9)


def running_cmdlines(api: Client, sid: str) -> str:
    """Every command line in the sandbox, one a line (read as root from /proc)."""
    return api.sh(sid, "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done 2>/dev/null",
                  user="root")


def test_a_command_that_leaves_children_is_listed_until_they_end_and_a_signal_reaches_them(
        api: Client, sandbox: dict):
    sid = sandbox["id"]
    res = api.exec(sid, "sleep 1001 & setsid sleep 1002 & echo started")
    assert res["exit_code"] == 0 and res["stdout"] == "started\n", res
    assert res["descendants_alive"] is True, res
    procs = {p["pid"]: p for p in api.processes(sid)}
    assert len(procs) == 1, procs
    (pid, p), = procs.items()
    assert p["main_exited"] is True and p["exit_code"] == 0, p
    assert "sleep 1001" in running_cmdlines(api, sid)
    r = api.post(f"/v1/sandboxes/{sid}/processes/{pid}/signal", {"signal": "SIGTERM"})
    assert r.status_code == 204, r.text
    wait_for("the command's children to end", lambda: gone(api, sid, pid), timeout=10)
    left = running_cmdlines(api, sid)
    assert "sleep 1001" not in left and "sleep 1002" not in left, left
    # A reattach to it now knows nothing of it.
    expect_error(api.get(f"/v1/sandboxes/{sid}/processes/{pid}/stream"), 404, "not_found")


def test_a_command_without_children_left_says_so(api: Client, sandbox: dict):
    res = api.exec(sandbox["id"], "sleep 0.1 & wait; echo done")
    assert res["stdout"] == "done\n" and res["descendants_alive"] is False, res
    assert api.processes(sandbox["id"]) == []


def test_the_timeout_ends_background_children_too(api: Client, sandbox: dict):
    sid = sandbox["id"]
    res = api.exec(sid, "sleep 1003 & setsid sleep 1004 & true", timeout_seconds=2)
    assert res["exit_code"] == 0 and res["timed_out"] is False and res["descendants_alive"] is True, res
    (p,) = api.processes(sid)
    assert p["main_exited"] is True, p
    wait_for("the timeout to end the command's tree", lambda: api.processes(sid) == [], timeout=20, interval=0.2)
    left = running_cmdlines(api, sid)
    assert "sleep 1003" not in left and "sleep 1004" not in left, left


def test_reattach_to_a_command_whose_children_live_gets_its_exit(api: Client, sandbox: dict):
    sid = sandbox["id"]
    pid = api.background(sid, "sleep 1005 & exit 3")
    wait_for("the main process to exit", lambda: [p for p in api.processes(sid) if p["main_exited"]], timeout=10)
    r = api.get(f"/v1/sandboxes/{sid}/processes/{pid}/stream", stream=True, timeout=30)
    expect_status(r, 200)
    events = ndjson_events(r)
    assert events[0] == {"type": "start", "pid": pid}, events
    assert events[-1]["type"] == "exit" and events[-1]["exit_code"] == 3, events
    assert events[-1]["descendants_alive"] is True, events
    expect_error(api.post(f"/v1/sandboxes/{sid}/processes/{pid}/stdin", {"data": "x"}), 404, "not_found")
    r = api.post(f"/v1/sandboxes/{sid}/processes/{pid}/signal", {"signal": "KILL"})
    assert r.status_code == 204, r.text
    wait_for("the tree to end", lambda: gone(api, sid, pid), timeout=10)


def test_what_holds_a_command_slot_is_listed_and_can_be_freed(api: Client):
    """64 commands that each leave a child behind hold all slots: the 65th is
    refused, and /processes shows all 64, which a signal frees."""
    sb = api.create(limits={"pids": 1024})
    sid = sb["id"]
    try:
        for i in range(64):
            res = api.exec(sid, f"sleep {2000 + i} &")
            assert res["exit_code"] == 0 and res["descendants_alive"] is True, res
        expect_error(api.exec_raw(sid, {"command": "true"}), 429, "sandbox_command_capacity")
        procs = api.processes(sid)
        assert len(procs) == 64 and all(p["main_exited"] for p in procs), procs
        for p in procs:
            r = api.post(f"/v1/sandboxes/{sid}/processes/{p['pid']}/signal", {"signal": 9})
            assert r.status_code == 204, r.text
        wait_for("the slots to be free", lambda: api.processes(sid) == [], timeout=20, interval=0.2)
        assert api.sh(sid, "echo free") == "free\n"
    finally:
        api.destroy(sid)
