"""Restarts: sandboxes outlive the daemon. After `kill -9` and a new daemon
on the same state and run directories, every sandbox still runs with its
files and processes; a create or delete interrupted by the kill ends up
running or terminated (and then leaves nothing on the host); and once
everything is deleted, nothing of any sandbox is left."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time

import requests

from conftest import (
    Client,
    Daemon,
    cgroup_dirs,
    expect_status,
    host_processes_of,
    leftovers,
    slot_owners,
    wait_cleaned,
    wait_for,
)


def fire(c: Client, method: str, path: str, body: dict | None = None) -> threading.Thread:
    """Sends a request in a thread and ignores its fate (the daemon dies under it)."""
    other = c.clone()

    def run():
        try:
            if body is None:
                other.request(method, path, timeout=15)
            else:
                other.post(path, body, timeout=15)
        except requests.RequestException:
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def check_settled(d: Daemon, api: Client, sid: str) -> str:
    """An interrupted sandbox is running (and works) or terminated (and gone)."""
    def settled():
        s = api.sandbox(sid)["state"]
        return s if s in ("running", "terminated") else None

    state = wait_for(f"sandbox {sid} to settle after the restart", settled, timeout=15, interval=0.1)
    if state == "running":
        assert api.sh(sid, "echo alive") == "alive\n"
    else:
        wait_cleaned(d, sid, timeout=10)
    return state


def make_kept(api: Client, n: int = 3) -> dict[str, tuple[int, int]]:
    """Sandboxes with a file and a background sleep each: id -> (index, pid)."""
    kept = {}
    for i in range(n):
        sid = api.create(ttl_seconds=1800)["id"]
        api.sh(sid, f"echo payload-{i} > /workspace/marker")
        kept[sid] = (i, api.background(sid, "sleep 300"))
    return kept


def check_kept(api: Client, kept: dict[str, tuple[int, int]]) -> None:
    for sid, (i, pid) in kept.items():
        sb = api.sandbox(sid)
        assert sb["state"] == "running", sb
        assert api.sh(sid, "cat /workspace/marker") == f"payload-{i}\n"
        assert api.exec(sid, f"kill -0 {pid}")["exit_code"] == 0, f"the sleep in {sid} died in the restart"
        assert any(p["pid"] == pid for p in api.processes(sid)), api.processes(sid)
        api.background(sid, "sleep 1")


def kill9_and_check_nothing_stays(d: Daemon, when: str) -> None:
    """kill -9 the daemon; no copy of it may stay behind holding its port,
    database and uid-slot locks (a new daemon could not even bind)."""
    d.kill9()
    strays = wait_for_no_strays(d)
    assert not strays, (
        f"after kill -9 of the daemon {when}, processes of the daemon binary stay alive "
        f"(forked helpers holding its listening socket, DB and uid-slot fds): {list(strays.values())}"
    )


def wait_for_no_strays(d: Daemon, timeout: float = 3.0) -> dict[int, str]:
    deadline = time.monotonic() + timeout
    while True:
        strays = d.strays()
        if not strays or time.monotonic() >= deadline:
            return strays
        time.sleep(0.1)


def final_cleanup_check(d: Daemon, api: Client) -> None:
    """Delete everything; nothing of any sandbox may stay on the host."""
    all_ids = d.db_sandbox_ids()
    for sb in api.list_all():
        if sb["state"] != "terminated":
            assert api.destroy(sb["id"])["state"] == "terminated"
    for sid in all_ids:
        wait_cleaned(d, sid, timeout=10)
    assert not list((d.run_dir / "sockets").iterdir()), list((d.run_dir / "sockets").iterdir())
    assert not slot_owners(d.run_dir), slot_owners(d.run_dir)
    assert not host_processes_of(all_ids), host_processes_of(all_ids)
    for sid in all_ids:
        assert not leftovers(d.run_dir, sid)


def test_sandboxes_survive_kill_9_of_the_daemon(own_daemon: Daemon):
    d = own_daemon
    d.start()
    api = d.client("admin")
    kept = make_kept(api)
    kill9_and_check_nothing_stays(d, "with 3 idle sandboxes")
    # The sandboxes run on without their daemon.
    for sid in kept:
        assert cgroup_dirs(sid), f"sandbox {sid} died with the daemon"
        assert host_processes_of([sid]), f"sandbox {sid} has no processes after the daemon died"
    d.start()
    check_kept(api, kept)
    # A second kill -9 and restart changes nothing.
    kill9_and_check_nothing_stays(d, "after a restart")
    d.start()
    check_kept(api, kept)
    final_cleanup_check(d, api)
    d.stop()


def test_a_create_interrupted_by_kill_9_ends_running_or_terminated(own_daemon: Daemon):
    d = own_daemon
    d.start()
    api = d.client("admin")
    kept = make_kept(api, 1)
    known = set(kept)
    outcomes = []
    # Kill points spread around the ~5 ms a create takes. Not a wait for
    # anything: every kill point, before, during or after the create, must
    # end in one of the outcomes checked, so a busy machine only moves the
    # points, never the verdict.
    for delay in (0.001, 0.002, 0.003, 0.005, 0.008):
        t = fire(api, "POST", "/v1/sandboxes", {"ttl_seconds": 1800})
        time.sleep(delay)
        kill9_and_check_nothing_stays(d, f"{delay * 1000:.0f} ms into a create")
        t.join(timeout=20)
        d.start()
        new = [s["id"] for s in api.list_all() if s["id"] not in known]
        assert len(new) <= 1, new
        for sid in new:
            outcomes.append((sid, check_settled(d, api, sid)))
            known.add(sid)
    check_kept(api, kept)
    print(f"interrupted creates: {outcomes}")
    final_cleanup_check(d, api)
    d.stop()


def test_a_delete_interrupted_by_kill_9_ends_running_or_terminated(own_daemon: Daemon):
    d = own_daemon
    d.start()
    api = d.client("admin")
    kept = make_kept(api, 4)
    victims, bystander = list(kept)[:3], list(kept)[3]
    outcomes = []
    # Kill points, not waits (see the create test above).
    for sid, delay in zip(victims, (0.0005, 0.002, 0.004)):
        t = fire(api, "DELETE", f"/v1/sandboxes/{sid}")
        time.sleep(delay)
        kill9_and_check_nothing_stays(d, f"{delay * 1000:.1f} ms into a delete")
        t.join(timeout=20)
        d.start()
        outcomes.append((sid, check_settled(d, api, sid)))
    check_kept(api, {bystander: kept[bystander]})
    print(f"interrupted deletes: {outcomes}")
    final_cleanup_check(d, api)
    d.stop()


def test_sigterm_stops_the_daemon_and_sandboxes_keep_running(own_daemon: Daemon):
    d = own_daemon
    d.start()
    api = d.client("admin")
    sid = api.create()["id"]
    pid = api.background(sid, "sleep 300")
    assert d.stop() == 0, d.log_tail()
    assert cgroup_dirs(sid) and host_processes_of([sid])
    d.start()
    assert api.sandbox(sid)["state"] == "running"
    assert api.exec(sid, f"kill -0 {pid}")["exit_code"] == 0
    api.destroy(sid)
    wait_cleaned(d, sid)


def test_a_sandbox_that_dies_while_the_daemon_is_down_is_terminated_and_cleaned(own_daemon: Daemon):
    d = own_daemon
    d.start()
    api = d.client("admin")
    sid = api.create()["id"]
    d.kill9()
    # Kill the sandbox behind the daemon's back.
    for pid in host_processes_of([sid]):
        try:
            import os
            import signal

            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for("the sandbox's processes to die", lambda: not host_processes_of([sid]), timeout=10)
    d.start()
    sb = wait_for("the dead sandbox to be terminated",
                  lambda: (lambda s: s if s["state"] == "terminated" else None)(api.sandbox(sid)), timeout=10)
    assert sb.get("last_error_code"), sb
    wait_cleaned(d, sid)


def test_sigterm_with_a_command_stream_open_exits_within_the_grace_period(own_daemon: Daemon):
    """An open NDJSON stream of a long command must not hold the daemon up
    forever after SIGTERM; the command itself goes on in its sandbox."""
    d = own_daemon
    d.start()
    api = d.client("admin")
    sid = api.create()["id"]
    # A raw connection that keeps reading, as a streaming client does.
    conn = socket.create_connection(("127.0.0.1", d.port), timeout=60)
    body = json.dumps({"command": "sleep 120"}).encode()
    conn.sendall(
        f"POST /v1/sandboxes/{sid}/exec HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {api.key}\r\n"
        f"Accept: application/x-ndjson\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    head = conn.recv(65536)
    assert b" 200 " in head.split(b"\r\n", 1)[0], head[:200]
    reader = threading.Thread(target=lambda: [None for _ in iter(lambda: conn.recv(65536), b"")], daemon=True)
    reader.start()
    os.kill(d.pid, signal.SIGTERM)
    # The daemon gives open requests a grace period, then exits anyway; a
    # daemon that waited for the stream would wait the command's 120 s out,
    # far beyond this bound on the wait.
    try:
        d.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"hutch serve still runs 60 s after SIGTERM; log:\n{d.log_tail()}") from None
    conn.close()
    # The sandbox and its command outlived the daemon; a new one adopts it.
    d.start()
    procs = api.get(f"/v1/sandboxes/{sid}/processes", timeout=10)
    assert procs.status_code == 200, procs.text
    assert any("sleep 120" in " ".join(p["command"]) for p in procs.json()["processes"]), procs.json()
    final_cleanup_check(d, api)
    d.stop()
