"""Directory watches: the sync SDK polls a watcher, the async SDK streams."""

import asyncio
import time

import pytest
from e2b import AsyncSandbox, FilesystemEventType, NotFoundException, SandboxException


def poll_events(handle, want, timeout=10.0):
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen.extend(handle.get_new_events())
        if want(seen):
            return seen
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for watch events; saw {seen!r}")


def test_watch_dir_polled_sees_create_write_remove(shared):
    shared.files.make_dir("watched")
    handle = shared.files.watch_dir("watched")
    shared.files.write("watched/f.txt", "one")
    seen = poll_events(handle, lambda s: any(e.name == "f.txt" and e.type == FilesystemEventType.CREATE for e in s))
    # The upload's temporary file is not reported.
    assert all(e.name == "f.txt" for e in seen), seen
    shared.commands.run("echo two >> /home/user/watched/f.txt")
    poll_events(handle, lambda s: any(e.name == "f.txt" and e.type == FilesystemEventType.WRITE for e in s))
    shared.files.remove("watched/f.txt")
    poll_events(handle, lambda s: any(e.name == "f.txt" and e.type == FilesystemEventType.REMOVE for e in s))
    handle.stop()
    with pytest.raises(SandboxException):
        handle.get_new_events()


def test_watch_dir_recursive_names_relative_paths(shared):
    shared.files.make_dir("rwatch/sub")
    handle = shared.files.watch_dir("rwatch", recursive=True)
    try:
        shared.files.write("rwatch/sub/deep.txt", "x")
        poll_events(handle, lambda s: any(e.name == "sub/deep.txt" for e in s))
    finally:
        handle.stop()


def test_watch_dir_missing_is_not_found(shared):
    with pytest.raises(NotFoundException):
        shared.files.watch_dir("no/such/dir")


async def test_async_watch_dir_streams_events(daemon):
    sb = await AsyncSandbox.create()
    try:
        await sb.files.make_dir("w")
        got, exited = [], []
        handle = await sb.files.watch_dir("w", on_event=got.append, on_exit=exited.append)
        await sb.files.write("w/a.txt", "hi")
        await sb.commands.run("echo more >> /home/user/w/a.txt && chmod 600 /home/user/w/a.txt"
                              " && mv /home/user/w/a.txt /home/user/w/b.txt")
        deadline = time.monotonic() + 10
        # A move shows as rename of the old name and create of the new one,
        # as E2B's envd (fsnotify) reports it.
        want = {FilesystemEventType.CREATE, FilesystemEventType.WRITE, FilesystemEventType.CHMOD,
                FilesystemEventType.RENAME}

        def seen_all():
            return (want <= {e.type for e in got}
                    and any(e.name == "b.txt" and e.type == FilesystemEventType.CREATE for e in got))

        # The events arrive one message at a time: wait for the last of them,
        # not for the first one of each type.
        while not seen_all() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert want <= {e.type for e in got}, got
        assert any(e.name == "b.txt" and e.type == FilesystemEventType.CREATE for e in got), got
        assert any(e.name == "a.txt" and e.type == FilesystemEventType.RENAME for e in got), got
        await handle.stop()
        assert exited == [None]
    finally:
        await sb.kill()
