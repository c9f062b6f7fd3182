"""Sandbox state through the unmodified SDK: pause to disk
(`keep_memory=False` / `mode="filesystem"`) and `connect()` resuming it,
auto-resume of a disk-paused sandbox by its port host, snapshots
(`create_snapshot`, `list_snapshots`, `delete_snapshot`, `Sandbox.create`
from one), `fork`, and the refusals: another key's sandbox or snapshot,
a sandbox whose files are in memory, memory snapshots, unknown routes."""

import time

import pytest
import requests
from e2b import AsyncSandbox, Sandbox
from e2b.exceptions import InvalidArgumentException, NotFoundException, SandboxException

from conftest import TEST_CLASS, E2bDaemon, wait_for
from test_ports import PORT, get


def info_state(sb_id, **opts):
    return Sandbox.get_info(sb_id, **opts).state.value


def test_pause_to_disk_keeps_files_and_connect_resumes(daemon):
    sb = Sandbox.create(timeout=300)
    try:
        sb.files.write("/home/user/kept.txt", "on disk")
        sb.commands.run("sleep 600", background=True, timeout=0)
        assert sb.pause(keep_memory=False) is True
        assert info_state(sb.sandbox_id) == "paused"
        # The native view: paused to disk, not a memory suspend.
        r = requests.get(f"{daemon['base']}/v1/sandboxes/{sb.sandbox_id}",
                         headers={"Authorization": f"Bearer {daemon['key']}"}, timeout=10)
        assert r.json()["state"] == "paused", r.text
        # Pausing again is the SDK's "already paused".
        assert sb.pause(mode="filesystem") is False
        back = Sandbox.connect(sb.sandbox_id)
        assert info_state(sb.sandbox_id) == "running"
        assert back.files.read("/home/user/kept.txt") == "on disk"
        # Processes did not survive: a fresh agent on the same files.
        assert "sleep 600" not in back.commands.run("ps -eo args").stdout
        # A full pause (the default) is the memory suspend: processes stay.
        back.commands.run("sleep 600", background=True, timeout=0)
        assert back.pause() is True
        Sandbox.connect(sb.sandbox_id)
        assert "sleep 600" in back.commands.run("ps -eo args").stdout
    finally:
        sb.kill()


def test_a_disk_paused_sandbox_with_auto_resume_is_resumed_by_its_port_host(daemon):
    sb = Sandbox.create(lifecycle={"on_timeout": "pause", "auto_resume": True})
    plain = Sandbox.create()
    try:
        sb.pause(keep_memory=False)
        plain.pause(keep_memory=False)
        r = get(daemon, sb.get_host(PORT))
        # Resumed on its files; nothing listens on the port after a reboot.
        assert r.status_code == 502 and "port is not open" in r.json()["message"], r.text
        assert info_state(sb.sandbox_id) == "running"
        assert sb.commands.run("echo up").stdout == "up\n"
        # Without auto-resume it stays paused.
        r = get(daemon, plain.get_host(PORT))
        assert r.status_code == 409 and "paused" in r.json()["message"], r.text
        assert info_state(plain.sandbox_id) == "paused"
    finally:
        sb.kill()
        plain.kill()


def test_on_timeout_pause_pauses_to_disk_and_connect_gives_the_timeout_again(daemon):
    sb = Sandbox.create(timeout=2, lifecycle={"on_timeout": "pause"})
    plain = Sandbox.create(timeout=2)
    try:
        assert Sandbox.get_info(sb.sandbox_id).lifecycle["on_timeout"] == "pause"
        sb.files.write("/home/user/kept.txt", "past the timeout")
        wait_for("the timeout's pause", lambda: info_state(sb.sandbox_id) == "paused", timeout=15)
        r = requests.get(f"{daemon['base']}/v1/sandboxes/{sb.sandbox_id}",
                         headers={"Authorization": f"Bearer {daemon['key']}"}, timeout=10)
        assert r.json()["state"] == "paused", r.text
        # Without on_timeout the sandbox ends at its timeout.
        wait_for("the plain sandbox's end", lambda: not plain.is_running() and not any(
            s.sandbox_id == plain.sandbox_id for s in Sandbox.list().next_items()), timeout=15)
        back = Sandbox.connect(sb.sandbox_id, timeout=60)
        assert back.files.read("/home/user/kept.txt") == "past the timeout"
        end = Sandbox.get_info(sb.sandbox_id).end_at.timestamp()
        assert time.time() + 30 < end < time.time() + 90, end
    finally:
        sb.kill()
        plain.kill()


def test_a_disk_pause_and_a_snapshot_survive_a_daemon_restart():
    d = E2bDaemon()
    try:
        sb = Sandbox.create(**d.opts())
        sb.files.write("/home/user/kept.txt", "across restarts")
        snap = sb.create_snapshot("restart-snap")
        assert sb.pause(keep_memory=False) is True
        d.restart()
        assert info_state(sb.sandbox_id, **d.opts()) == "paused"
        assert [s.snapshot_id for s in Sandbox.list_snapshots(**d.opts()).next_items()] == [snap.snapshot_id]
        back = Sandbox.connect(sb.sandbox_id, **d.opts())
        assert back.files.read("/home/user/kept.txt") == "across restarts"
        child = Sandbox.create("restart-snap", **d.opts())
        assert child.files.read("/home/user/kept.txt") == "across restarts"
    finally:
        try:
            for s in Sandbox.list_snapshots(**d.opts()).next_items():
                Sandbox.delete_snapshot(s.snapshot_id, **d.opts())
            d.kill_all()
        finally:
            d.stop()


@pytest.mark.skipif(TEST_CLASS != "gvisor", reason="memory snapshots are of the gvisor class")
def test_a_full_snapshot_of_a_gvisor_sandbox_keeps_its_running_processes(daemon):
    # No network at all (a template's `deny_all`): runsc saves no sandbox
    # on the host's network stack.
    r = requests.post(
        daemon["base"] + "/v1/templates",
        headers={"Authorization": f"Bearer {daemon['key']}"},
        json={"name": "e2b-offline", "network": {"egress": "deny_all"}},
        timeout=30,
    )
    assert r.status_code == 201, r.text
    sb = Sandbox.create("e2b-offline", timeout=300)
    made = []
    try:
        sb.commands.run("sleep 4321", background=True, timeout=0)
        wait_for("the sleep to run", lambda: sb.commands.run("pgrep -f 'slee[p] 4321' || true").stdout.strip())
        full = sb.create_snapshot(mode="full")
        files = sb.create_snapshot(mode="filesystem")
        # The source goes on running.
        assert sb.commands.run("pgrep -f 'slee[p] 4321'").exit_code == 0
        # A sandbox from the full snapshot continues the process; one from
        # the files-only snapshot starts without it.
        made.append(Sandbox.create(full.snapshot_id))
        assert made[-1].commands.run("pgrep -f 'slee[p] 4321'").exit_code == 0
        made.append(Sandbox.create(files.snapshot_id))
        assert made[-1].commands.run("pgrep -f 'slee[p] 4321' || echo none").stdout.strip() == "none"
    finally:
        for child in made:
            child.kill()
        sb.kill()
        for s in Sandbox.list_snapshots(sandbox_id=sb.sandbox_id).next_items():
            Sandbox.delete_snapshot(s.snapshot_id)
        requests.delete(daemon["base"] + "/v1/templates/e2b-offline",
                        headers={"Authorization": f"Bearer {daemon['key']}"}, timeout=30)


def test_snapshots_create_list_start_from_and_delete(daemon):
    sb = Sandbox.create(metadata={"suite": "state"})
    made = []
    try:
        sb.files.write("/home/user/state.txt", "v1")
        snap = sb.create_snapshot(mode="filesystem")
        assert snap.snapshot_id.startswith("snap-") and snap.names == []
        named = Sandbox.create_snapshot(sb.sandbox_id, "state-two")
        assert named.names == ["state-two"]
        sb.files.write("/home/user/state.txt", "v2")
        listed = [s.snapshot_id for s in sb.list_snapshots().next_items()]
        assert set(listed) == {snap.snapshot_id, named.snapshot_id}
        by_name = Sandbox.list_snapshots(name="state-two").next_items()
        assert [s.snapshot_id for s in by_name] == [named.snapshot_id]
        # Pages: one at a time, then the next.
        pager = Sandbox.list_snapshots(sandbox_id=sb.sandbox_id, limit=1)
        first = pager.next_items()
        assert len(first) == 1 and pager.has_next
        assert len(pager.next_items()) == 1 and not pager.has_next
        # A sandbox from a snapshot (by id, and by name) has its files.
        child = Sandbox.create(snap.snapshot_id)
        made.append(child)
        assert child.files.read("/home/user/state.txt") == "v1"
        other = Sandbox.create("state-two")
        made.append(other)
        assert other.files.read("/home/user/state.txt") == "v1"
        # Delete: True, then False (gone); sandboxes keep their files.
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
        assert Sandbox.delete_snapshot("state-two") is True
        assert Sandbox.list_snapshots(sandbox_id=sb.sandbox_id).next_items() == []
        assert child.files.read("/home/user/state.txt") == "v1"
        with pytest.raises(SandboxException) as e:
            Sandbox.create(snap.snapshot_id)
        assert e.value.status_code == 404
    finally:
        for s in made:
            s.kill()
        sb.kill()


def test_fork_starts_sandboxes_with_the_parents_files(daemon):
    sb = Sandbox.create(network={"allow_public_traffic": False})
    children = []
    try:
        sb.files.write("/home/user/fork.txt", "parent")
        results = sb.fork(count=2, timeout=120)
        assert len(results) == 2 and all(isinstance(c, Sandbox) for c in results), results
        children = results
        ids = {c.sandbox_id for c in children}
        assert len(ids) == 2 and sb.sandbox_id not in ids
        for c in children:
            assert c.files.read("/home/user/fork.txt") == "parent"
            c.files.write("/home/user/fork.txt", c.sandbox_id)
            # The parent's E2B settings come along: its ports want a token.
            assert c.traffic_access_token
        assert sb.files.read("/home/user/fork.txt") == "parent"
        with pytest.raises(InvalidArgumentException):
            sb.fork(count=0)
        # Past E2B's 20 (which the SDK may refuse itself), the API says 400.
        r = requests.post(f"{daemon['base']}/sandboxes/{sb.sandbox_id}/fork", json={"count": 21},
                          headers={"X-API-Key": daemon["key"]}, timeout=30)
        assert r.status_code == 400 and r.json()["code"] == 400, r.text
    finally:
        for c in children:
            c.kill()
        sb.kill()


def test_another_key_sees_nothing_of_the_first(daemon):
    d = daemon["daemon"]
    other = d.opts(d.make_key("e2b-state-other"))
    sb = Sandbox.create()
    try:
        snap = sb.create_snapshot()
        assert Sandbox.list_snapshots(**other).next_items() == []
        with pytest.raises(SandboxException) as e:
            Sandbox.create(snap.snapshot_id, **other)
        assert e.value.status_code == 404
        assert Sandbox.delete_snapshot(snap.snapshot_id, **other) is False
        with pytest.raises(NotFoundException):
            Sandbox.create_snapshot(sb.sandbox_id, **other)
        with pytest.raises(NotFoundException):
            Sandbox.fork(sb.sandbox_id, count=1, **other)
        with pytest.raises(NotFoundException):
            Sandbox.pause(sb.sandbox_id, keep_memory=False, **other)
        assert info_state(sb.sandbox_id) == "running"
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    finally:
        sb.kill()


def test_bad_input_is_refused_in_e2b_words(daemon):
    # A sandbox whose files are in memory (made through the native API).
    r = requests.post(f"{daemon['base']}/v1/sandboxes", json={"storage": "memory", "wait_seconds": 30},
                      headers={"Authorization": f"Bearer {daemon['key']}"}, timeout=60)
    assert r.status_code == 201, r.text
    mem = r.json()["id"]
    sb = Sandbox.create()
    try:
        with pytest.raises(SandboxException) as e:
            Sandbox.create_snapshot(mem)
        assert e.value.status_code == 409 and "memory" in str(e.value)
        with pytest.raises(SandboxException) as e:
            Sandbox.fork(mem, count=1)
        assert e.value.status_code == 409
        with pytest.raises(SandboxException) as e:
            Sandbox.pause(mem, keep_memory=False)
        assert e.value.status_code == 400 and "memory" in str(e.value)
        assert info_state(mem) == "running"
        # Memory is kept only where the class can (a gvisor sandbox without
        # a network): here it cannot, and is not half kept.
        with pytest.raises(SandboxException) as e:
            sb.create_snapshot(mode="full")
        assert e.value.status_code == 409 and "memory" in str(e.value), e.value
        # A bad name, an unknown snapshot id.
        with pytest.raises(SandboxException) as e:
            sb.create_snapshot("Not A Name")
        assert e.value.status_code == 400
        with pytest.raises(SandboxException) as e:
            Sandbox.create("snap-0000000000000000")
        assert e.value.status_code == 404
        assert Sandbox.delete_snapshot("snap-0000000000000000") is False
        assert Sandbox.list_snapshots(sandbox_id=mem).next_items() == []
        # A paused sandbox is snapshotted by no one: E2B's 409.
        sb.pause(keep_memory=False)
        with pytest.raises(SandboxException) as e:
            sb.create_snapshot()
        assert e.value.status_code == 409
        # Unknown routes answer E2B's {"code", "message"}.
        for method, path in [("get", "/teams/x"), ("get", "/templates"), ("get", "/snapshots/x")]:
            r = requests.request(method, daemon["base"] + path, headers={"X-API-KEY": daemon["key"]}, timeout=10)
            assert r.status_code in (404, 405) and set(r.json()) == {"code", "message"}, (path, r.text)
    finally:
        sb.kill()
        Sandbox.kill(mem)


async def test_async_pause_snapshot_and_fork(daemon):
    sb = await AsyncSandbox.create()
    children = []
    try:
        await sb.files.write("/home/user/a.txt", "async")
        snap = await sb.create_snapshot()
        assert [s.snapshot_id for s in (await AsyncSandbox.list_snapshots(sandbox_id=sb.sandbox_id).next_items())] \
            == [snap.snapshot_id]
        children = [c for c in await sb.fork(count=1)]
        assert await children[0].files.read("/home/user/a.txt") == "async"
        assert await sb.pause(keep_memory=False) is True
        back = await AsyncSandbox.connect(sb.sandbox_id)
        assert await back.files.read("/home/user/a.txt") == "async"
        assert await AsyncSandbox.delete_snapshot(snap.snapshot_id) is True
    finally:
        for c in children:
            await c.kill()
        await sb.kill()
