"""`hutch serve --wake-hold`: the daemon asks idle CPUs to poll (a PM QoS
request on /dev/cpu_dma_latency) while API calls run and for the hold
after the last one, and lets go when the API is quiet."""

from __future__ import annotations

import struct
import threading

from conftest import Daemon, wait_for


def cpu_latency_target() -> int:
    """The kernel's idle-latency target: the lowest request any process holds."""
    with open("/dev/cpu_dma_latency", "rb") as f:
        return struct.unpack("i", f.read(4))[0]


def test_wake_hold_is_held_while_a_call_runs_and_let_go_when_quiet(own_daemon: Daemon):
    own_daemon.extra_env["HUTCH_WAKE_HOLD"] = "200ms"
    d = own_daemon.start()
    api = d.client()
    sb = api.create(ttl_seconds=120)
    # Quiet: the request made for the calls so far is let go.
    wait_for("the daemon to let go of its PM QoS request", lambda: cpu_latency_target() != 0, timeout=30)
    done = threading.Event()

    def long_call():
        try:
            api.sh(sb["id"], "sleep 3")
        finally:
            done.set()

    t = threading.Thread(target=long_call)
    t.start()
    try:
        wait_for("a request held while the call runs", lambda: cpu_latency_target() == 0 or done.is_set(), timeout=30)
        assert not done.is_set(), "the call ended before the request was seen held"
    finally:
        t.join(timeout=60)
    wait_for("the request let go after the call", lambda: cpu_latency_target() != 0, timeout=30)
    api.destroy(sb["id"])
