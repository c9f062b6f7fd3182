"""Files through /files and the filesystem service."""

import os

import pytest
from e2b import FileType, NotFoundException


def test_write_read_text_and_bytes(shared):
    info = shared.files.write("notes/a.txt", "hello")
    assert info.path == "/home/user/notes/a.txt"
    assert shared.files.read("notes/a.txt") == "hello"
    shared.files.write("/tmp/b.bin", b"\x00\x01\xff")
    assert bytes(shared.files.read("/tmp/b.bin", format="bytes")) == b"\x00\x01\xff"


def test_write_many(shared):
    infos = shared.files.write_files([{"path": "many/x", "data": "1"}, {"path": "many/y", "data": b"2"}])
    assert sorted(i.name for i in infos) == ["x", "y"]
    assert shared.files.read("many/y") == "2"


def test_read_missing_is_not_found(shared):
    with pytest.raises(NotFoundException):
        shared.files.read("/nope/nothing")


def test_list_depth_exists_info(shared):
    shared.files.write("tree/a/b/c.txt", "c")
    top = shared.files.list("tree")
    assert [e.name for e in top] == ["a"] and top[0].type == FileType.DIR
    deep = shared.files.list("tree", depth=3)
    assert {e.path for e in deep} == {"/home/user/tree/a", "/home/user/tree/a/b", "/home/user/tree/a/b/c.txt"}
    assert shared.files.exists("tree/a/b/c.txt")
    assert not shared.files.exists("tree/zzz")
    info = shared.files.get_info("tree/a/b/c.txt")
    assert info.size == 1 and info.type == FileType.FILE and info.owner == "user"


def test_make_dir_rename_remove(shared):
    assert shared.files.make_dir("made/sub") is True
    assert shared.files.make_dir("made/sub") is False
    shared.files.write("made/sub/f", "x")
    moved = shared.files.rename("made/sub/f", "made/g")
    assert moved.path == "/home/user/made/g"
    assert shared.files.read("made/g") == "x"
    shared.files.remove("made")
    assert not shared.files.exists("made")


def test_gzip_and_streamed_uploads_round_trip(shared):
    # gzip implies the octet-stream upload; the daemon inflates it as it
    # streams it into the sandbox.
    data = os.urandom(3 << 20) + bytes(5 << 20)
    info = shared.files.write("up/gz.bin", data, gzip=True)
    assert info.path == "/home/user/up/gz.bin"
    assert bytes(shared.files.read("up/gz.bin", format="bytes")) == data
    # An iterable goes as a streamed octet-stream body.
    parts = [bytes([i]) * (1 << 20) for i in range(6)]
    shared.files.write("up/stream.bin", iter(parts))
    assert bytes(shared.files.read("up/stream.bin", format="bytes", gzip=True)) == b"".join(parts)
    # A multipart form of several files.
    infos = shared.files.write_files([{"path": f"up/m{i}", "data": parts[i]} for i in range(3)])
    assert sorted(i.name for i in infos) == ["m0", "m1", "m2"]
    assert bytes(shared.files.read("up/m2", format="bytes")) == parts[2]
