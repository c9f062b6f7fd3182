"""Usage metering (`GET /v1/usage`): figures equal to what the test's own
clock predicts, within a second; counted commands and egress; groupings;
owner isolation; exact across a daemon restart.

Sleeps here are the elapsed time under test (a known duration the figures
are compared with), never waits for a condition.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

import os
import signal

from conftest import Client, Daemon, expect_error, expect_status, host_processes_of, wait_for

# The figures are wall-clock time between transitions the daemon records;
# the test's clock sees each transition within a request's latency of it.
TOLERANCE = 1.0


def usage(c: Client, **params) -> dict:
    r = c.get("/v1/usage", params=params)
    expect_status(r, 200)
    return r.json()


def row_of(report: dict, field: str, value: str) -> dict:
    rows = [r for r in report["rows"] if r.get(field) == value]
    assert len(rows) == 1, report
    return rows[0]


def close(got: float, want: float, what: str, tol: float = TOLERANCE) -> None:
    assert abs(got - want) <= tol, f"{what}: got {got}, the test's clock says {want} (tolerance {tol})"


def test_usage_follows_the_clock_and_is_the_keys_own(daemon: Daemon):
    k = daemon.new_client("usage-a")
    other = daemon.new_client("usage-b")
    start = int(time.time()) - 1
    t0 = time.monotonic()
    sb = k.create(memory_mb=256, limits={"vcpus": 0.5, "disk_mib": 512})
    sid = sb["id"]
    try:
        t_ready = time.monotonic()
        for i in range(3):
            assert k.exec(sid, f"echo {i}")["exit_code"] == 0
        networked = sb["network"]["egress"] != "deny_all"
        sent = 0
        if networked:
            # 200 datagrams of 1000 bytes toward TEST-NET-1: each leaves the
            # sandbox through its link whatever the policy does with it.
            k.exec(sid, "python3 -c \"import socket\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
                   "[s.sendto(b'x'*1000,('192.0.2.1',9)) for _ in range(200)]\" || true")
            sent = 200 * 1000
        time.sleep(2)
        t_suspend = time.monotonic()
        expect_status(k.post(f"/v1/sandboxes/{sid}/suspend"), 200)
        t_suspended = time.monotonic()
        time.sleep(1.5)
        t_resume = time.monotonic()
        expect_status(k.post(f"/v1/sandboxes/{sid}/resume"), 200)
        t_resumed = time.monotonic()
        time.sleep(1)
        t_delete = time.monotonic()
        expect_status(k.delete(f"/v1/sandboxes/{sid}"), 200)
        t_deleted = time.monotonic()
    finally:
        k.delete(f"/v1/sandboxes/{sid}")

    report = usage(k, group_by="sandbox", **{"from": str(start)})
    assert report["group_by"] == "sandbox"
    r = row_of(report, "sandbox_id", sid)
    assert r["key"] == k.key_id
    running = (t_suspended - t_ready) + (t_delete - t_resumed)
    close(r["memory_mib_seconds"] / 256, running, "seconds running (memory)")
    close(r["vcpu_seconds"] / 0.5, running, "seconds running (vCPUs)")
    close(r["paused_seconds"], t_resume - t_suspend, "seconds suspended")
    # The layer exists from the create to the end of the delete.
    close(r["disk_gib_hours"] * 3600 / 0.5, t_deleted - t0, "seconds the layer existed")
    assert r["commands"] == 3 + (1 if networked else 0), r
    assert r["egress_bytes"] >= sent, r
    assert r["snapshot_gib_hours"] == 0 and r["volume_gib_hours"] == 0

    # Ended: the figures no longer move.
    again = usage(k, group_by="sandbox", **{"from": str(start)})
    assert row_of(again, "sandbox_id", sid) == r

    # Per key, per template, per day: the same totals.
    total = usage(k, **{"from": str(start)})
    assert [x["key"] for x in total["rows"]] == [k.key_id]
    assert abs(total["rows"][0]["memory_mib_seconds"] - r["memory_mib_seconds"]) < 1e-6
    by_template = usage(k, group_by="template", **{"from": str(start)})
    assert row_of(by_template, "template", "base")["commands"] == r["commands"]
    by_day = usage(k, group_by="day", **{"from": str(start)})
    days = {datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d") for t in (start, time.time())}
    assert {x["day"] for x in by_day["rows"]} <= days, by_day
    assert abs(sum(x["vcpu_seconds"] for x in by_day["rows"]) - r["vcpu_seconds"]) < 1e-6

    # Prometheus: the key's totals, labelled by its id only.
    text = k.get("/metrics").text
    assert f'hutch_usage_commands_total{{key="{k.key_id}"}} {r["commands"]}' in text, text[-2000:]
    assert sid not in text

    # Another key sees none of it, and may not ask for it.
    assert usage(other, **{"from": str(start)})["rows"] == []
    expect_error(other.get("/v1/usage", params={"key": k.key_id}), 403, "forbidden")
    # The admin key may.
    admin = daemon.client("admin")
    assert usage(admin, key=k.key_id, **{"from": str(start)})["rows"][0]["commands"] == r["commands"]
    assert k.key_id in {x["key"] for x in usage(admin, key="*", **{"from": str(start)})["rows"]}


def test_bad_windows_are_refused(api: Client):
    now = int(time.time())
    for params in (
        {"from": str(now), "to": str(now)},
        {"from": str(now), "to": str(now - 10)},
        {"from": "yesterday"},
        {"to": "2026-13-01T00:00:00Z"},
        {"from": str(now - 401 * 86400), "to": str(now)},
    ):
        expect_error(api.get("/v1/usage", params=params), 400, "usage_range_invalid")
    expect_error(api.get("/v1/usage", params={"group_by": "hour"}), 400, "invalid_request")
    r = usage(api, **{"from": "2026-01-01T00:00:00Z", "to": "2026-01-02T00:00:00+00:00"})
    assert (r["from"], r["to"]) == ("2026-01-01T00:00:00.000Z", "2026-01-02T00:00:00.000Z")


def test_usage_is_exact_across_a_restart(own_daemon: Daemon):
    d = own_daemon.start()
    k = d.new_client("usage-restart")
    start = int(time.time()) - 1
    sb = k.create(memory_mb=128)
    sid = sb["id"]
    t_ready = time.monotonic()
    # The daemon stops; the sandbox keeps running (and is counted running).
    d.stop()
    time.sleep(1)
    d.start()
    time.sleep(1)
    t_delete = time.monotonic()
    expect_status(k.delete(f"/v1/sandboxes/{sid}"), 200)
    r = row_of(usage(k, group_by="sandbox", **{"from": str(start)}), "sandbox_id", sid)
    close(r["memory_mib_seconds"] / 128, t_delete - t_ready, "seconds running across a restart")
    # Another restart changes nothing of an ended sandbox's figures.
    d.stop()
    d.start()
    assert row_of(usage(k, group_by="sandbox", **{"from": str(start)}), "sandbox_id", sid) == r


def test_a_volume_is_billed_by_its_size_while_it_exists(daemon: Daemon):
    k = daemon.new_client("usage-volume")
    start = int(time.time()) - 1
    t0 = time.monotonic()
    r = k.post("/v1/volumes", {"name": "metered", "size_mib": 1024})
    expect_status(r, 201)
    vid = r.json()["id"]
    try:
        t_made = time.monotonic()
        time.sleep(2)
        t_delete = time.monotonic()
        expect_status(k.delete(f"/v1/volumes/{vid}"), 204)
        t_deleted = time.monotonic()
    finally:
        k.delete(f"/v1/volumes/{vid}")
    rows = usage(k, group_by="sandbox", **{"from": str(start)})["rows"]
    # A volume is no sandbox's: its row names none.
    assert len(rows) == 1 and "sandbox_id" not in rows[0], rows
    seconds = rows[0]["volume_gib_hours"] * 3600  # 1 GiB
    assert t_delete - t_made - TOLERANCE <= seconds <= t_deleted - t0 + TOLERANCE, (seconds, rows)
    assert rows[0]["memory_mib_seconds"] == 0 and rows[0]["commands"] == 0


def test_a_sandbox_that_dies_with_the_daemon_stops_counting_at_its_last_flush(own_daemon: Daemon):
    d = own_daemon.start()
    k = d.new_client("usage-crash")
    start = int(time.time()) - 1
    sid = k.create(memory_mb=128)["id"]
    t_ready = time.monotonic()
    time.sleep(1)
    # A report flushes: the daemon is known alive up to here.
    usage(k)
    t_flushed = time.monotonic()
    d.kill9()
    for pid in host_processes_of([sid]):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for("the sandbox's processes to die", lambda: not host_processes_of([sid]), timeout=10)
    # Downtime the dead sandbox must not be billed for.
    time.sleep(2)
    d.start()
    wait_for("the dead sandbox to be terminated", lambda: k.sandbox(sid)["state"] == "terminated", timeout=10)
    r = row_of(usage(k, group_by="sandbox", **{"from": str(start)}), "sandbox_id", sid)
    close(r["memory_mib_seconds"] / 128, t_flushed - t_ready, "seconds running until the last flush")
