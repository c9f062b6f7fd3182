"""What the sync and the async client share: configuration, the description of
one HTTP call (`Call`), request bodies, the retry rule, error answers and the
incremental decoders of streamed answers. Nothing here does IO; `_sync.py`
and `_async.py` each drive the same calls with their own httpx client.
"""

from __future__ import annotations

import codecs
import json
import os
import random
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import (
    Any,
    AsyncIterable,
    AsyncIterator,
    BinaryIO,
    Callable,
    Dict,
    Generic,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Tuple,
    TypeVar,
    Union,
)
from urllib.parse import quote

import httpx

from . import models
from ._duration import Duration, parse_duration
from ._errors import HutchConnectionError, HutchError, HutchTimeoutError, error_for, error_from_answer
from ._version import __version__

T = TypeVar("T")

DEFAULT_URL = "http://127.0.0.1:7700"
#: Bytes of a streamed upload or download handed over at a time.
CHUNK = 1 << 20
#: Most bytes of an error answer read (its JSON body is small).
ERROR_BODY_CAP = 64 << 10


# --------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class Config:
    base_url: str
    api_key: Optional[str]
    #: Seconds: connect, send, wait for a pooled connection, and wait for the
    #: answer of ordinary calls. Commands wait as long as they may run.
    timeout: float
    #: Connection errors retried (only where it is safe, see `retry_delay`).
    max_retries: int
    #: First backoff in seconds, doubled each retry up to `backoff_max`, with jitter.
    backoff: float = 0.2
    backoff_max: float = 5.0

    @classmethod
    def make(
        cls,
        base_url: Optional[str],
        api_key: Optional[str],
        timeout: Duration,
        max_retries: int,
    ) -> "Config":
        url = base_url or os.environ.get("HUTCH_URL") or DEFAULT_URL
        key = api_key if api_key is not None else os.environ.get("HUTCH_API_KEY")
        if not key:
            raise HutchError(
                "no API key: pass api_key= or set HUTCH_API_KEY (the daemon's admin key is in "
                "<state-dir>/admin.key; `hutch key create` makes others)",
                code="no_api_key",
            )
        if max_retries < 0:
            raise ValueError("max_retries must be 0 or more")
        return cls(base_url=url.rstrip("/"), api_key=key, timeout=parse_duration(timeout, "timeout"),
                   max_retries=max_retries)

    def headers(self) -> Dict[str, str]:
        h = {"User-Agent": f"hutch-python/{__version__}", "Accept": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def httpx_timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.timeout)


def env_proxies() -> bool:
    """Whether the environment names an HTTP(S) proxy (as httpx reads it)."""
    proxies = urllib.request.getproxies()
    return any(k in proxies for k in ("http", "https", "all"))


class RequestBuilder:
    """Turns a `Call` into an `httpx.Request`: the same for both clients.

    With a client the SDK made itself, requests skip `httpx.Client.send`'s
    per-request machinery (auth flows, redirects, cookie jars, event hooks;
    none of it is used, and it costs about 0.1 ms a call) and go straight to
    the client's transport, unless the environment names a proxy. A client
    passed in (`http_client=`) is always used whole."""

    def __init__(self, config: Config, own_client: bool):
        self.config = config
        self.base = config.base_url
        self.urls = Urls(config.base_url)
        self.headers = config.headers()
        self.default_timeout = config.httpx_timeout().as_dict()
        self.direct = own_client and not env_proxies()

    def timeout(self, call: "Call[Any]") -> Dict[str, Optional[float]]:
        if call.read_timeout is DEFAULT_TIMEOUT:
            return self.default_timeout
        return httpx.Timeout(self.config.timeout, read=call.read_timeout).as_dict()

    def headers_of(self, call: "Call[Any]") -> Dict[str, str]:
        """The SDK's headers (key, user agent) and the call's own."""
        headers = dict(self.headers)
        headers.update(call.request_headers())
        return headers

    def build(self, call: "Call[Any]", content: Any) -> httpx.Request:
        return httpx.Request(call.method, self.urls.url(call.path), params=call.params,
                             headers=self.headers_of(call), content=content, extensions={"timeout": self.timeout(call)})


class Urls:
    """The URL of a call: the base URL is parsed once and each call's path
    (already percent-encoded, see `seg`) is put after its path, instead of
    parsing the whole URL again for every request (about half of what
    building an `httpx.Request` costs). Where this httpx keeps its parsed
    URL otherwise, or the result would differ, URLs are parsed as usual."""

    PROBE = "/v1/sandboxes/sb-x%2Fy/exec"

    def __init__(self, base: str):
        self.base = base
        self._ref: Any = None
        try:
            ref = httpx.URL(base)._uri_reference
            self._ref = ref
            if str(self.url(self.PROBE)) != str(httpx.URL(base + self.PROBE)):
                self._ref = None
        except Exception:  # noqa: BLE001 - any surprise: parse as usual
            self._ref = None

    def url(self, path: str) -> Union[str, httpx.URL]:
        if self._ref is None:
            return self.base + path
        url = httpx.URL.__new__(httpx.URL)
        url._uri_reference = self._ref._replace(path=self._ref.path + path)
        return url


# --------------------------------------------------------------------------
# Request bodies


class Body:
    """A request body: bytes, chunks from a factory (a local file reopened, a
    directory packed again), or a one-shot (async) iterator.

    `replayable` tells whether a retry can send it again; a one-shot
    iterator is retried only when it was never touched."""

    def __init__(
        self,
        *,
        data: Optional[bytes] = None,
        factory: Optional[Callable[[], Iterator[bytes]]] = None,
        once: Optional[Iterator[bytes]] = None,
        aonce: Optional[AsyncIterable[bytes]] = None,
        content_type: str = "application/octet-stream",
        length: Optional[int] = None,
    ):
        self.data = data
        self.factory = factory
        self.once = once
        self.aonce = aonce
        self.content_type = content_type
        self.length = len(data) if data is not None else length
        self.started = False

    @property
    def one_shot(self) -> bool:
        return self.once is not None or self.aonce is not None

    @property
    def replayable(self) -> bool:
        return not self.one_shot or not self.started

    def chunks(self) -> Iterator[bytes]:
        if self.aonce is not None:
            raise TypeError("an async iterable body needs the async client")
        self.started = True
        if self.data is not None:
            yield self.data
        elif self.factory is not None:
            yield from self.factory()
        elif self.once is not None:
            yield from self.once

    async def achunks(self) -> AsyncIterator[bytes]:
        # Local files and generated archives are read in chunks between
        # sends; each read is short.
        if self.aonce is not None:
            self.started = True
            async for chunk in self.aonce:
                yield chunk
            return
        for chunk in self.chunks():
            yield chunk


def json_body(obj: Any) -> Body:
    return Body(data=json.dumps(obj, separators=(",", ":")).encode(), content_type="application/json")


def file_chunks(f: BinaryIO, chunk: int = CHUNK) -> Iterator[bytes]:
    while True:
        b = f.read(chunk)
        if not b:
            return
        yield b


def local_file_body(path: "os.PathLike[str] | str", content_type: str = "application/octet-stream") -> Body:
    def factory() -> Iterator[bytes]:
        with open(path, "rb") as f:
            yield from file_chunks(f)

    return Body(factory=factory, content_type=content_type, length=os.path.getsize(path))


def data_body(data: Any, content_type: str = "application/octet-stream") -> Body:
    """A raw body from bytes, str (UTF-8), a binary file (seekable ones are
    replayable from where they stood) or an iterable of bytes."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return Body(data=bytes(data), content_type=content_type)
    if isinstance(data, str):
        return Body(data=data.encode(), content_type=content_type)
    if hasattr(data, "read"):
        f = data
        try:
            start = f.tell() if f.seekable() else None
        except (OSError, ValueError):
            start = None
        if start is not None:

            def factory() -> Iterator[bytes]:
                f.seek(start)
                yield from file_chunks(f)

            return Body(factory=factory, content_type=content_type)
        return Body(once=file_chunks(f), content_type=content_type)
    if hasattr(data, "__aiter__"):
        return Body(aonce=data, content_type=content_type)
    if isinstance(data, Iterable):
        return Body(once=iter(data), content_type=content_type)
    raise TypeError(f"expected bytes, str, a binary file or an iterable of bytes, got {type(data).__name__}")


# --------------------------------------------------------------------------
# Calls


#: Sentinel: the call uses the client's timeout.
DEFAULT_TIMEOUT: Any = object()


@dataclass
class Reply:
    """An answer read whole (ordinary calls)."""

    status: int
    headers: Mapping[str, str]
    content: bytes

    def json(self) -> Any:
        return json.loads(self.content)


@dataclass
class Call(Generic[T]):
    """One HTTP call of the API: what to send, whether it may be sent again
    after it may have reached the daemon, and how to read its answer."""

    method: str
    path: str
    parse: Callable[[Reply], T]
    params: Optional[Dict[str, str]] = None
    body: Optional[Body] = None
    headers: Dict[str, str] = field(default_factory=dict)
    #: Safe to send again after it may have reached the daemon: reads,
    #: deletes, replacing writes, and anything with an Idempotency-Key.
    resend: bool = False
    #: Seconds to wait for the answer; None waits as long as it takes;
    #: DEFAULT_TIMEOUT is the client's.
    read_timeout: Any = DEFAULT_TIMEOUT
    #: Answered by a stream read as it comes (see `_sync`/`_async`).
    stream: bool = False

    def request_headers(self) -> Dict[str, str]:
        if self.body is None:
            return self.headers
        h = dict(self.headers)
        h["Content-Type"] = self.body.content_type
        if self.body.length is not None:
            h["Content-Length"] = str(self.body.length)
        return h


def seg(value: Union[str, int]) -> str:
    """One path segment, percent-encoded."""
    return quote(str(value), safe="")


def idempotency_headers(key: Optional[str]) -> Dict[str, str]:
    return {"Idempotency-Key": key or new_idempotency_key()}


def new_idempotency_key() -> str:
    return "py-" + uuid.uuid4().hex


def query(**params: Any) -> Dict[str, str]:
    """Query parameters without the None ones; booleans as true/false."""
    out = {}
    for k, v in params.items():
        if v is None:
            continue
        out[k] = ("true" if v else "false") if isinstance(v, bool) else str(v)
    return out


def no_content(_: Reply) -> None:
    return None


def as_json(reply: Reply) -> Any:
    return reply.json()


# --------------------------------------------------------------------------
# Retries


def retry_delay(call: Call[Any], exc: Exception, attempt: int, config: Config) -> Optional[float]:
    """Seconds to wait before sending `call` again after `exc`, or None to give up.

    A connection that failed to open sent nothing: any call may go again. A
    connection that broke after the request went out may have run it: only a
    call marked `resend` goes again (reads, deletes, replacing writes, and
    creates and commands, whose Idempotency-Key makes the daemon replay the
    first outcome instead of running them twice). Timeouts are not retried:
    the caller's deadline has passed. A body is sent again only if it can
    be replayed."""
    if attempt >= config.max_retries:
        return None
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)):
        pass
    elif isinstance(exc, httpx.TimeoutException):
        return None
    elif isinstance(exc, (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)):
        if not call.resend:
            return None
    else:
        return None
    if call.body is not None and not call.body.replayable:
        return None
    base = min(config.backoff_max, config.backoff * float(1 << attempt))
    return base * (0.5 + random.random() / 2)


def transport_error(exc: Exception, call: Call[Any]) -> HutchError:
    what = f"{call.method} {call.path}"
    if isinstance(exc, httpx.TimeoutException):
        err: HutchError = HutchTimeoutError(f"{what}: no answer in time ({exc})", code="timeout")
    else:
        err = HutchConnectionError(f"{what}: {exc or type(exc).__name__}", code="connection_error")
    err.__cause__ = exc
    return err


def answer_error(status: int, content: bytes) -> HutchError:
    return error_from_answer(status, content)


# --------------------------------------------------------------------------
# Streamed answers


class LineDecoder:
    """Splits a byte stream into lines (without their newline)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> List[bytes]:
        self._buf += chunk
        if b"\n" not in chunk:
            return []
        *lines, rest = bytes(self._buf).split(b"\n")
        self._buf = bytearray(rest)
        return lines

    def rest(self) -> bytes:
        out, self._buf = bytes(self._buf), bytearray()
        return out


def parse_event(line: bytes) -> Optional[models.ExecEvent]:
    """One NDJSON line of a command stream; an `error` event raises."""
    if not line.strip():
        return None
    d = json.loads(line)
    kind = d.get("type")
    if kind == "stdout":
        return models.StdoutEvent(d.get("data", ""))
    if kind == "stderr":
        return models.StderrEvent(d.get("data", ""))
    if kind == "start":
        return models.StartEvent(d["pid"])
    if kind == "exit":
        return models.ExitEvent(
            exit_code=d["exit_code"],
            timed_out=bool(d.get("timed_out", False)),
            duration_ms=d.get("duration_ms", 0),
            oom_killed=bool(d.get("oom_killed", False)),
            descendants_alive=bool(d.get("descendants_alive", False)),
        )
    if kind == "ping":
        return models.PingEvent()
    if kind == "error":
        raise error_for(str(d.get("code", "internal")), str(d.get("error", "")), None, d)
    return models.UnknownEvent(type=str(kind), raw=d)


class EventDecoder:
    """Command-stream events out of NDJSON bytes, remembering the pid and
    the exit so a consumer can tell a finished stream from a cut one."""

    def __init__(self, pings: bool = False) -> None:
        self._lines = LineDecoder()
        self._pings = pings
        self.pid: Optional[int] = None
        self.exit: Optional[models.ExitEvent] = None

    def feed(self, chunk: bytes) -> List[models.ExecEvent]:
        return self._events(self._lines.feed(chunk))

    def end(self) -> List[models.ExecEvent]:
        events = self._events([self._lines.rest()])
        if self.exit is None:
            from ._errors import TransferIncompleteError

            where = f" (reattach with process {self.pid}'s stream)" if self.pid is not None else ""
            raise TransferIncompleteError(
                f"the command's stream ended before its exit event{where}", code="transfer_incomplete"
            )
        return events

    def _events(self, lines: List[bytes]) -> List[models.ExecEvent]:
        out: List[models.ExecEvent] = []
        for line in lines:
            ev = parse_event(line)
            if ev is None:
                continue
            if isinstance(ev, models.StartEvent):
                self.pid = ev.pid
            elif isinstance(ev, models.ExitEvent):
                self.exit = ev
            elif isinstance(ev, models.PingEvent) and not self._pings:
                continue
            out.append(ev)
        return out


class TextLines:
    """UTF-8 lines out of chunks (a character split between chunks is kept)."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self._rest = ""

    def feed(self, chunk: bytes) -> List[str]:
        text = self._rest + self._dec.decode(chunk)
        *lines, self._rest = text.split("\n")
        return lines

    def end(self) -> List[str]:
        text = self._rest + self._dec.decode(b"", final=True)
        self._rest = ""
        return [text] if text else []


def exec_result(events: List[models.ExecEvent], exit: Optional[models.ExitEvent]) -> models.ExecResult:
    """A stream's events folded into a result (output not capped)."""
    assert exit is not None
    out = "".join(e.data for e in events if isinstance(e, models.StdoutEvent))
    err = "".join(e.data for e in events if isinstance(e, models.StderrEvent))
    return models.ExecResult(
        stdout=out, stderr=err, exit_code=exit.exit_code, timed_out=exit.timed_out, oom_killed=exit.oom_killed,
        descendants_alive=exit.descendants_alive, duration_ms=exit.duration_ms,
    )
