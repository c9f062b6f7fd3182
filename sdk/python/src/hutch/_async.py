"""The asynchronous client: `AsyncHutch`, the mirror of `Hutch` (`_sync.py`).

The same `_ops` calls, sent with an `httpx.AsyncClient`; every method of
the sync client has a coroutine (or an async iterator) of the same name
and parameters here. Works under asyncio and trio (through anyio, which
httpx brings).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import (
    Any,
    AsyncIterable,
    AsyncIterator,
    BinaryIO,
    Callable,
    Dict,
    Generator,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    Type,
    TypeVar,
    Union,
    overload,
)

import httpx

from . import _ops as ops
from . import models
from ._archive import ExtractResult, TarExtractor
from ._core import (
    CHUNK,
    DEFAULT_TIMEOUT,
    ERROR_BODY_CAP,
    Body,
    Call,
    Config,
    EventDecoder,
    Reply,
    RequestBuilder,
    TextLines,
    answer_error,
    data_body,
    exec_result,
    local_file_body,
    retry_delay,
    transport_error,
)
from ._duration import Duration
from ._fast import AsyncFastHttp
from ._net import async_transport
from ._errors import HutchError, NotFoundError, TransferIncompleteError
from ._ops import UNSET, Command, NetworkSpec, Op, Page, Signal, Sleep

try:
    from typing import Literal
except ImportError:  # pragma: no cover
    pass

T = TypeVar("T")
PathLike = Union[str, "os.PathLike[str]"]
AsyncData = Union[bytes, str, BinaryIO, Iterable[bytes], AsyncIterable[bytes]]


async def _sleep(seconds: float) -> None:
    try:
        import anyio
    except ImportError:  # pragma: no cover - httpx brings anyio
        import asyncio

        await asyncio.sleep(seconds)
    else:
        await anyio.sleep(seconds)


class AsyncTransport:
    """Sends `Call`s with one keep-alive httpx.AsyncClient, retrying what is safe."""

    def __init__(self, config: Config, http: Optional[httpx.AsyncClient] = None):
        self.config = config
        self.requests = RequestBuilder(config, own_client=http is None)
        # A client passed in is used whole (and left open); one made here
        # is used whole only where the environment names a proxy, else
        # requests go straight to its transport.
        self._own = http is None
        self.transport: Optional[httpx.AsyncHTTPTransport] = None
        if http is None:
            self.transport = async_transport()
        self.http = http or httpx.AsyncClient(
            base_url=config.base_url, headers=config.headers(), timeout=config.httpx_timeout(), transport=self.transport
        )
        # Small calls skip httpx where nothing needs it (see _fast).
        self.fast: Optional[AsyncFastHttp] = None
        if self.requests.direct and AsyncFastHttp.serves(config.base_url):
            self.fast = AsyncFastHttp(config.base_url, self.requests.headers, config.timeout)

    async def _send(self, call: Call[Any], content: Any) -> httpx.Response:
        if self.requests.direct and self.transport is not None:
            request = self.requests.build(call, content)
            resp = await self.transport.handle_async_request(request)
            resp.request = request
            return resp
        request = self.http.build_request(
            call.method, self.requests.base + call.path, params=call.params, headers=self.requests.headers_of(call),
            content=content, timeout=httpx.Timeout(**self.requests.timeout(call)),
        )
        return await self.http.send(request, stream=True)

    async def open(self, call: Call[Any]) -> httpx.Response:
        """Sends `call` and returns its answer unread, or raises its error."""
        attempt = 0
        while True:
            body = call.body
            content: Any = None
            if body is not None:
                content = body.data if body.data is not None else body.achunks()
            try:
                resp = await self._send(call, content)
                if resp.status_code >= 400:
                    try:
                        content = await _read_capped(resp)
                    finally:
                        await resp.aclose()
                    raise answer_error(resp.status_code, content)
                if call.stream:
                    return resp
                try:
                    await resp.aread()
                finally:
                    await resp.aclose()
                return resp
            except httpx.TransportError as e:
                delay = retry_delay(call, e, attempt, self.config)
                if delay is None:
                    raise transport_error(e, call) from e
                await _sleep(delay)
                attempt += 1

    async def call(self, call: Call[T]) -> T:
        if self.fast is not None and not call.stream and (call.body is None or call.body.data is not None):
            loop = AsyncFastHttp.running()
            if loop is not None:
                return call.parse(await self._fast_call(self.fast, loop, call))
        resp = await self.open(call)
        return call.parse(Reply(resp.status_code, resp.headers, resp.content))

    async def _fast_call(self, fast: AsyncFastHttp, loop: Any, call: Call[Any]) -> Reply:
        """`open` for a call with its body in memory and its answer read whole."""
        body = call.body.data if call.body is not None else None
        timeout = self.config.timeout if call.read_timeout is DEFAULT_TIMEOUT else call.read_timeout
        attempt = 0
        while True:
            try:
                reply = await fast.request(loop, call.method, call.path, call.params, call.request_headers(), body,
                                           timeout)
            except httpx.TransportError as e:
                delay = retry_delay(call, e, attempt, self.config)
                if delay is None:
                    raise transport_error(e, call) from e
                await _sleep(delay)
                attempt += 1
                continue
            if reply.status >= 400:
                raise answer_error(reply.status, reply.content)
            return reply

    async def run(self, op: Op[T]) -> T:
        """Runs an operation that makes several calls (and pauses)."""
        try:
            step = next(op)
            while True:
                if isinstance(step, Sleep):
                    await _sleep(step.seconds)
                    step = op.send(None)
                else:
                    try:
                        result = await self.call(step)
                    except HutchError as e:
                        step = op.throw(e)
                    else:
                        step = op.send(result)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    async def chunks(self, resp: httpx.Response, chunk_size: int = CHUNK) -> AsyncIterator[bytes]:
        """The body of a streamed answer; a body cut short raises
        `TransferIncompleteError`. Closes the answer at the end."""
        try:
            async for c in resp.aiter_bytes(chunk_size):
                yield c
        except httpx.TransportError as e:
            raise TransferIncompleteError(
                f"{resp.request.method} {resp.request.url.path}: the answer broke off ({e})",
                code="transfer_incomplete",
            ) from e
        finally:
            await resp.aclose()

    async def close(self) -> None:
        if self.fast is not None:
            self.fast.close()
        if self._own:
            await self.http.aclose()


async def _read_capped(resp: httpx.Response) -> bytes:
    out = bytearray()
    try:
        async for c in resp.aiter_bytes():
            out += c
            if len(out) >= ERROR_BODY_CAP:
                break
    except httpx.TransportError:
        pass
    return bytes(out)


# --------------------------------------------------------------------------
# Streams of command events


class AsyncExecStream:
    """The events of a command as they come (`async for ev in stream`); see
    `ExecStream`."""

    def __init__(self, transport: AsyncTransport, resp: httpx.Response, pings: bool = False):
        self._transport = transport
        self._resp = resp
        self._decoder = EventDecoder(pings)

    @property
    def pid(self) -> Optional[int]:
        return self._decoder.pid

    @property
    def exit(self) -> Optional[models.ExitEvent]:
        return self._decoder.exit

    async def __aiter__(self) -> AsyncIterator[models.ExecEvent]:
        async for chunk in self._transport.chunks(self._resp, 64 << 10):
            for ev in self._decoder.feed(chunk):
                yield ev
        for ev in self._decoder.end():
            yield ev

    async def collect(self) -> models.ExecResult:
        """Reads the rest of the stream into a result (output not capped)."""
        return exec_result([ev async for ev in self], self._decoder.exit)

    async def close(self) -> None:
        await self._resp.aclose()

    async def __aenter__(self) -> "AsyncExecStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class AsyncProcess:
    """A background command; see `Process`."""

    def __init__(self, sandbox: "AsyncSandbox", pid: int):
        self.sandbox = sandbox
        self.pid = pid

    def __repr__(self) -> str:
        return f"AsyncProcess(sandbox={self.sandbox.id!r}, pid={self.pid})"

    async def signal(self, sig: Signal = "TERM") -> None:
        await self.sandbox._t.call(ops.signal_process(self.sandbox.id, self.pid, sig))

    async def kill(self) -> None:
        await self.signal("KILL")

    async def stdin(self, data: Union[str, bytes], eof: bool = False) -> None:
        await self.sandbox._t.call(ops.write_stdin(self.sandbox.id, self.pid, data, eof))

    async def close_stdin(self) -> None:
        await self.stdin("", eof=True)

    async def stream(self, pings: bool = False) -> AsyncExecStream:
        t = self.sandbox._t
        return AsyncExecStream(t, await t.open(ops.attach_process(self.sandbox.id, self.pid)), pings)

    async def wait(self) -> models.ExecResult:
        async with await self.stream() as s:
            return await s.collect()


# --------------------------------------------------------------------------
# Sandboxes


class AsyncSandbox:
    """A sandbox; see `Sandbox`. `async with` deletes it on exit."""

    def __init__(self, client: "AsyncHutch", info: models.SandboxInfo):
        self._client = client
        self._t = client._transport
        self.info = info
        self.files = AsyncFiles(self)
        self.access = AsyncAccess(self)

    def __repr__(self) -> str:
        return f"AsyncSandbox(id={self.id!r}, state={self.info.state!r})"

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def state(self) -> str:
        return self.info.state

    @property
    def expires_at(self) -> str:
        return self.info.expires_at

    @property
    def metadata(self) -> Dict[str, str]:
        return self.info.metadata

    def _update(self, info: models.SandboxInfo) -> models.SandboxInfo:
        self.info = info
        return info

    async def refresh(self) -> models.SandboxInfo:
        return self._update(await self._t.call(ops.get_sandbox(self.id)))

    async def delete(self) -> models.SandboxInfo:
        return self._update(await self._t.call(ops.delete_sandbox(self.id)))

    async def extend(self, by: Optional[Duration] = None, *, until: Optional[str] = None) -> models.SandboxInfo:
        return self._update(await self._t.call(ops.extend_sandbox(self.id, by, until)))

    async def grant(self, scopes: Sequence[str], ttl: Duration = 3600) -> models.Grant:
        """A token for an end user (see `Sandbox.grant`)."""
        return await self._t.call(ops.create_grant(self.id, scopes, ttl))

    async def suspend(self) -> models.SandboxInfo:
        return self._update(await self._t.call(ops.suspend_sandbox(self.id)))

    async def resume(self) -> models.SandboxInfo:
        return self._update(await self._t.call(ops.resume_sandbox(self.id)))

    @overload
    async def exec(
        self,
        command: Command,
        *,
        background: "Literal[False]" = False,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        timeout: Optional[Duration] = None,
        keep_output: Optional[bool] = None,
        stdin: Union[str, bytes, None] = None,
        idempotency_key: Optional[str] = None,
    ) -> models.ExecResult: ...

    @overload
    async def exec(
        self,
        command: Command,
        *,
        background: "Literal[True]",
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        timeout: Optional[Duration] = None,
        keep_output: Optional[bool] = None,
        stdin: Union[str, bytes, None] = None,
        idempotency_key: Optional[str] = None,
    ) -> AsyncProcess: ...

    async def exec(
        self,
        command: Command,
        *,
        background: bool = False,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        timeout: Optional[Duration] = None,
        keep_output: Optional[bool] = None,
        stdin: Union[str, bytes, None] = None,
        idempotency_key: Optional[str] = None,
    ) -> Union[models.ExecResult, AsyncProcess]:
        body = ops.exec_body(command, env=env, cwd=cwd, user=user, timeout=timeout, keep_output=keep_output,
                             stdin=stdin, background=background)
        if background:
            return AsyncProcess(self, await self._t.call(ops.exec_background_call(self.id, body, idempotency_key)))
        return await self._t.call(ops.exec_call(self.id, body, idempotency_key))

    async def exec_stream(
        self,
        command: Command,
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        timeout: Optional[Duration] = None,
        keep_output: Optional[bool] = None,
        stdin: Union[str, bytes, None] = None,
        idempotency_key: Optional[str] = None,
        pings: bool = False,
    ) -> AsyncExecStream:
        body = ops.exec_body(command, env=env, cwd=cwd, user=user, timeout=timeout, keep_output=keep_output,
                             stdin=stdin)
        resp = await self._t.open(ops.exec_stream_call(self.id, body, idempotency_key))
        return AsyncExecStream(self._t, resp, pings)

    async def processes(self) -> List[models.ProcessInfo]:
        return await self._t.call(ops.list_processes(self.id))

    def process(self, pid: int) -> AsyncProcess:
        return AsyncProcess(self, pid)

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                        tb: Optional[TracebackType]) -> None:
        try:
            await self.delete()
        except NotFoundError:
            pass


class AsyncFiles:
    """A sandbox's files; see `Files`."""

    def __init__(self, sandbox: AsyncSandbox):
        self._sb = sandbox
        self._t = sandbox._t

    async def read(self, path: str) -> bytes:
        return b"".join([c async for c in await self.stream(path)])

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding)

    async def stream(self, path: str, chunk_size: int = CHUNK) -> AsyncIterator[bytes]:
        resp = await self._t.open(ops.download_file(self._sb.id, path))
        return self._t.chunks(resp, chunk_size)

    async def download(self, path: str, dest: Union[PathLike, BinaryIO]) -> int:
        if not isinstance(dest, (str, os.PathLike)):
            n = 0
            async for c in await self.stream(path):
                dest.write(c)
                n += len(c)
            return n
        target = Path(dest)
        tmp = target.with_name(f".{target.name}.hutch-{os.getpid()}-{id(self)}")
        try:
            with open(tmp, "wb") as f:
                n = await self.download(path, f)
            os.replace(tmp, target)
            return n
        finally:
            if tmp.exists():
                tmp.unlink()

    async def write(self, path: str, data: AsyncData) -> None:
        await self._t.call(ops.upload_file(self._sb.id, path, data_body(data)))

    async def upload(self, local_path: PathLike, path: str) -> None:
        await self._t.call(ops.upload_file(self._sb.id, path, local_file_body(local_path)))

    async def read_base64(self, path: str) -> bytes:
        return await self._t.call(ops.read_base64(self._sb.id, path))

    async def write_base64(self, path: str, data: Union[bytes, str]) -> None:
        await self._t.call(ops.write_base64(self._sb.id, path, data))

    async def list(
        self,
        path: str = "/workspace",
        *,
        recursive: bool = True,
        include_sha256: bool = False,
        limit: Optional[int] = None,
        cursor: Optional[str] = None,
    ) -> Page[models.FileEntry]:
        return await self._t.call(ops.list_files(self._sb.id, path, recursive, include_sha256, limit, cursor))

    async def iter(self, path: str = "/workspace", *, recursive: bool = True, include_sha256: bool = False,
                   page_size: Optional[int] = None) -> AsyncIterator[models.FileEntry]:
        cursor = None
        while True:
            page = await self.list(path, recursive=recursive, include_sha256=include_sha256, limit=page_size,
                                   cursor=cursor)
            for e in page.items:
                yield e
            cursor = page.next_cursor
            if not cursor:
                return

    async def upload_archive(self, path: str, archive: Union[bytes, BinaryIO, PathLike, Iterable[bytes]]
                             ) -> models.ArchiveResult:
        return await self._t.call(ops.upload_archive(self._sb.id, ops.archive_source(archive), path))

    async def upload_dir(self, local_dir: PathLike, path: str, *,
                         follow_symlinks: bool = False) -> models.ArchiveResult:
        return await self._t.call(ops.upload_archive(self._sb.id, ops.dir_source(local_dir, follow_symlinks), path))

    async def download_archive(self, path: str) -> AsyncIterator[bytes]:
        return self._t.chunks(await self._t.open(ops.download_archive(self._sb.id, path)))

    async def download_dir(self, path: str, local_dir: PathLike) -> ExtractResult:
        chunks = await self.download_archive(path)
        ex = TarExtractor(local_dir)
        try:
            async for c in chunks:
                ex.feed(c)
        except BaseException:
            ex.abort()
            raise
        return ex.finish()

    async def write_part(self, path: str, *, offset: int, size: int, sha256: str,
                         data: bytes) -> models.FilePartResult:
        return await self._t.call(ops.file_part(self._sb.id, path, offset, size, sha256, data))

    async def upload_parts(self, source: Union[PathLike, BinaryIO], path: str,
                           part_size: int = ops.PART_CAP) -> models.FilePartResult:
        if isinstance(source, (str, os.PathLike)):
            with open(source, "rb") as f:
                return await self._t.run(ops.upload_parts(self._sb.id, f, path, part_size))
        return await self._t.run(ops.upload_parts(self._sb.id, source, path, part_size))


class AsyncAccess:
    """Port access grants; see `Access`."""

    def __init__(self, sandbox: AsyncSandbox):
        self._sb = sandbox
        self._t = sandbox._t

    async def create(self, port: int, expires_in: Optional[Duration] = None) -> models.AccessGrant:
        return await self._t.call(ops.create_access(self._sb.id, port, expires_in))

    async def list(self) -> List[models.AccessGrant]:
        return await self._t.call(ops.list_access(self._sb.id))

    async def revoke(self, grant: Union[str, models.AccessGrant]) -> None:
        gid = grant.id if isinstance(grant, models.AccessGrant) else grant
        await self._t.call(ops.revoke_access(self._sb.id, gid))

    async def revoke_all(self) -> None:
        await self._t.call(ops.revoke_all_access(self._sb.id))


class SandboxCreation:
    """What `AsyncHutch.sandboxes.create` returns: await it for the sandbox,
    or use it with `async with` to have the sandbox deleted on exit."""

    def __init__(self, make: Callable[[], Any]):
        self._make = make
        self._sandbox: Optional[AsyncSandbox] = None

    def __await__(self) -> Generator[Any, None, AsyncSandbox]:
        return self._make().__await__()  # type: ignore[no-any-return]

    async def __aenter__(self) -> AsyncSandbox:
        self._sandbox = await self._make()
        return self._sandbox

    async def __aexit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                        tb: Optional[TracebackType]) -> None:
        if self._sandbox is not None:
            await self._sandbox.__aexit__(exc_type, exc, tb)


class AsyncSandboxes:
    def __init__(self, client: "AsyncHutch"):
        self._client = client
        self._t = client._transport

    def create(
        self,
        template: Optional[str] = None,
        *,
        ttl: Optional[Duration] = None,
        memory_mb: Optional[int] = None,
        vcpus: Optional[float] = None,
        disk_mib: Optional[int] = None,
        pids: Optional[int] = None,
        env: Optional[Mapping[str, str]] = None,
        metadata: Optional[Mapping[str, str]] = None,
        network: Optional[NetworkSpec] = None,
        wait: Optional[Duration] = 300,
        idempotency_key: Optional[str] = None,
        volumes: Optional[Sequence[ops.VolumeSpec]] = None,
        storage: Optional[str] = None,
        snapshot: Optional[str] = None,
        on_expire: Optional[str] = None,
        paused_ttl: Optional[Duration] = None,
        idle_timeout: Optional[Duration] = None,
        on_idle: Optional[str] = None,
    ) -> SandboxCreation:
        """`sb = await client.sandboxes.create(...)`, or
        `async with client.sandboxes.create(...) as sb:`; see `Sandboxes.create`."""
        call = ops.create_sandbox(
            template=template, ttl=ttl, memory_mb=memory_mb, vcpus=vcpus, disk_mib=disk_mib, pids=pids, env=env,
            metadata=metadata, network=network, wait=wait, idempotency_key=idempotency_key,
            default_timeout=self._t.config.timeout, volumes=volumes, storage=storage, snapshot=snapshot,
            on_expire=on_expire, paused_ttl=paused_ttl, idle_timeout=idle_timeout, on_idle=on_idle,
        )

        async def make() -> AsyncSandbox:
            return AsyncSandbox(self._client, await self._t.run(ops.create_sandbox_op(call, wait)))

        return SandboxCreation(make)

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        return AsyncSandbox(self._client, await self._t.call(ops.get_sandbox(sandbox_id)))

    async def list(self, *, limit: Optional[int] = None, cursor: Optional[str] = None,
                   owner: Optional[str] = None) -> Page[AsyncSandbox]:
        page = await self._t.call(ops.list_sandboxes(limit, cursor, owner))
        return Page([AsyncSandbox(self._client, i) for i in page.items], page.next_cursor)

    async def iter(self, *, owner: Optional[str] = None,
                   page_size: Optional[int] = None) -> AsyncIterator[AsyncSandbox]:
        cursor = None
        while True:
            page = await self.list(limit=page_size, cursor=cursor, owner=owner)
            for sb in page.items:
                yield sb
            cursor = page.next_cursor
            if not cursor:
                return

    async def delete(self, sandbox_id: str) -> models.SandboxInfo:
        return await self._t.call(ops.delete_sandbox(sandbox_id))


# --------------------------------------------------------------------------
# Templates, builds, images, keys


class AsyncBuilds:
    def __init__(self, client: "AsyncHutch"):
        self._t = client._transport

    async def list(self, template: Union[str, models.Template]) -> List[models.Build]:
        return await self._t.call(ops.list_builds(ops.template_id(template)))

    async def get(self, template: Union[str, models.Template], build_id: str) -> models.Build:
        return await self._t.call(ops.get_build(ops.template_id(template), build_id))

    async def logs(self, template: Union[str, models.Template], build_id: str, *,
                   follow: bool = False) -> AsyncIterator[str]:
        resp = await self._t.open(ops.build_logs(ops.template_id(template), build_id, follow))
        lines = TextLines()
        async for chunk in self._t.chunks(resp, 64 << 10):
            for line in lines.feed(chunk):
                yield line
        for line in lines.end():
            yield line


class AsyncVolumes:
    """Volumes: files that outlive sandboxes (see `sandboxes.create(volumes=...)`)."""

    def __init__(self, client: "AsyncHutch"):
        self._t = client._transport

    async def create(self, name: str, *, size_mib: Optional[int] = None) -> models.Volume:
        """A volume of `size_mib` MiB (1024 by default): writes past it fail."""
        return await self._t.call(ops.create_volume(name, size_mib))

    async def list(self, *, owner: Optional[str] = None) -> List[models.Volume]:
        return await self._t.call(ops.list_volumes(owner))

    async def get(self, volume: Union[str, models.Volume]) -> models.Volume:
        """By id or name."""
        return await self._t.call(ops.get_volume(ops.volume_ref(volume)))

    async def resize(self, volume: Union[str, models.Volume], size_mib: int) -> models.Volume:
        """Grows it (`volume_shrink_refused` for a smaller size)."""
        return await self._t.call(ops.resize_volume(ops.volume_ref(volume), size_mib))

    async def delete(self, volume: Union[str, models.Volume]) -> None:
        """Deletes it and its files (`volume_in_use` while a sandbox mounts it)."""
        await self._t.call(ops.delete_volume(ops.volume_ref(volume)))


class AsyncTemplates:
    def __init__(self, client: "AsyncHutch"):
        self._client = client
        self._t = client._transport
        self.builds = AsyncBuilds(client)

    async def create(
        self,
        name: str,
        *,
        image: Optional[str] = None,
        class_: Optional[str] = None,
        memory_mb: Optional[int] = None,
        vcpus: Optional[float] = None,
        disk_mib: Optional[int] = None,
        pids: Optional[int] = None,
        env: Optional[Mapping[str, str]] = None,
        default_ttl: Optional[Duration] = None,
        max_ttl: Optional[Duration] = None,
        warm: Union[models.Warm, Mapping[str, int], "tuple[int, int]", None] = None,
        startup: Optional[str] = None,
        readiness: Union[models.Readiness, Mapping[str, Any], None] = None,
        network: Optional[NetworkSpec] = None,
    ) -> models.Template:
        fields = ops.template_fields(
            image=image, class_=class_, memory_mb=memory_mb, vcpus=vcpus, disk_mib=disk_mib, pids=pids, env=env,
            default_ttl=default_ttl, max_ttl=max_ttl, warm=warm, startup=startup, readiness=readiness,
            network=network,
        )
        return await self._t.call(ops.create_template(name, fields))

    async def list(self, *, owner: Optional[str] = None) -> List[models.Template]:
        return await self._t.call(ops.list_templates(owner))

    async def get(self, template: Union[str, models.Template]) -> models.Template:
        return await self._t.call(ops.get_template(ops.template_id(template)))

    async def update(self, template: Union[str, models.Template], *, image: Any = UNSET, class_: Any = UNSET,
                     memory_mb: Any = UNSET, vcpus: Any = UNSET, disk_mib: Any = UNSET, pids: Any = UNSET,
                     env: Any = UNSET, default_ttl: Any = UNSET, max_ttl: Any = UNSET, warm: Any = UNSET,
                     startup: Any = UNSET, readiness: Any = UNSET, network: Any = UNSET) -> models.Template:
        fields = ops.template_fields(
            image=image, class_=class_, memory_mb=memory_mb, vcpus=vcpus, disk_mib=disk_mib, pids=pids, env=env,
            default_ttl=default_ttl, max_ttl=max_ttl, warm=warm, startup=startup, readiness=readiness,
            network=network,
        )
        return await self._t.call(ops.update_template(ops.template_id(template), fields))

    async def delete(self, template: Union[str, models.Template]) -> None:
        await self._t.call(ops.delete_template(ops.template_id(template)))

    async def build(
        self,
        template: Union[str, models.Template],
        context: ops.BuildContext,
        *,
        on_log: Optional[Callable[[str], Any]] = None,
        wait: bool = True,
        follow_symlinks: bool = False,
    ) -> models.Build:
        """See `Templates.build`; `on_log` may also be a coroutine function."""
        tid = ops.template_id(template)
        build = await self._t.call(ops.start_build(tid, ops.context_body(context, follow_symlinks)))
        if not wait:
            return build
        async for line in self.builds.logs(tid, build.id, follow=True):
            if on_log is not None:
                r = on_log(line)
                if hasattr(r, "__await__"):
                    await r
        return await self._t.run(ops.finished_build(tid, build.id))


class AsyncImages:
    def __init__(self, client: "AsyncHutch"):
        self._t = client._transport

    async def list(self) -> List[models.Image]:
        return await self._t.call(ops.list_images())


class AsyncSnapshots:
    """Snapshots of sandboxes' files (see the sync `Snapshots`)."""

    def __init__(self, client: "AsyncHutch"):
        self._t = client._transport

    async def export_stream(self, snapshot: str, chunk_size: int = CHUNK) -> AsyncIterator[bytes]:
        resp = await self._t.open(ops.export_snapshot(snapshot))
        return self._t.chunks(resp, chunk_size)

    async def export(self, snapshot: str, dest: Union[PathLike, BinaryIO]) -> int:
        if not isinstance(dest, (str, os.PathLike)):
            n = 0
            async for c in await self.export_stream(snapshot):
                dest.write(c)
                n += len(c)
            return n
        target = Path(dest)
        tmp = target.with_name(f".{target.name}.hutch-{os.getpid()}-{id(self)}")
        try:
            with open(tmp, "wb") as f:
                n = await self.export(snapshot, f)
            os.replace(tmp, target)
            return n
        finally:
            if tmp.exists():
                tmp.unlink()


class AsyncKeys:
    """API keys (the admin key only)."""

    def __init__(self, client: "AsyncHutch"):
        self._t = client._transport

    async def list(self) -> List[models.ApiKey]:
        return await self._t.call(ops.list_keys())

    async def create(self, name: str, *, e2b: bool = False,
                     quotas: Union[models.Quotas, Mapping[str, Any], None] = None) -> models.ApiKey:
        return await self._t.call(ops.create_key(name, e2b, quotas))

    async def update(self, key_id: str, *, quotas: Union[models.Quotas, Mapping[str, Any], None]) -> models.ApiKey:
        return await self._t.call(ops.set_key_quotas(key_id, quotas))

    async def revoke(self, key_id: str) -> None:
        await self._t.call(ops.revoke_key(key_id))

    async def rotate_grant_secret(self, key_id: str) -> Dict[str, Any]:
        return await self._t.call(ops.rotate_grant_secret(key_id))


# --------------------------------------------------------------------------
# The client


class AsyncHutch:
    """The async client; see `Hutch`. `async with AsyncHutch() as client:`."""

    def __init__(
        self,
        base_url: Optional[str] = None,
        api_key: Optional[str] = None,
        *,
        timeout: Duration = 60,
        max_retries: int = 3,
        http_client: Optional[httpx.AsyncClient] = None,
    ):
        self.config = Config.make(base_url, api_key, timeout, max_retries)
        self._transport = AsyncTransport(self.config, http_client)
        self.sandboxes = AsyncSandboxes(self)
        self.templates = AsyncTemplates(self)
        self.volumes = AsyncVolumes(self)
        self.images = AsyncImages(self)
        self.keys = AsyncKeys(self)
        self.snapshots = AsyncSnapshots(self)

    @property
    def base_url(self) -> str:
        return self.config.base_url

    async def run(
        self,
        command: Command,
        *,
        template: Optional[str] = None,
        memory_mb: Optional[int] = None,
        vcpus: Optional[float] = None,
        disk_mib: Optional[int] = None,
        pids: Optional[int] = None,
        network: Optional[NetworkSpec] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        timeout: Optional[Duration] = None,
        keep_output: Optional[bool] = None,
        stdin: Union[str, bytes, None] = None,
        idempotency_key: Optional[str] = None,
    ) -> models.ExecResult:
        return await self._transport.call(
            ops.execution_call(
                command, template=template, memory_mb=memory_mb, vcpus=vcpus, disk_mib=disk_mib, pids=pids,
                network=network, env=env, cwd=cwd, user=user, timeout=timeout, keep_output=keep_output,
                stdin=stdin, idempotency_key=idempotency_key, default_timeout=self.config.timeout,
            )
        )

    async def usage(self, key: Optional[str] = None) -> models.Usage:
        return await self._transport.call(ops.usage(key))

    async def health(self) -> bool:
        return await self._transport.call(ops.health())

    async def metrics(self) -> str:
        return await self._transport.call(ops.metrics())

    async def openapi(self) -> Dict[str, Any]:
        return await self._transport.call(ops.openapi())

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> "AsyncHutch":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
