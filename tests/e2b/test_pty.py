"""PTY sessions and streamed stdin through the sync SDK."""

import threading
import time

import pytest
from e2b import CommandExitException, NotFoundException, PtySize


def wait_text(buf, text, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in bytes(buf).decode(errors="replace"):
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {text!r}; output: {bytes(buf)!r}")


def test_pty_create_input_resize_kill(sandbox):
    handle = sandbox.pty.create(PtySize(rows=24, cols=80))
    out, ended = bytearray(), []

    def wait():
        try:
            ended.append(handle.wait(on_pty=out.extend))
        except CommandExitException as e:
            ended.append(e)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    sandbox.pty.send_stdin(handle.pid, b"stty size; echo pty-$((6*7))\n")
    wait_text(out, "24 80")
    wait_text(out, "pty-42")
    assert handle.pid in [p.pid for p in sandbox.commands.list()]
    sandbox.pty.resize(handle.pid, PtySize(rows=30, cols=100))
    sandbox.pty.send_stdin(handle.pid, b"stty size\n")
    wait_text(out, "30 100")
    assert sandbox.pty.kill(handle.pid)
    t.join(timeout=10)
    assert not t.is_alive() and len(ended) == 1
    assert ended[0].exit_code != 0
    assert handle.pid not in [p.pid for p in sandbox.commands.list()]


def test_stream_input_feeds_stdin_in_order(shared):
    h = shared.commands.run("cat", background=True, stdin=True)
    shared.commands.stream_input(h.pid, ["one ", b"two ", "three"])
    shared.commands.close_stdin(h.pid)
    r = h.wait()
    assert r.stdout == "one two three"


def test_stream_input_to_unknown_pid_is_not_found(shared):
    with pytest.raises(NotFoundException):
        shared.commands.stream_input(999999, ["x"])
