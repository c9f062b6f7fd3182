"""Commands through the sync client: JSON results with their flags, streams,
background processes (signal, stdin, reattach), idempotent replays, and
one-shot executions."""

from __future__ import annotations

import signal

import hutch
import pytest

from conftest import marker


def test_exec_shell_and_argv(sandbox: hutch.Sandbox):
    r = sandbox.exec("python3 -c 'print(6*7)'")
    assert r.stdout == "42\n" and r.exit_code == 0 and r.ok
    assert not r.stdout_truncated and not r.timed_out and not r.oom_killed and not r.descendants_alive
    r = sandbox.exec(["sh", "-c", 'echo "$0 $A" >&2; exit 3', "zero"], env={"A": "b"})
    assert r.stderr == "zero b\n" and r.exit_code == 3 and not r.ok
    assert sandbox.exec("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sandbox.exec("id -u", user="root").stdout == "0\n"
    assert sandbox.exec("cat", stdin="fed in").stdout == "fed in"
    assert sandbox.exec("cat", stdin=b"bytes in").stdout == "bytes in"


def test_caps_timeouts_and_oom_are_reported(client: hutch.Hutch):
    with client.sandboxes.create(ttl=300, memory_mb=128) as sb:
        r = sb.exec("head -c 2000000 /dev/zero | tr '\\0' x")
        assert r.stdout_truncated and len(r.stdout) == 1 << 20
        r = sb.exec("sleep 30", timeout="1s")
        assert r.timed_out
        r = sb.exec("python3 -c 'x = bytearray(512 << 20); print(len(x))'")
        assert r.oom_killed and r.exit_code == 137


def test_exec_stream_events(sandbox: hutch.Sandbox):
    with sandbox.exec_stream(["sh", "-c", "echo a; echo b >&2; exit 4"]) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types[0] == "start" and types[-1] == "exit"
    assert "".join(e.data for e in events if isinstance(e, hutch.StdoutEvent)) == "a\n"
    assert "".join(e.data for e in events if isinstance(e, hutch.StderrEvent)) == "b\n"
    assert stream.exit.exit_code == 4 and stream.pid == events[0].pid
    r = sandbox.exec_stream("for i in 1 2 3; do echo $i; done").collect()
    assert r.stdout == "1\n2\n3\n" and r.exit_code == 0


def test_background_signal_stdin_and_reattach(sandbox: hutch.Sandbox):
    p = sandbox.exec("sleep 100", background=True)
    assert isinstance(p, hutch.Process) and p.pid > 0
    assert p.pid in [x.pid for x in sandbox.processes()]
    with p.stream() as attached:
        p.signal("TERM")
        assert attached.collect().exit_code == 128 + signal.SIGTERM
    # Once it ended and left its slot there is nothing to attach to.
    with pytest.raises(hutch.NotFoundError):
        p.wait()
    cat = sandbox.exec("cat; echo done", background=True)
    with cat.stream() as attached:
        cat.stdin("line one\n")
        cat.stdin(b"line two\n")
        cat.close_stdin()
        r = attached.collect()
    assert r.stdout == "line one\nline two\ndone\n"
    # Reattach to a command by its pid: kept output, then the exit.
    q = sandbox.exec("echo early; sleep 0.2; echo late", background=True)
    with sandbox.process(q.pid).stream() as s:
        out = "".join(e.data for e in s if isinstance(e, hutch.StdoutEvent))
    assert out == "early\nlate\n" and s.exit.exit_code == 0
    k = sandbox.exec("sleep 100", background=True)
    with k.stream() as attached:
        k.kill()
        assert attached.collect().exit_code == 128 + signal.SIGKILL
    w = sandbox.exec("sleep 0.5; echo waited", background=True)
    assert w.wait().stdout == "waited\n"
    with pytest.raises(hutch.NotFoundError):
        sandbox.process(999999).signal("TERM")


def test_the_same_idempotency_key_runs_a_command_once(sandbox: hutch.Sandbox):
    key = f"exec-{marker()}"
    first = sandbox.exec("echo ran >> /tmp/count; wc -l < /tmp/count", idempotency_key=key)
    second = sandbox.exec("echo ran >> /tmp/count; wc -l < /tmp/count", idempotency_key=key)
    assert first.stdout == second.stdout == "1\n"
    assert sandbox.exec("wc -l < /tmp/count").stdout == "1\n"
    with pytest.raises(hutch.IdempotencyError) as e:
        sandbox.exec("echo other", idempotency_key=key)
    assert e.value.code == "idempotency_conflict"
    # Without a key given, every call gets its own: both run.
    sandbox.exec("echo ran >> /tmp/count")
    sandbox.exec("echo ran >> /tmp/count")
    assert sandbox.exec("wc -l < /tmp/count").stdout == "3\n"


def test_one_shot_execution(client: hutch.Hutch):
    r = client.run(["python3", "-c", "import os; print(os.environ['X'])"], env={"X": "y"}, timeout="30s",
                   memory_mb=256, network="deny_all")
    assert r.stdout == "y\n" and r.exit_code == 0 and r.sandbox_id.startswith("sb-")
    assert client.sandboxes.get(r.sandbox_id).state == "terminated"
    assert client.run("cat", stdin="in").stdout == "in"


def test_command_errors_carry_their_codes(sandbox: hutch.Sandbox):
    with pytest.raises(hutch.FileError) as e:
        sandbox.exec("true", cwd="/no/such/dir")
    assert e.value.code == "sandbox_path_not_directory"
    with pytest.raises(hutch.InvalidRequestError) as e:
        sandbox.exec("true", user="nobody")
    assert e.value.code == "invalid_request"
    with pytest.raises(TypeError):
        sandbox.exec([])
