"""envd's behaviour as the SDK expects it: file modes, removes of missing
paths, watch events of `/files` writes (with their entries), symlinks,
the announced envd version, a sandbox killed under a streaming command,
and the sandbox's metrics history and logs. Sync and async SDK."""

import asyncio
import datetime
import threading
import time

import pytest
from e2b import (
    AsyncSandbox,
    FileType,
    FilesystemEventType,
    NotFoundException,
    Sandbox,
    SandboxException,
    SandboxNotRunningException,
    TimeoutException,
)
from packaging.version import Version

from conftest import wait_for
from conftest import GVISOR_STATX, on_class


def poll(handle, want, timeout=10.0):
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen.extend(handle.get_new_events())
        if want(seen):
            return seen
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for watch events; saw {seen!r}")


def kinds(events, name):
    return [e.type for e in events if e.name == name]


# -- files -------------------------------------------------------------------


@on_class("gvisor", reason=GVISOR_STATX)
def test_files_written_are_0644_and_a_replaced_file_keeps_its_mode(shared):
    info = shared.files.write("modes/new.txt", "x")
    assert info.path == "/home/user/modes/new.txt"
    got = shared.files.get_info("modes/new.txt")
    assert (got.mode, got.permissions) == (0o644, "-rw-r--r--"), got
    assert shared.commands.run("stat -c %a /home/user/modes/new.txt").stdout == "644\n"
    shared.commands.run("chmod 750 /home/user/modes/new.txt")
    shared.files.write("modes/new.txt", "again")
    assert shared.commands.run("stat -c %a /home/user/modes/new.txt").stdout == "750\n"
    assert shared.files.read("modes/new.txt") == "again"
    # Many files at once, and as root.
    shared.files.write_files([{"path": "modes/a", "data": "1"}, {"path": "modes/b", "data": "2"}])
    shared.files.write("/root/r.txt", "r", user="root")
    out = shared.commands.run("stat -c '%a %U' /home/user/modes/a /home/user/modes/b /root/r.txt", user="root")
    assert out.stdout == "644 user\n644 user\n644 root\n"


def test_removing_a_missing_path_succeeds_as_on_envd(shared):
    shared.files.remove("no/such/thing")
    shared.files.remove("/tmp/never-was")
    shared.files.write("gone.txt", "x")
    shared.files.remove("gone.txt")
    shared.files.remove("gone.txt")
    assert not shared.files.exists("gone.txt")


def test_stat_and_list_follow_symlinks_as_envd(shared):
    shared.files.write("links/target.txt", "hello")
    shared.files.make_dir("links/dir")
    shared.commands.run(
        "cd /home/user/links && ln -s target.txt rel && ln -s /home/user/links/dir absdir"
        " && ln -s rel chain && ln -s nowhere dangling"
    )
    rel = shared.files.get_info("links/rel")
    assert rel.type == FileType.FILE and rel.symlink_target == "/home/user/links/target.txt", rel
    assert rel.mode == 0o644 and rel.path == "/home/user/links/rel"
    absdir = shared.files.get_info("links/absdir")
    assert absdir.type == FileType.DIR and absdir.symlink_target == "/home/user/links/dir", absdir
    chain = shared.files.get_info("links/chain")
    assert chain.type == FileType.FILE and chain.symlink_target == "/home/user/links/target.txt", chain
    dangling = shared.files.get_info("links/dangling")
    assert dangling.symlink_target == "/home/user/links/dangling", dangling
    plain = shared.files.get_info("links/target.txt")
    assert plain.symlink_target is None
    listed = {e.name: e for e in shared.files.list("links")}
    assert listed["rel"].type == FileType.FILE and listed["rel"].symlink_target == "/home/user/links/target.txt"
    assert listed["absdir"].type == FileType.DIR
    # Listing through a symlinked directory lists its target, under the
    # path asked for.
    shared.files.write("links/dir/inner.txt", "i")
    inner = shared.files.list("links/absdir")
    assert [(e.name, e.path) for e in inner] == [("inner.txt", "/home/user/links/absdir/inner.txt")]


async def test_async_files_modes_remove_and_symlinks(daemon):
    sb = await AsyncSandbox.create()
    try:
        await sb.files.write("a.txt", "a")
        assert (await sb.files.get_info("a.txt")).mode == 0o644
        await sb.files.remove("not-there")
        await sb.commands.run("ln -s a.txt /home/user/l")
        info = await sb.files.get_info("l")
        assert info.type == FileType.FILE and info.symlink_target == "/home/user/a.txt"
    finally:
        await sb.kill()


# -- watches -----------------------------------------------------------------


def test_a_files_write_is_seen_as_envd_reports_it(shared):
    shared.files.make_dir("wv")
    handle = shared.files.watch_dir("wv")
    try:
        shared.files.write("wv/new.txt", "one")
        # A new file: created (and given to its user), then written; the
        # upload's temporary is never reported.
        seen = poll(handle, lambda s: FilesystemEventType.WRITE in kinds(s, "new.txt"))
        assert kinds(seen, "new.txt") == [FilesystemEventType.CREATE, FilesystemEventType.CHMOD,
                                          FilesystemEventType.WRITE], seen
        assert all(e.name == "new.txt" for e in seen), seen
        shared.files.write("wv/new.txt", "two")
        seen = poll(handle, lambda s: FilesystemEventType.WRITE in kinds(s, "new.txt"))
        assert FilesystemEventType.CREATE not in kinds(seen, "new.txt"), seen
    finally:
        handle.stop()


def test_recursive_watches_see_writes_in_nested_directories_made_after_them(shared):
    shared.files.make_dir("rw")
    handle = shared.files.watch_dir("rw", recursive=True)
    try:
        shared.files.make_dir("rw/nested/deeper")
        shared.files.write("rw/nested/deeper/f.txt", "x")
        seen = poll(handle, lambda s: FilesystemEventType.WRITE in kinds(s, "nested/deeper/f.txt"))
        assert FilesystemEventType.CREATE in kinds(seen, "nested"), seen
        assert FilesystemEventType.CREATE in kinds(seen, "nested/deeper/f.txt"), seen
    finally:
        handle.stop()


def test_watch_events_carry_their_entry_when_asked(shared):
    shared.files.make_dir("we")
    handle = shared.files.watch_dir("we", include_entry=True, allow_network_mounts=True)
    try:
        shared.files.write("we/e.txt", "abc")
        # The entry is read when the event is: remove the file only after.
        seen = poll(handle, lambda s: FilesystemEventType.WRITE in kinds(s, "e.txt"))
        shared.commands.run("rm /home/user/we/e.txt")
        seen += poll(handle, lambda s: FilesystemEventType.REMOVE in kinds(s, "e.txt"))
        write = next(e for e in seen if e.name == "e.txt" and e.type == FilesystemEventType.WRITE)
        assert write.entry is not None and write.entry.path == "/home/user/we/e.txt", write
        assert write.entry.type == FileType.FILE and write.entry.name == "e.txt"
        remove = next(e for e in seen if e.name == "e.txt" and e.type == FilesystemEventType.REMOVE)
        assert not remove.entry, remove
    finally:
        handle.stop()
    # Without asking, no entry.
    handle = shared.files.watch_dir("we")
    try:
        shared.files.write("we/f.txt", "x")
        seen = poll(handle, lambda s: FilesystemEventType.WRITE in kinds(s, "f.txt"))
        assert all(not e.entry for e in seen), seen
    finally:
        handle.stop()


def test_a_watch_sees_a_replaced_file_written_in_place_and_a_later_move_as_a_rename(shared):
    # The daemon puts an upload in place of the file it replaces by
    # swapping the two and removing the old one: a watch sees envd's
    # in-place write, not the swap.
    shared.files.make_dir("wr")
    shared.files.write("wr/r.txt", "one")
    handle = shared.files.watch_dir("wr")
    try:
        shared.files.write("wr/r.txt", "two, longer")
        seen = poll(handle, lambda s: FilesystemEventType.WRITE in kinds(s, "r.txt"))
        shared.commands.run("mv /home/user/wr/r.txt /home/user/wr/s.txt")
        seen += poll(handle, lambda s: FilesystemEventType.CREATE in kinds(s, "s.txt"))
        assert kinds(seen, "r.txt") == [FilesystemEventType.CHMOD, FilesystemEventType.WRITE,
                                        FilesystemEventType.RENAME], seen
        assert {e.name for e in seen} == {"r.txt", "s.txt"}, seen
        assert shared.files.read("wr/s.txt") == "two, longer"
        assert [e.name for e in shared.files.list("wr")] == ["s.txt"]
    finally:
        handle.stop()


async def test_async_watch_streams_envd_events_with_entries(daemon):
    sb = await AsyncSandbox.create()
    try:
        await sb.files.make_dir("w/sub")
        got = []
        handle = await sb.files.watch_dir("w", on_event=got.append, recursive=True, include_entry=True)
        await sb.files.write("w/sub/a.txt", "hi")
        deadline = time.monotonic() + 10
        while FilesystemEventType.WRITE not in kinds(got, "sub/a.txt") and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert kinds(got, "sub/a.txt") == [FilesystemEventType.CREATE, FilesystemEventType.CHMOD,
                                           FilesystemEventType.WRITE], got
        assert got[-1].entry is not None and got[-1].entry.path == "/home/user/w/sub/a.txt"
        await handle.stop()
    finally:
        await sb.kill()


def test_the_envd_version_is_the_sdks_newest(shared):
    assert shared._envd_version == Version("0.6.4")
    info = Sandbox.get_info(shared.sandbox_id)
    assert Version(info.envd_version) == Version("0.6.4")


# -- a sandbox killed under a command ---------------------------------------


def test_a_sandbox_killed_while_a_command_streams_raises_not_running(daemon):
    sb = Sandbox.create()
    errors = []

    def run():
        try:
            sb.commands.run("sleep 60", timeout=120)
        except Exception as e:  # noqa: BLE001 - what the SDK raises is the point
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    wait_for("the command", lambda: any("sleep 60" in " ".join([p.cmd, *p.args]) for p in sb.commands.list()))
    Sandbox.kill(sb.sandbox_id)
    t.join(timeout=60)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], SandboxNotRunningException), errors
    assert isinstance(errors[0], TimeoutException)
    assert "was not found" in str(errors[0]), errors[0]


async def test_async_a_sandbox_killed_while_a_command_streams_raises_not_running(daemon):
    sb = await AsyncSandbox.create()
    handle = await sb.commands.run("sleep 60", background=True, timeout=120)
    await AsyncSandbox.kill(sb.sandbox_id)
    with pytest.raises(SandboxNotRunningException) as e:
        await handle.wait()
    assert "was not found" in str(e.value)


# -- metrics and logs --------------------------------------------------------


def test_metrics_keep_a_history_and_honour_start_and_end(daemon):
    sb = Sandbox.create(timeout=120)
    try:
        sb.files.write("/home/user/blob", b"x" * (3 << 20))
        written = time.time()
        # Samples come every five seconds: wait for two taken after the write.
        metrics = wait_for(
            "two samples after the write",
            lambda: [m for m in sb.get_metrics() if m.timestamp.timestamp() > written][1:] and sb.get_metrics(),
            timeout=30,
            interval=0.5,
        )
        assert len(metrics) >= 3, metrics
        stamps = [m.timestamp for m in metrics]
        assert stamps == sorted(stamps)
        last = metrics[-1]
        assert last.cpu_count >= 1 and 0 <= last.cpu_used_pct <= 100
        assert last.mem_total == 1024 << 20 and 0 < last.mem_used <= last.mem_total, last
        assert last.disk_used >= 3 << 20 and last.disk_total >= last.disk_used, last
        # start and end (seconds) pick a window, both ends included.
        second = metrics[1].timestamp
        window = sb.get_metrics(start=second, end=second)
        assert [m.timestamp for m in window] == [m.timestamp for m in metrics if int(m.timestamp.timestamp()) == int(second.timestamp())]
        after = sb.get_metrics(start=metrics[-1].timestamp + datetime.timedelta(seconds=1))
        assert after == [] or all(m.timestamp > metrics[-1].timestamp for m in after)
        # A paused sandbox keeps its history.
        sb.pause()
        assert len(Sandbox.get_metrics(sb.sandbox_id)) >= len(metrics)
    finally:
        Sandbox.kill(sb.sandbox_id)


def test_metrics_refuse_a_window_that_ends_before_it_starts(shared):
    now = datetime.datetime.now(datetime.timezone.utc)
    with pytest.raises(SandboxException) as e:
        shared.get_metrics(start=now, end=now - datetime.timedelta(minutes=1))
    assert "400: start must not be after end" in str(e.value), e.value


def logs(daemon, sid, v2=False, key=None, **params):
    import requests

    path = f"/v2/sandboxes/{sid}/logs" if v2 else f"/sandboxes/{sid}/logs"
    return requests.get(daemon["base"] + path, params=params, headers={"X-API-KEY": key or daemon["key"]}, timeout=10)


def test_logs_tell_the_start_and_the_commands_v1_and_v2(daemon):
    from e2b.api.client.api.sandboxes import get_sandboxes_sandbox_id_logs, get_v_2_sandboxes_sandbox_id_logs
    from e2b.api.client.models import LogLevel, LogsDirection
    from e2b.api.client_sync import get_api_client
    from e2b.connection_config import ConnectionConfig

    sb = Sandbox.create()
    try:
        sb.commands.run("echo hi")
        with pytest.raises(Exception):
            sb.commands.run("exit 3")
        client = get_api_client(ConnectionConfig())
        v1 = get_sandboxes_sandbox_id_logs.sync(sb.sandbox_id, client=client)
        messages = [e.message for e in v1.log_entries]
        assert messages[0].startswith("sandbox started from template base"), messages
        assert any(m.startswith("process ") and m.endswith("started: /bin/bash -l -c echo hi") for m in messages), messages
        assert any("ended: exit code 3" in m for m in messages), messages
        assert [line.line for line in v1.logs] == messages
        assert all(e.timestamp.tzinfo is not None for e in v1.log_entries)
        # v2: newest first by default; a level and a search narrow it.
        v2 = get_v_2_sandboxes_sandbox_id_logs.sync(sb.sandbox_id, client=client)
        assert [e.message for e in v2.logs] == list(reversed(messages))
        warn = get_v_2_sandboxes_sandbox_id_logs.sync(sb.sandbox_id, client=client, level=LogLevel.WARN)
        assert [e.level for e in warn.logs] == [LogLevel.WARN] and "exit code 3" in warn.logs[0].message
        fwd = get_v_2_sandboxes_sandbox_id_logs.sync(
            sb.sandbox_id, client=client, direction=LogsDirection.FORWARD, limit=1, search="echo hi"
        )
        assert len(fwd.logs) == 1 and "echo hi" in fwd.logs[0].message
        first = int(v1.log_entries[0].timestamp.timestamp() * 1000)
        later = get_sandboxes_sandbox_id_logs.sync(sb.sandbox_id, client=client, start=first + 1)
        assert len(later.log_entries) <= len(v1.log_entries)
        assert get_sandboxes_sandbox_id_logs.sync(sb.sandbox_id, client=client, limit=0).log_entries == []
    finally:
        sb.kill()


def test_logs_and_metrics_refuse_bad_input_and_other_keys_sandboxes(daemon, shared):
    sid = shared.sandbox_id
    for params in [{"limit": "1001"}, {"limit": "x"}, {"level": "fatal"}, {"direction": "sideways"},
                   {"cursor": "-1"}, {"search": "x" * 257}]:
        r = logs(daemon, sid, v2=True, **params)
        assert r.status_code == 400 and "message" in r.json(), (params, r.text)
    assert logs(daemon, sid, start="yesterday").status_code == 400
    other = daemon["daemon"].make_key("e2b-other")
    for v2 in (False, True):
        r = logs(daemon, sid, v2=v2, key=other)
        assert r.status_code == 404 and "message" in r.json(), r.text
    with pytest.raises(NotFoundException):
        Sandbox.get_metrics(sid, api_key=other)
    for v2 in (False, True):
        r = logs(daemon, "nosuch", v2=v2)
        assert r.status_code == 404 and "message" in r.json(), r.text


# -- tokens ------------------------------------------------------------------


def test_envd_tokens_reach_only_their_own_running_sandbox(daemon):
    import requests

    a = Sandbox.create(network={"allow_public_traffic": False})
    b = Sandbox.create()
    a.files.write("mine.txt", "a")

    def read(sid, token, host=None):
        headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"}
        if token is not None:
            headers["X-Access-Token"] = token
        if host:
            headers["Host"] = host
        return requests.get(daemon["base"] + "/files", params={"path": "/home/user/mine.txt"}, headers=headers,
                            timeout=30)

    try:
        assert read(a.sandbox_id, a._envd_access_token).text == "a"
        for bad in [None, "", "wrong", b._envd_access_token, a.traffic_access_token, a._envd_access_token[:-1]]:
            r = read(a.sandbox_id, bad)
            assert r.status_code == 401 and r.json()["message"], (bad, r.text)
        # By envd's host name too.
        assert read(a.sandbox_id, b._envd_access_token, host=a.get_host(49983)).status_code == 401
    finally:
        a.kill()
        b.kill()
    # A token outlives nothing: its sandbox ended, the SDK reads "not running".
    r = read(a.sandbox_id, a._envd_access_token)
    assert r.status_code == 502 and "was not found" in r.json()["message"], r.text
    with pytest.raises(SandboxNotRunningException):
        a.files.read("mine.txt")


def test_the_daemon_keeps_an_idle_connection_longer_than_the_sdk_pools_it():
    """The SDK keeps an idle connection in its pool for `pool_idle_timeout`
    and reuses it until then. Were the daemon's idle timeout shorter, a
    request could meet the daemon closing that connection, and the SDK's
    retry of a failed send replays a multipart body it already consumed:
    the daemon reads a form that ends early (seen as a flaky `400
    malformed form: incomplete multipart stream`)."""
    import re
    import subprocess

    import e2b.api
    from conftest import BIN

    help_text = subprocess.run([str(BIN), "serve", "--help"], capture_output=True, text=True, check=True).stdout
    flag = help_text[help_text.index("--idle-timeout"):]
    value, unit = re.search(r"\[default: (\d+)(s|m)\]", flag).groups()
    idle_s = int(value) * (60 if unit == "m" else 1)
    assert idle_s > e2b.api.pool_idle_timeout, (idle_s, e2b.api.pool_idle_timeout)
