"""Commands: foreground JSON results, NDJSON streams, background, output caps,
timeouts, the Idempotency-Key journal, the 64 command slots, and one-shot
executions."""

from __future__ import annotations

import hashlib
import os
import subprocess
import threading
import time
import uuid

import pytest
import requests

from conftest import (
    GVISOR_NO_WORK_CGROUP,
    GVISOR_STATX,
    on_class,
    Client,
    Daemon,
    EventStream,
    expect_error,
    expect_status,
    ndjson_events,
    stdout_of,
    wait_cleaned,
    wait_for,
)

OUTPUT_CAP = 1 << 20
COMMAND_SLOTS = 64


def test_exec_runs_a_shell_command_with_its_result(api: Client, sandbox: dict):
    t0 = time.monotonic()
    res = api.exec(sandbox["id"], "echo out; echo err >&2; exit 7")
    waited_ms = (time.monotonic() - t0) * 1000
    assert res["stdout"] == "out\n"
    assert res["stderr"] == "err\n"
    assert res["exit_code"] == 7
    assert res["stdout_truncated"] is False and res["stderr_truncated"] is False
    assert res["timed_out"] is False
    assert res["output_kept"] is True
    # The command's own run, inside the request the client waited for.
    assert isinstance(res["duration_ms"], int) and 0 <= res["duration_ms"] <= waited_ms + 1, (res, waited_ms)


def test_exec_runs_argv_without_a_shell(api: Client, sandbox: dict):
    res = api.exec(sandbox["id"], argv=["printf", "%s|", "a b", "$HOME", "*"])
    assert res == {**res, "stdout": "a b|$HOME|*|", "exit_code": 0}


def test_exec_defaults_to_the_user_in_workspace(api: Client, sandbox: dict):
    assert api.sh(sandbox["id"], "id -u; id -g; pwd") == "1000\n1000\n/workspace\n"


def test_exec_as_root(api: Client, sandbox: dict):
    assert api.sh(sandbox["id"], "id -u", user="root") == "0\n"


def test_exec_with_env_and_cwd(api: Client, sandbox: dict):
    sid = sandbox["id"]
    api.sh(sid, "mkdir -p /workspace/sub/dir")
    out = api.sh(sid, 'echo "$FOO:$BAR"; pwd', env={"FOO": "x y", "BAR": "1"}, cwd="sub/dir")
    assert out == "x y:1\n/workspace/sub/dir\n"
    assert api.sh(sid, "pwd", cwd="/tmp") == "/tmp\n"


def test_exec_feeds_stdin_then_closes_it(api: Client, sandbox: dict):
    res = api.exec(sandbox["id"], "wc -c; cat", stdin="")
    assert res["exit_code"] == 0 and res["stdout"].startswith("0\n"), res
    res = api.exec(sandbox["id"], "tr a-z A-Z", stdin="hello\nworld\n")
    assert res["stdout"] == "HELLO\nWORLD\n", res


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"command": "true", "argv": ["true"]},
        {"command": ""},
        {"argv": []},
        {"command": "true", "timeout_seconds": 0},
        {"command": "true", "timeout_seconds": 86401},
        {"command": "true", "bogus": 1},
        {"command": "true", "cwd": "../etc"},
        {"command": "true", "user": "no body"},
        {"command": "true", "env": {"A=B": "1"}},
    ],
    ids=["empty", "both", "empty-command", "empty-argv", "timeout-0", "timeout-big", "unknown-field",
         "cwd-dotdot", "user-space", "env-equals"],
)
def test_exec_refuses_invalid_bodies(api: Client, sandbox: dict, body: dict):
    expect_error(api.exec_raw(sandbox["id"], body), 400, "invalid_request")


def test_exec_as_an_unknown_user_is_refused(api: Client, sandbox: dict):
    r = api.exec_raw(sandbox["id"], {"command": "true", "user": "nosuchuser"})
    expect_error(r, 400, "invalid_request")


def test_exec_in_an_unknown_sandbox_is_404(api: Client):
    expect_error(api.exec_raw("sb-0000000000000000", {"command": "true"}), 404, "not_found")


def test_exec_output_is_capped_at_1_mib_per_stream(api: Client, sandbox: dict):
    res = api.exec(
        sandbox["id"],
        "head -c 1500000 /dev/zero | tr '\\0' a; head -c 1200000 /dev/zero | tr '\\0' b >&2",
        timeout_seconds=60,
    )
    assert res["exit_code"] == 0
    assert len(res["stdout"]) == OUTPUT_CAP and set(res["stdout"]) == {"a"}
    assert len(res["stderr"]) == OUTPUT_CAP and set(res["stderr"]) == {"b"}
    assert res["stdout_truncated"] is True and res["stderr_truncated"] is True
    # Exactly at the cap is not truncated.
    res = api.exec(sandbox["id"], f"head -c {OUTPUT_CAP} /dev/zero | tr '\\0' c")
    assert len(res["stdout"]) == OUTPUT_CAP and res["stdout_truncated"] is False


def test_exec_timeout_kills_the_command(api: Client, sandbox: dict):
    res = api.exec(sandbox["id"], "echo started; sleep 60; echo never", timeout_seconds=1)
    assert res["timed_out"] is True, res
    assert res["exit_code"] != 0
    # Killed in its sleep: it never got to its last line.
    assert res["stdout"] == "started\n"
    # Its process tree is gone.
    procs = api.processes(sandbox["id"])
    assert not any("sleep 60" in " ".join(p["command"]) for p in procs), procs


def test_exec_ndjson_streams_events_as_they_are_produced(api: Client, sandbox: dict):
    # The command waits after its first line until the test lets it go on,
    # so "first" can only reach the client early if it was sent as produced.
    body = {"command": "echo first; while [ ! -e /tmp/go ]; do sleep 0.01; done; "
                       "echo second >&2; sleep 1; echo third; exit 5"}
    r = api.exec_raw(sandbox["id"], body, headers={"Accept": "application/x-ndjson"}, stream=True)
    expect_status(r, 200)
    assert r.headers["Content-Type"].startswith("application/x-ndjson")
    stream = EventStream(r)
    events = stream.until("the first line", lambda ev: stdout_of(ev) == "first\n")
    assert events[0]["type"] == "start" and isinstance(events[0]["pid"], int), events
    assert {e["type"] for e in events[1:]} == {"stdout"}, f"more than the first line before the go: {events}"
    api.sh(sandbox["id"], "touch /tmp/go")
    events = stream.rest()
    assert events[-1] == {**events[-1], "type": "exit", "exit_code": 5, "timed_out": False}, events
    # At least the command's `sleep 1`.
    assert events[-1]["duration_ms"] >= 1000
    out = [e for e in events if e["type"] in ("stdout", "stderr")]
    assert "".join(e["data"] for e in out if e["type"] == "stdout") == "first\nthird\n"
    assert "".join(e["data"] for e in out if e["type"] == "stderr") == "second\n"


def test_exec_ndjson_refusals_are_plain_json_errors(api: Client, sandbox: dict):
    # Repeated: a refusal must never turn into an empty 200 stream.
    for _ in range(10):
        r = api.exec_raw(sandbox["id"], {"command": ""}, headers={"Accept": "application/x-ndjson"})
        expect_error(r, 400, "invalid_request")
        r = api.exec_raw("sb-0000000000000000", {"command": "true"}, headers={"Accept": "application/x-ndjson"})
        expect_error(r, 404, "not_found")


def test_exec_background_answers_at_once_with_a_pid(api: Client, sandbox: dict):
    sid = sandbox["id"]
    # The command cannot finish before the test lets it: an answer means the
    # request did not wait for it.
    pid = api.background(sid, "while [ ! -e /workspace/go ]; do sleep 0.01; done; echo done > /workspace/bg.txt")
    procs = api.processes(sid)
    assert any(p["pid"] == pid for p in procs), procs
    assert api.exec(sid, "cat /workspace/bg.txt")["exit_code"] != 0
    api.sh(sid, "touch /workspace/go")
    wait_for("the background command to finish", lambda: pid not in [p["pid"] for p in api.processes(sid)],
             timeout=15, interval=0.25)
    assert api.sh(sid, "cat /workspace/bg.txt") == "done\n"


# ---------------------------------------------------------------- idempotency


def test_exec_with_the_same_key_replays_without_running_again(api: Client, sandbox: dict):
    sid = sandbox["id"]
    key = f"exec-{uuid.uuid4()}"
    body = {"command": "echo run >> /workspace/runs.log; echo $RANDOM$RANDOM"}
    r1 = api.exec_raw(sid, body, key)
    expect_status(r1, 200)
    r2 = api.exec_raw(sid, body, key)
    expect_status(r2, 200)
    assert r2.json() == r1.json()
    # And as a stream (repeatedly): the stored result as events, not a new run.
    for _ in range(10):
        r3 = api.exec_raw(sid, body, key, headers={"Accept": "application/x-ndjson"})
        expect_status(r3, 200)
        events = ndjson_events(r3)
        assert events, "a replayed stream answered 200 with no events"
        assert "".join(e["data"] for e in events if e["type"] == "stdout") == r1.json()["stdout"], events
        assert events[-1]["type"] == "exit" and events[-1]["exit_code"] == 0, events
    assert api.sh(sid, "cat /workspace/runs.log") == "run\n", "the command ran more than once"


def test_exec_with_the_same_key_and_another_body_is_a_conflict(api: Client, sandbox: dict):
    sid = sandbox["id"]
    key = f"exec-{uuid.uuid4()}"
    expect_status(api.exec_raw(sid, {"command": "echo a >> /workspace/conflict.log"}, key), 200)
    r = api.exec_raw(sid, {"command": "echo b >> /workspace/conflict.log"}, key)
    expect_error(r, 409, "idempotency_conflict")
    assert api.sh(sid, "cat /workspace/conflict.log") == "a\n"


def test_exec_key_of_a_running_command_is_refused_as_outcome_unknown(api: Client, sandbox: dict):
    sid = sandbox["id"]
    key = f"exec-{uuid.uuid4()}"
    body = {"command": "echo x >> /workspace/slow.log; sleep 3; echo finished"}
    result: dict = {}
    other = api.clone()

    def first():
        result["r"] = other.exec_raw(sid, body, key, timeout=30)

    t = threading.Thread(target=first)
    t.start()
    try:
        wait_for("the first run to start", lambda: api.exec(sid, "cat /workspace/slow.log 2>/dev/null")["stdout"],
                 timeout=10)
        r = api.exec_raw(sid, body, key)
        expect_error(r, 409, "execution_outcome_unknown")
    finally:
        t.join(timeout=30)
    assert not t.is_alive()
    expect_status(result["r"], 200)
    assert result["r"].json()["stdout"] == "finished\n"
    # Once finished, the key replays the stored result.
    r = api.exec_raw(sid, body, key)
    expect_status(r, 200)
    assert r.json() == result["r"].json()
    assert api.sh(sid, "cat /workspace/slow.log") == "x\n"


def test_exec_keep_output_false_returns_output_once(api: Client, sandbox: dict):
    sid = sandbox["id"]
    key = f"exec-{uuid.uuid4()}"
    body = {"command": "echo secret; echo oops >&2; exit 3", "keep_output": False}
    r1 = api.exec_raw(sid, body, key)
    expect_status(r1, 200)
    first = r1.json()
    assert first["stdout"] == "secret\n" and first["stderr"] == "oops\n" and first["exit_code"] == 3
    r2 = api.exec_raw(sid, body, key)
    expect_status(r2, 200)
    replay = r2.json()
    assert replay["exit_code"] == 3
    assert replay["stdout"] == "" and replay["stderr"] == ""
    assert replay["output_kept"] is False


def test_idempotency_keys_are_scoped_to_their_sandbox(api: Client):
    a, b = api.create(), api.create()
    try:
        key = f"exec-{uuid.uuid4()}"
        body = {"command": "echo $RANDOM$RANDOM$RANDOM > /workspace/r; cat /workspace/r"}
        ra = api.exec_raw(a["id"], body, key)
        rb = api.exec_raw(b["id"], body, key)
        expect_status(ra, 200)
        expect_status(rb, 200)
        assert api.sh(b["id"], "cat /workspace/r") == rb.json()["stdout"], "the command did not run in b"
    finally:
        api.destroy(a["id"])
        api.destroy(b["id"])


def test_idempotency_key_must_be_1_to_256_characters(api: Client, sandbox: dict):
    r = api.exec_raw(sandbox["id"], {"command": "true"}, headers={"Idempotency-Key": "k" * 257})
    expect_error(r, 400, "invalid_request")


# ---------------------------------------------------------------- command slots


@on_class("gvisor", reason=GVISOR_STATX)
def test_the_65th_command_is_refused_and_runs_nothing(api: Client):
    sb = api.create(limits={"pids": 1024})
    sid = sb["id"]
    try:
        # Long enough to outlive 64 starts in the slowest class (gvisor: ~0.3 s each).
        pids = [api.background(sid, "sleep 300") for _ in range(COMMAND_SLOTS)]
        assert len(set(pids)) == COMMAND_SLOTS
        r = api.exec_raw(sid, {"command": "touch /workspace/sixty-fifth"})
        expect_error(r, 429, "sandbox_command_capacity")
        r = api.exec_raw(sid, {"command": "touch /workspace/sixty-fifth-bg", "background": True})
        expect_error(r, 429, "sandbox_command_capacity")
        key = f"cap-{uuid.uuid4()}"
        r = api.exec_raw(sid, {"command": "touch /workspace/sixty-fifth-key"}, key)
        expect_error(r, 429, "sandbox_command_capacity")
        # Free the slots, then look: nothing ran.
        for pid in pids:
            r = api.post(f"/v1/sandboxes/{sid}/processes/{pid}/signal", {"signal": "SIGKILL"})
            assert r.status_code in (204, 404), r.text
        wait_for(
            "a free command slot",
            lambda: api.exec_raw(sid, {"command": "true"}).status_code == 200,
            timeout=15,
            interval=0.2,
        )
        out = api.sh(sid, "ls /workspace")
        assert "sixty-fifth" not in out, f"a refused command ran: {out!r}"
        # A refusal for capacity frees the key: it runs now.
        r = api.exec_raw(sid, {"command": "touch /workspace/sixty-fifth-key"}, key)
        expect_status(r, 200)
        assert api.sh(sid, "ls /workspace") == "sixty-fifth-key\n"
    finally:
        api.destroy(sid)


@on_class("gvisor", reason=GVISOR_STATX)
def test_foreground_commands_hold_slots_too(api: Client):
    sb = api.create(limits={"pids": 1024})
    sid = sb["id"]
    try:
        for _ in range(COMMAND_SLOTS - 1):
            api.background(sid, "sleep 300")
        holder: dict = {}
        other = api.clone()

        def hold():
            holder["r"] = other.exec_raw(sid, {"command": "sleep 3"}, timeout=30)

        t = threading.Thread(target=hold)
        t.start()
        try:
            wait_for("the foreground command to start", lambda: len(api.processes(sid)) == COMMAND_SLOTS,
                     timeout=10)
            r = api.exec_raw(sid, {"command": "touch /workspace/over"})
            expect_error(r, 429, "sandbox_command_capacity")
        finally:
            t.join(timeout=30)
        expect_status(holder["r"], 200)
        assert "over" not in api.sh(sid, "ls /workspace")
    finally:
        api.destroy(sid)


# ---------------------------------------------------------------- one-shot executions


def test_execution_runs_in_a_fresh_sandbox_that_is_gone_afterwards(api: Client, daemon: Daemon):
    r = api.post("/v1/executions", {"command": "echo $((6*7)); id -u; echo e >&2", "memory_mb": 256,
                                    "limits": {"pids": 64}})
    expect_status(r, 200)
    res = r.json()
    assert res["stdout"] == "42\n1000\n" and res["stderr"] == "e\n" and res["exit_code"] == 0, res
    assert res["sandbox_id"].startswith("sb-")
    assert res["output_kept"] is True
    assert api.sandbox(res["sandbox_id"])["state"] == "terminated"
    wait_cleaned(daemon, res["sandbox_id"])


def test_execution_with_argv_stdin_and_timeout(api: Client):
    r = api.post("/v1/executions", {"argv": ["cat"], "stdin": "piped"})
    expect_status(r, 200)
    assert r.json()["stdout"] == "piped"
    r = api.post("/v1/executions", {"command": "sleep 30", "timeout_seconds": 1})
    expect_status(r, 200)
    assert r.json()["timed_out"] is True
    assert api.sandbox(r.json()["sandbox_id"])["state"] == "terminated"


def test_execution_with_an_idempotency_key_replays(api: Client):
    key = f"oneshot-{uuid.uuid4()}"
    body = {"command": "echo $RANDOM$RANDOM$RANDOM"}
    r1 = api.post("/v1/executions", body, headers={"Idempotency-Key": key})
    expect_status(r1, 200)
    r2 = api.post("/v1/executions", body, headers={"Idempotency-Key": key})
    expect_status(r2, 200)
    assert r2.json()["stdout"] == r1.json()["stdout"]
    assert r2.json()["exit_code"] == r1.json()["exit_code"]
    # The replay names the sandbox the command ran in, like the first answer.
    assert r2.json()["sandbox_id"] == r1.json()["sandbox_id"], (r1.json(), r2.json())
    r3 = api.post("/v1/executions", {"command": "echo other"}, headers={"Idempotency-Key": key})
    expect_error(r3, 409, "idempotency_conflict")


def test_execution_refuses_unknown_templates_and_fields(api: Client):
    expect_error(api.post("/v1/executions", {"command": "true", "template": "nope"}), 400, "unknown_template")
    expect_error(api.post("/v1/executions", {"command": "true", "background": True}), 400, "invalid_request")
    expect_error(api.post("/v1/executions", {"command": "true", "memory_mb": 1}), 400, "invalid_request")


# ---------------------------------------------------------------- bad input and memory (issue 10, findings 12, 14)


@pytest.mark.parametrize(
    "cwd, code",
    [
        ("/proc/1/root", "sandbox_path_not_directory"),
        ("/proc/self/cwd", "sandbox_path_not_directory"),
        ("/workspace/missing", "sandbox_path_not_directory"),
        ("/etc/passwd", "sandbox_path_not_directory"),
        ("/root", "sandbox_path_unreadable"),
        ("", "invalid_request"),
        ("/" + "a" * 5000, "invalid_request"),
    ],
    ids=["proc-root", "proc-self-cwd", "missing", "a-file", "root-home", "empty", "too-long"],
)
def test_exec_with_a_bad_cwd_is_a_clear_4xx(api: Client, sandbox: dict, cwd: str, code: str):
    expect_error(api.exec_raw(sandbox["id"], {"command": "true", "cwd": cwd}), 400, code)


@pytest.mark.parametrize("user", ["nobody", "daemon", "USER", "0", "1000"])
def test_exec_accepts_only_the_documented_users(api: Client, sandbox: dict, user: str):
    body = expect_error(api.exec_raw(sandbox["id"], {"command": "true", "user": user}), 400, "invalid_request")
    assert "user" in body["error"], body


@pytest.mark.parametrize(
    "body",
    [
        {"command": "x" * 200_000},
        {"argv": ["echo"] + ["y" * 1000] * 200},
        {"command": "true", "env": {f"V{i}": "z" * 30_000 for i in range(10)}},
        {"argv": ["a\u0000b"]},
        {"command": "true", "env": {"": "1"}},
    ],
    ids=["long-command", "long-argv", "big-env", "argv-nul", "env-empty-name"],
)
def test_exec_with_oversized_or_malformed_commands_is_400(api: Client, sandbox: dict, body: dict):
    expect_error(api.exec_raw(sandbox["id"], body), 400, "invalid_request")


@on_class("gvisor", reason=GVISOR_NO_WORK_CGROUP)
def test_filling_memory_kills_the_command_not_the_sandbox(api: Client):
    """A 400 MB write to RAM-backed /tmp in a 128 MiB sandbox: the OOM killer
    ends the command (reported as such), the sandbox and its agent live on.
    The file's pages stay charged to the workload until the file goes; files
    written through the API are charged to the agent, so an empty write
    frees the memory even while every command would be OOM-killed. (A
    memory layer: a disk layer's pages are page cache, see test_storage.)"""
    sb = api.create(memory_mb=128, storage="memory")
    sid = sb["id"]

    def free(path: str) -> None:
        r = api.post(f"/v1/sandboxes/{sid}/files/write", {"path": path, "data": ""})
        assert r.status_code == 204, r.text

    try:
        # A command killed otherwise is not an OOM kill. (Asked first: right
        # after an OOM kill, a command's start was seen to race the memory
        # cgroup's OOM count on this kernel's v1 controller.)
        res = api.exec(sid, "kill -9 $$")
        assert res["exit_code"] == 137 and res["oom_killed"] is False, res
        res = api.exec(sid, "head -c 400M /dev/zero > /tmp/fill", timeout_seconds=120)
        assert res["oom_killed"] is True, res
        assert res["exit_code"] == 137 and res["timed_out"] is False, res
        assert api.sandbox(sid)["state"] == "running"
        # The agent answers the next command (which may be killed at once:
        # the file still fills the workload's memory).
        res = api.exec(sid, "echo answered")
        assert res["stdout"] == "answered\n" or res["oom_killed"] is True, res
        assert api.sandbox(sid)["state"] == "running"
        free("/tmp/fill")
        assert api.sh(sid, "rm /tmp/fill; echo alive") == "alive\n"
        # The NDJSON exit event says it too.
        r = api.exec_raw(sid, {"command": "head -c 400M /dev/zero > /tmp/fill2"},
                         headers={"Accept": "application/x-ndjson"}, stream=True)
        expect_status(r, 200)
        exit_event = ndjson_events(r)[-1]
        assert exit_event["type"] == "exit" and exit_event["oom_killed"] is True, exit_event
        assert exit_event["exit_code"] == 137, exit_event
        free("/tmp/fill2")
        assert api.sh(sid, "echo alive") == "alive\n"
        assert api.sandbox(sid)["state"] == "running"
    finally:
        api.destroy(sid)


def test_the_cli_forwards_stdin_with_dash_i(daemon: Daemon, api: Client, sandbox: dict):
    """`hutch exec -i` copies its stdin, bytes as they are, to the command,
    closes it at EOF, and exits with the command's code."""
    env = {"HUTCH_URL": daemon.base, "HUTCH_API_KEY": api.key, "PATH": os.environ["PATH"]}
    data = bytes(range(256)) * 2048 + b"\xff\xfe not utf-8"

    def hutch(*args: str, stdin: bytes) -> subprocess.CompletedProcess:
        return subprocess.run([str(daemon.binary), "exec", *args], input=stdin, env=env, capture_output=True,
                              timeout=60)

    p = hutch("-i", sandbox["id"], "--", "sha256sum", stdin=data)
    assert p.returncode == 0, p.stderr
    assert p.stdout.decode().split()[0] == hashlib.sha256(data).hexdigest()
    p = hutch("-i", sandbox["id"], "--", "sh -c 'read x; echo got $x; exit $x'", stdin=b"7\n")
    assert (p.returncode, p.stdout) == (7, b"got 7\n"), p
    # Without -i the command's stdin is empty, whatever hutch's is.
    p = hutch(sandbox["id"], "--", "wc -c", stdin=b"ignored")
    assert (p.returncode, p.stdout.strip()) == (0, b"0"), p
    assert hutch("-i", "--background", sandbox["id"], "--", "true", stdin=b"").returncode == 2
