"""Sockets that send a small request in one segment.

httpcore writes a request's head and its body with two `send`s. On a
keep-alive connection (TCP_NODELAY) that is two segments, and the daemon
wakes twice for one request: once for the head, once for the body; on a
busy host each wake-up waits for a CPU. These streams hold what is written
until the connection is read from (the request is whole: HTTP/1.1 reads the
answer next), or until `FLUSH_AT` bytes are held (a streamed upload goes
out as it is produced), so a small request leaves in one `send`, as
http.client sends it.
"""

from __future__ import annotations

import ssl
import typing

import httpcore
import httpx

try:  # httpcore's own choice between asyncio (anyio) and trio
    from httpcore._backends.auto import AutoBackend as _AsyncDefault
except ImportError:  # pragma: no cover
    _AsyncDefault = httpcore.AnyIOBackend  # type: ignore[misc,assignment]

#: Bytes held before they are sent without waiting for a read.
FLUSH_AT = 64 << 10


class CoalescingStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream):
        self._inner = inner
        self._held: typing.List[bytes] = []
        self._size = 0
        self._timeout: typing.Optional[float] = None

    def _flush(self) -> None:
        if self._held:
            data = b"".join(self._held)
            self._held.clear()
            self._size = 0
            self._inner.write(data, self._timeout)

    def write(self, buffer: bytes, timeout: typing.Optional[float] = None) -> None:
        if not buffer:
            return
        self._held.append(buffer)
        self._size += len(buffer)
        self._timeout = timeout
        if self._size >= FLUSH_AT:
            self._flush()

    def read(self, max_bytes: int, timeout: typing.Optional[float] = None) -> bytes:
        self._flush()
        return self._inner.read(max_bytes, timeout)

    def close(self) -> None:
        self._held.clear()
        self._inner.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: typing.Optional[str] = None,
                  timeout: typing.Optional[float] = None) -> httpcore.NetworkStream:
        self._flush()
        return CoalescingStream(self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> typing.Any:
        return self._inner.get_extra_info(info)


class CoalescingBackend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: typing.Optional[float] = None,
                    local_address: typing.Optional[str] = None,
                    socket_options: typing.Optional[typing.Iterable[typing.Any]] = None) -> httpcore.NetworkStream:
        return CoalescingStream(self._inner.connect_tcp(host, port, timeout, local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: typing.Optional[float] = None,
                            socket_options: typing.Optional[typing.Iterable[typing.Any]] = None
                            ) -> httpcore.NetworkStream:
        return CoalescingStream(self._inner.connect_unix_socket(path, timeout, socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class AsyncCoalescingStream(httpcore.AsyncNetworkStream):
    def __init__(self, inner: httpcore.AsyncNetworkStream):
        self._inner = inner
        self._held: typing.List[bytes] = []
        self._size = 0
        self._timeout: typing.Optional[float] = None

    async def _flush(self) -> None:
        if self._held:
            data = b"".join(self._held)
            self._held.clear()
            self._size = 0
            await self._inner.write(data, self._timeout)

    async def write(self, buffer: bytes, timeout: typing.Optional[float] = None) -> None:
        if not buffer:
            return
        self._held.append(buffer)
        self._size += len(buffer)
        self._timeout = timeout
        if self._size >= FLUSH_AT:
            await self._flush()

    async def read(self, max_bytes: int, timeout: typing.Optional[float] = None) -> bytes:
        await self._flush()
        return await self._inner.read(max_bytes, timeout)

    async def aclose(self) -> None:
        self._held.clear()
        await self._inner.aclose()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: typing.Optional[str] = None,
                        timeout: typing.Optional[float] = None) -> httpcore.AsyncNetworkStream:
        await self._flush()
        return AsyncCoalescingStream(await self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> typing.Any:
        return self._inner.get_extra_info(info)


class AsyncCoalescingBackend(httpcore.AsyncNetworkBackend):
    def __init__(self) -> None:
        self._inner = _AsyncDefault()

    async def connect_tcp(self, host: str, port: int, timeout: typing.Optional[float] = None,
                          local_address: typing.Optional[str] = None,
                          socket_options: typing.Optional[typing.Iterable[typing.Any]] = None
                          ) -> httpcore.AsyncNetworkStream:
        return AsyncCoalescingStream(
            await self._inner.connect_tcp(host, port, timeout, local_address, socket_options))

    async def connect_unix_socket(self, path: str, timeout: typing.Optional[float] = None,
                                  socket_options: typing.Optional[typing.Iterable[typing.Any]] = None
                                  ) -> httpcore.AsyncNetworkStream:
        return AsyncCoalescingStream(await self._inner.connect_unix_socket(path, timeout, socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20)


def _pool_args(transport: typing.Any) -> typing.Optional[typing.Dict[str, typing.Any]]:
    """What the pool httpx made was given, to make it again with another
    network backend; None when this httpx keeps its pool otherwise."""
    pool = getattr(transport, "_pool", None)
    if pool is None or not hasattr(pool, "_ssl_context"):
        return None
    return dict(ssl_context=pool._ssl_context, max_connections=LIMITS.max_connections,
                max_keepalive_connections=LIMITS.max_keepalive_connections,
                keepalive_expiry=LIMITS.keepalive_expiry, http1=True, http2=False)


def sync_transport() -> httpx.HTTPTransport:
    """An httpx transport whose connections send a small request in one segment."""
    t = httpx.HTTPTransport(limits=LIMITS)
    args = _pool_args(t)
    if args is not None and type(t._pool) is httpcore.ConnectionPool:
        t._pool = httpcore.ConnectionPool(network_backend=CoalescingBackend(), **args)
    return t


def async_transport() -> httpx.AsyncHTTPTransport:
    t = httpx.AsyncHTTPTransport(limits=LIMITS)
    args = _pool_args(t)
    if args is not None and type(t._pool) is httpcore.AsyncConnectionPool:
        t._pool = httpcore.AsyncConnectionPool(network_backend=AsyncCoalescingBackend(), **args)
    return t
