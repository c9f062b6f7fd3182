"""Parts of the SDK that need no daemon: durations, the error classes,
archives both ways, the event decoder, and the async client mirroring the
sync one method for method."""

from __future__ import annotations

import inspect
import io
import os
import tarfile
from datetime import timedelta
from pathlib import Path

import pytest

import hutch
from hutch import _async, _sync
from hutch._archive import TarExtractor, UnsafeArchiveError, tar_chunks
from hutch._core import EventDecoder
from hutch._duration import whole_seconds
from hutch._errors import error_for, error_from_answer


@pytest.mark.parametrize(
    "given, seconds",
    [(600, 600), (1.2, 2), ("90", 90), ("90s", 90), ("10m", 600), ("1h30m", 5400), ("2d", 172800),
     ("1.5m", 90), ("500ms", 1), (timedelta(minutes=3), 180), (" 10 m ", 600)],
)
def test_durations_take_seconds_and_strings(given, seconds):
    assert whole_seconds(given) == seconds


@pytest.mark.parametrize("bad", ["", "ten minutes", "10x", "-5", -1, "m10", True, None, "1h-5m"])
def test_bad_durations_are_refused(bad):
    with pytest.raises(ValueError):
        whole_seconds(bad)


def test_every_code_maps_to_its_family_and_unknown_codes_to_the_base():
    e = error_from_answer(404, b'{"error": "no such sandbox", "code": "not_found"}')
    assert isinstance(e, hutch.NotFoundError) and e.code == "not_found" and e.status == 404
    assert e.message == "no such sandbox"
    e = error_from_answer(409, b'{"error": "the key ran", "code": "execution_outcome_unknown"}')
    assert isinstance(e, hutch.IdempotencyError)
    e = error_from_answer(418, b'{"error": "new", "code": "brand_new_code"}')
    assert type(e) is hutch.HutchError and e.code == "brand_new_code" and e.status == 418
    e = error_from_answer(502, b"<html>bad gateway</html>")
    assert type(e) is hutch.HutchError and e.code == "http_502"
    assert isinstance(error_for("sandbox_archive_invalid", "x"), hutch.FileError)
    assert isinstance(error_for("quota_exceeded", "x"), hutch.CapacityError)


def test_every_documented_code_has_a_family():
    """docs/api.md's table of codes: each one maps to a class below the base."""
    doc = (Path(__file__).resolve().parents[3] / "docs" / "api.md").read_text()
    table = doc.split("## Error codes", 1)[1]
    codes = [line.split("`")[1] for line in table.splitlines() if line.startswith("| `")]
    assert len(codes) > 30, codes
    for code in codes:
        assert type(error_for(code, "m")) is not hutch.HutchError, f"{code} has no family"


def _tree(root: Path) -> dict:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        out[rel] = None if p.is_dir() else p.read_bytes()
    return out


def test_tar_chunks_are_read_by_tarfile_and_by_the_extractor(tmp_path: Path):
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "empty").mkdir()
    (src / "a" / "b" / ("long-" * 40 + ".txt")).write_bytes(b"x" * 1000)
    (src / "bin").write_bytes(bytes(range(256)) * 300)
    (src / "zero").write_bytes(b"")
    data = b"".join(tar_chunks(src))
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        names = t.getnames()
    assert "a/b/" + "long-" * 40 + ".txt" in names and "empty" in names
    for size in (1, 511, 512, 4096, len(data)):
        dest = tmp_path / f"out-{size}"
        ex = TarExtractor(dest)
        for i in range(0, len(data), size):
            ex.feed(data[i : i + size])
        ex.finish()
        assert _tree(dest) == _tree(src)


def test_a_cut_archive_leaves_nothing(tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"y" * 5000)
    data = b"".join(tar_chunks(src))
    dest = tmp_path / "dest"
    ex = TarExtractor(dest)
    ex.feed(data[:3000])
    with pytest.raises(hutch.TransferIncompleteError) as e:
        ex.finish()
    assert e.value.code == "transfer_incomplete"
    assert not dest.exists() and list(tmp_path.iterdir()) == [src]


def _tar(*members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        for name, kind, payload in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind == tarfile.SYMTYPE:
                info.linkname = payload
                t.addfile(info)
            else:
                info.size = len(payload)
                t.addfile(info, io.BytesIO(payload))
    return buf.getvalue()


@pytest.mark.parametrize("name", ["../evil", "/etc/evil", "a/../../evil"])
def test_extraction_refuses_names_outside_the_target(tmp_path: Path, name: str):
    ex = TarExtractor(tmp_path / "d")
    with pytest.raises(UnsafeArchiveError):
        ex.feed(_tar((name, tarfile.REGTYPE, b"x")))
    ex.abort()
    assert not (tmp_path / "evil").exists() and not (tmp_path / "d").exists()


def test_extraction_never_writes_through_a_symlink(tmp_path: Path):
    outside = tmp_path / "outside"
    outside.mkdir()
    ex = TarExtractor(tmp_path / "d")
    ex.feed(_tar(("link", tarfile.SYMTYPE, str(outside)), ("inner", tarfile.SYMTYPE, "../../outside"),
                 ("ok", tarfile.SYMTYPE, "sub/f")))
    res = ex.finish()
    assert list(outside.iterdir()) == []
    assert sorted(s.split(" ")[0] for s in res.skipped) == ["inner", "link"]
    assert os.readlink(tmp_path / "d" / "ok") == "sub/f"
    ex = TarExtractor(tmp_path / "e")
    with pytest.raises(UnsafeArchiveError):
        ex.feed(_tar(("ok", tarfile.SYMTYPE, "."), ("ok/f", tarfile.REGTYPE, b"x")))
    ex.abort()


def test_stream_events_decode_across_chunks_and_a_missing_exit_is_an_error():
    lines = (b'{"type":"start","pid":7}\n{"type":"stdout","data":"a\\n"}\n{"type":"ping"}\n'
             b'{"type":"stderr","data":"b"}\n{"type":"exit","exit_code":3,"timed_out":false,"duration_ms":5}\n')
    for size in (1, 7, len(lines)):
        dec = EventDecoder()
        evs = []
        for i in range(0, len(lines), size):
            evs += dec.feed(lines[i : i + size])
        evs += dec.end()
        assert [e.type for e in evs] == ["start", "stdout", "stderr", "exit"]
        assert dec.pid == 7 and dec.exit is not None and dec.exit.exit_code == 3
    dec = EventDecoder()
    dec.feed(b'{"type":"start","pid":7}\n')
    with pytest.raises(hutch.TransferIncompleteError, match="process 7"):
        dec.end()
    with pytest.raises(hutch.CapacityError) as e:
        EventDecoder().feed(b'{"type":"error","code":"sandbox_command_capacity","error":"full"}\n')
    assert e.value.code == "sandbox_command_capacity"


PAIRS = [
    (_sync.Hutch, _async.AsyncHutch),
    (_sync.Sandboxes, _async.AsyncSandboxes),
    (_sync.Sandbox, _async.AsyncSandbox),
    (_sync.Process, _async.AsyncProcess),
    (_sync.ExecStream, _async.AsyncExecStream),
    (_sync.Files, _async.AsyncFiles),
    (_sync.Access, _async.AsyncAccess),
    (_sync.Templates, _async.AsyncTemplates),
    (_sync.Builds, _async.AsyncBuilds),
    (_sync.Images, _async.AsyncImages),
    (_sync.Keys, _async.AsyncKeys),
]


@pytest.mark.parametrize("sync_cls, async_cls", PAIRS, ids=[p[0].__name__ for p in PAIRS])
def test_the_async_client_mirrors_the_sync_one(sync_cls, async_cls):
    def public(cls):
        return {n: m for n, m in vars(cls).items() if not n.startswith("_") and callable(m)}

    s, a = public(sync_cls), public(async_cls)
    assert set(s) == set(a), (set(s) ^ set(a))
    for name in s:
        sp = list(inspect.signature(s[name]).parameters)
        ap = list(inspect.signature(a[name]).parameters)
        assert sp == ap, f"{sync_cls.__name__}.{name}: {sp} != {ap}"


def test_the_client_reads_its_url_and_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("HUTCH_URL", "http://example.invalid:1234/")
    monkeypatch.setenv("HUTCH_API_KEY", "hutch_k")
    c = hutch.Hutch()
    assert c.base_url == "http://example.invalid:1234" and c.config.api_key == "hutch_k"
    c.close()
    monkeypatch.delenv("HUTCH_API_KEY")
    with pytest.raises(hutch.HutchError) as e:
        hutch.Hutch()
    assert e.value.code == "no_api_key"


def test_requests_skip_the_client_machinery_only_when_nothing_needs_it(monkeypatch):
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    with hutch.Hutch("http://127.0.0.1:9", "k") as c:
        assert c._transport.requests.direct and c._transport.fast is not None
    with hutch.Hutch("https://127.0.0.1:9", "k") as c:
        assert c._transport.requests.direct and c._transport.fast is None
    # A proxy named by the environment: through httpx.Client, which reads it.
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    with hutch.Hutch("http://127.0.0.1:9", "k") as c:
        assert not c._transport.requests.direct and c._transport.fast is None
    monkeypatch.delenv("HTTPS_PROXY")
    # A client passed in is used whole, and left open.
    import httpx

    with httpx.Client() as h:
        c = hutch.Hutch("http://127.0.0.1:9", "k", http_client=h)
        assert not c._transport.requests.direct and c._transport.fast is None and c._transport.http is h
        c.close()
        assert not h.is_closed


def test_a_small_request_leaves_in_one_send_and_a_large_one_as_it_is_made():
    from hutch import _net

    class Inner:
        def __init__(self):
            self.sent = []

        def write(self, data, timeout=None):
            self.sent.append(data)

        def read(self, n, timeout=None):
            return b"answer"

    inner = Inner()
    s = _net.CoalescingStream(inner)
    s.write(b"POST / HTTP/1.1\r\n\r\n")
    s.write(b'{"command":"true"}')
    assert inner.sent == []
    assert s.read(100) == b"answer"
    assert inner.sent == [b'POST / HTTP/1.1\r\n\r\n{"command":"true"}']
    inner.sent.clear()
    chunk = b"x" * (_net.FLUSH_AT // 2)
    for _ in range(4):
        s.write(chunk)
    assert [len(x) for x in inner.sent] == [_net.FLUSH_AT, _net.FLUSH_AT]
    t = hutch.Hutch("http://127.0.0.1:9", "k")
    assert isinstance(t._transport.transport._pool._network_backend, _net.CoalescingBackend)
    t.close()


@pytest.mark.parametrize("base", ["http://127.0.0.1:7700", "https://hutch.example/prefix", "http://[::1]:8080"])
def test_call_urls_are_the_ones_parsing_would_give(base: str):
    import httpx
    from hutch._core import Urls

    urls = Urls(base)
    for path in ["/v1/sandboxes", "/v1/sandboxes/sb-1/files/list", "/v1/templates/a%2Fb/builds"]:
        made = httpx.Request("GET", urls.url(path), params={"path": "/x y"}).url
        assert made == httpx.Request("GET", base + path, params={"path": "/x y"}).url


@pytest.mark.parametrize(
    "answer, method, expected",
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi", "GET", (200, b"hi", True)),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n3;x=y\r\n yo\r\n0\r\nT: 1\r\n\r\n",
         "GET", (200, b"hi yo", True)),
        (b"HTTP/1.1 204 No Content\r\n\r\n", "DELETE", (204, b"", True)),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\nx", "GET", (200, b"x", False)),
        (b"HTTP/1.1 200 OK\r\n\r\nuntil the end", "GET", (200, b"until the end", False)),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nx", "GET", (200, b"x", False)),
    ],
)
async def test_the_async_fast_path_reads_every_answer_shape(answer, method, expected):
    import asyncio

    from hutch._fast import AsyncFastHttp

    r = asyncio.StreamReader()
    r.feed_data(answer)
    r.feed_eof()
    status, headers, content, keep = await AsyncFastHttp._answer(r, method)
    assert (status, content, keep) == expected
