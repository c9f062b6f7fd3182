"""Commands through the SDK's process service (Connect RPC, JSON codec)."""

import pytest
from e2b import CommandExitException, TimeoutException

from conftest import wait_for


def test_foreground_streams_output_to_callbacks(shared):
    out, err = [], []
    r = shared.commands.run("echo one; echo two >&2; echo three", on_stdout=out.append, on_stderr=err.append)
    assert r.exit_code == 0
    assert r.stdout == "one\nthree\n" and r.stderr == "two\n"
    assert "".join(out) == "one\nthree\n" and "".join(err) == "two\n"


def test_sandbox_envs_and_command_envs(shared):
    assert shared.commands.run("echo $SUITE_VAR").stdout == "hutch\n"
    assert shared.commands.run("echo $X", envs={"X": "y"}).stdout == "y\n"


def test_default_user_and_home_cwd_and_user_root(shared):
    r = shared.commands.run("whoami; pwd")
    assert r.stdout == "user\n/home/user\n"
    assert shared.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert shared.commands.run("whoami", user="root").stdout == "root\n"


def test_non_zero_exit_raises_command_exit_exception(shared):
    with pytest.raises(CommandExitException) as e:
        shared.commands.run("echo bad >&2; exit 3")
    assert e.value.exit_code == 3 and e.value.stderr == "bad\n"


def test_timeout_raises_timeout_exception_and_kills(shared):
    with pytest.raises(TimeoutException):
        shared.commands.run("sleep 30", timeout=1)
    # Killed at its deadline; gone once the sandbox's kernel has delivered
    # the kill and the agent reaped it (a moment longer under gVisor).
    wait_for("the timed-out command to end",
             lambda: not [p for p in shared.commands.list() if "sleep 30" in " ".join([p.cmd, *p.args])])


def test_background_wait_and_kill(shared):
    h = shared.commands.run("sleep 0.3; echo done", background=True)
    assert h.pid > 0
    r = h.wait()
    assert r.stdout == "done\n" and r.exit_code == 0

    h = shared.commands.run("sleep 60", background=True)
    assert any(p.pid == h.pid for p in shared.commands.list())
    assert h.kill()
    with pytest.raises(CommandExitException):
        h.wait()
    assert not any(p.pid == h.pid for p in shared.commands.list())


def test_stdin_and_close(shared):
    h = shared.commands.run("cat", background=True, stdin=True)
    shared.commands.send_stdin(h.pid, "hello\n")
    shared.commands.close_stdin(h.pid)
    assert h.wait().stdout == "hello\n"


def test_connect_to_running_pid(shared):
    # The command waits for its stdin, so it still runs when connected to.
    h = shared.commands.run("read line; echo later-$line", background=True, stdin=True)
    again = shared.commands.connect(h.pid)
    shared.commands.send_stdin(h.pid, "on\n")
    assert again.wait().stdout.endswith("later-on\n")


def test_kill_unknown_pid_is_false(shared):
    assert shared.commands.kill(999_999) is False
