"""The path of small calls: keep-alive connections without httpx.

A call whose body is in memory and whose answer is read whole (a command,
a create, a read of a sandbox: most calls) is sent by the sync client with
the standard library's http.client, and by the async one on asyncio
streams, each request in one write. httpx, httpcore and h11 spend about
three times as much CPU on the same request (bench/sdk_bench.py). Streams,
uploads and downloads, https, proxies, a client passed in (`http_client=`)
and an async client under trio go through httpx as before.

Failures are raised as the httpx exceptions the retry rule (`retry_delay`)
reads: a connection that could not be made is `ConnectError` /
`ConnectTimeout`; one that broke while the request was sent or the answer
read is `WriteError` / `ReadError` / `RemoteProtocolError` (the call may
have run); no answer in time is `ReadTimeout`. An idle connection the
daemon closed is seen (its socket is readable) and dropped before use.
"""

from __future__ import annotations

import asyncio
import http.client
import re
import select
import socket
import threading
from typing import Dict, List, Mapping, Optional
from urllib.parse import urlencode, urlsplit

import httpx

from ._core import ERROR_BODY_CAP, Reply

#: What may not be in a header's name or value (as http.client refuses).
_BAD_HEADER = re.compile(r"[^!#$%&'*+\-.^_`|~0-9A-Za-z]")
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")

#: Idle connections kept for reuse.
KEEP = 20


class FastHttp:
    def __init__(self, base_url: str, headers: Mapping[str, str], connect_timeout: float):
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError("the fast path serves http:// only")
        self.host = u.hostname
        self.port = u.port or 80
        self.prefix = u.path.rstrip("/")
        self.headers = dict(headers)
        self.connect_timeout = connect_timeout
        self._idle: List[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    @staticmethod
    def serves(base_url: str) -> bool:
        u = urlsplit(base_url)
        return u.scheme == "http" and bool(u.hostname) and not u.query and not u.fragment

    def _take(self) -> Optional[http.client.HTTPConnection]:
        """An idle connection the daemon has not closed (nothing to read on
        an idle connection but its end), or None."""
        while True:
            with self._lock:
                if not self._idle:
                    return None
                conn = self._idle.pop()
            sock = conn.sock
            try:
                if sock is not None and not select.select([sock], [], [], 0)[0]:
                    return conn
            except (OSError, ValueError):
                pass
            conn.close()

    def _give(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < KEEP:
                self._idle.append(conn)
                return
        conn.close()

    def _connect(self) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.connect_timeout)
        try:
            conn.connect()  # sets TCP_NODELAY
        except socket.timeout as e:
            conn.close()
            raise httpx.ConnectTimeout(f"connect to {self.host}:{self.port}: {e}") from e
        except OSError as e:
            conn.close()
            raise httpx.ConnectError(f"connect to {self.host}:{self.port}: {e}") from e
        return conn

    def request(self, method: str, path: str, params: Optional[Mapping[str, str]], headers: Mapping[str, str],
                body: Optional[bytes], read_timeout: Optional[float]) -> Reply:
        target = self.prefix + path
        if params:
            target += "?" + urlencode(params)
        h = dict(self.headers)
        h.update(headers)
        conn = self._take() or self._connect()
        ok = False
        try:
            sock = conn.sock
            assert sock is not None
            sock.settimeout(self.connect_timeout)
            try:
                conn.request(method, target, body=body, headers=h)
            except socket.timeout as e:
                raise httpx.WriteTimeout(f"{method} {path}: sending: {e}") from e
            except (OSError, http.client.HTTPException) as e:
                raise httpx.WriteError(f"{method} {path}: sending: {e}") from e
            sock.settimeout(read_timeout)
            try:
                resp = conn.getresponse()
                if resp.status >= 400:
                    content = resp.read(ERROR_BODY_CAP)
                else:
                    content = resp.read()
            except socket.timeout as e:
                raise httpx.ReadTimeout(f"{method} {path}: no answer in time: {e}") from e
            except http.client.RemoteDisconnected as e:
                raise httpx.RemoteProtocolError(f"{method} {path}: the connection closed: {e}") from e
            except (OSError, http.client.HTTPException) as e:
                raise httpx.ReadError(f"{method} {path}: reading the answer: {e}") from e
            ok = resp.isclosed() and not resp.will_close
            return Reply(resp.status, _headers(resp.headers), content)
        finally:
            if ok:
                self._give(conn)
            else:
                conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _headers(message: "http.client.HTTPMessage") -> Dict[str, str]:
    return {k.lower(): v for k, v in message.items()}


# --------------------------------------------------------------------------
# The async client's: the same on asyncio streams (under another event loop,
# trio, the async client stays on httpx).


class _Conn:
    def __init__(self, loop: asyncio.AbstractEventLoop, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter):
        self.loop = loop
        self.reader = reader
        self.writer = writer

    def usable(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Of this loop, open, and with nothing to read (an idle
        connection's only news is its end)."""
        if self.loop is not loop or self.writer.is_closing() or self.reader.at_eof():
            return False
        sock = self.writer.get_extra_info("socket")
        try:
            return sock is not None and not select.select([sock], [], [], 0)[0]
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        try:
            self.writer.close()
        except RuntimeError:  # its loop is closed: the socket goes with it
            pass


class AsyncFastHttp:
    def __init__(self, base_url: str, headers: Mapping[str, str], connect_timeout: float):
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError("the fast path serves http:// only")
        self.host = u.hostname
        self.port = u.port or 80
        self.prefix = u.path.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        authority = host if self.port == 80 else f"{host}:{self.port}"
        head = {"Host": authority}
        head.update(headers)
        self.head = head
        self.connect_timeout = connect_timeout
        self._idle: List[_Conn] = []

    @staticmethod
    def serves(base_url: str) -> bool:
        return FastHttp.serves(base_url)

    @staticmethod
    def running() -> Optional[asyncio.AbstractEventLoop]:
        """The running asyncio loop; None under another event loop."""
        try:
            return asyncio.get_running_loop()
        except RuntimeError:
            return None

    def _take(self, loop: asyncio.AbstractEventLoop) -> Optional[_Conn]:
        while self._idle:
            conn = self._idle.pop()
            if conn.usable(loop):
                return conn
            conn.close()
        return None

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> _Conn:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port),
                                                    self.connect_timeout)
        except asyncio.TimeoutError as e:
            raise httpx.ConnectTimeout(f"connect to {self.host}:{self.port}: timed out") from e
        except OSError as e:
            raise httpx.ConnectError(f"connect to {self.host}:{self.port}: {e}") from e
        return _Conn(loop, reader, writer)  # asyncio sets TCP_NODELAY

    async def request(self, loop: asyncio.AbstractEventLoop, method: str, path: str,
                      params: Optional[Mapping[str, str]], headers: Mapping[str, str], body: Optional[bytes],
                      read_timeout: Optional[float]) -> Reply:
        target = self.prefix + path
        if params:
            target += "?" + urlencode(params)
        h = dict(self.head)
        h.update(headers)
        if body is None and method in ("POST", "PUT", "PATCH"):
            h["Content-Length"] = "0"
        elif body is not None and "Content-Length" not in h:
            h["Content-Length"] = str(len(body))
        lines = [f"{method} {target} HTTP/1.1"]
        for k, v in h.items():
            if _BAD_HEADER.search(k) or _BAD_VALUE.search(v):
                raise ValueError(f"invalid header {k!r}: {v!r}")
            lines.append(f"{k}: {v}")
        data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        if body:
            data += body
        conn = self._take(loop) or await self._connect(loop)
        keep = False
        try:
            try:
                conn.writer.write(data)
                await asyncio.wait_for(conn.writer.drain(), self.connect_timeout)
            except asyncio.TimeoutError as e:
                raise httpx.WriteTimeout(f"{method} {path}: sending: timed out") from e
            except OSError as e:
                raise httpx.WriteError(f"{method} {path}: sending: {e}") from e
            try:
                status, rh, content, keep = await asyncio.wait_for(self._answer(conn.reader, method), read_timeout)
            except asyncio.TimeoutError as e:
                raise httpx.ReadTimeout(f"{method} {path}: no answer in time") from e
            except asyncio.IncompleteReadError as e:
                if not e.partial:
                    raise httpx.RemoteProtocolError(f"{method} {path}: the connection closed") from e
                raise httpx.ReadError(f"{method} {path}: the answer broke off") from e
            except (OSError, asyncio.LimitOverrunError) as e:
                raise httpx.ReadError(f"{method} {path}: reading the answer: {e}") from e
            except ValueError as e:
                raise httpx.RemoteProtocolError(f"{method} {path}: a malformed answer: {e}") from e
            return Reply(status, rh, content)
        finally:
            if keep:
                if len(self._idle) < KEEP:
                    self._idle.append(conn)
                else:
                    conn.close()
            else:
                conn.close()

    @staticmethod
    async def _answer(reader: asyncio.StreamReader, method: str) -> "tuple[int, Dict[str, str], bytes, bool]":
        """Status, headers, body and whether the connection may be used again."""
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        if not version.startswith("HTTP/1."):
            raise ValueError(f"status line {lines[0][:80]!r}")
        status = int(rest[:3])
        headers: Dict[str, str] = {}
        for line in lines[1:]:
            if line:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
        keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            return status, headers, b"", keep
        cap = ERROR_BODY_CAP if status >= 400 else None
        if "chunked" in headers.get("transfer-encoding", "").lower():
            parts = []
            while True:
                size_line = await reader.readuntil(b"\r\n")
                size = int(size_line.split(b";")[0].strip(), 16)
                if size == 0:
                    while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                        pass
                    break
                parts.append(await reader.readexactly(size))
                await reader.readexactly(2)
            content = b"".join(parts)
        elif "content-length" in headers:
            content = await reader.readexactly(int(headers["content-length"]))
        else:  # to the connection's end
            content = await reader.read(cap) if cap is not None else await reader.read()
            keep = False
        if cap is not None:
            content = content[:cap]
        return status, headers, content, keep

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
