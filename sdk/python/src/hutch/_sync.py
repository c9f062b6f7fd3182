"""The synchronous client: `Hutch` and the handles it gives out.

Every method builds its request with `_ops` and runs it through
`Transport`; `_async.py` mirrors this module with the same calls.
"""

from __future__ import annotations

import codecs
import os
import time
from pathlib import Path
from types import TracebackType
from typing import (
    Any,
    BinaryIO,
    Callable,
    Dict,
    Iterable,
    Iterator,
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
    exec_result,
    answer_error,
    data_body,
    local_file_body,
    retry_delay,
    transport_error,
)
from ._duration import Duration
from ._fast import FastHttp
from ._net import sync_transport
from ._errors import BuildError, HutchError, NotFoundError, TransferIncompleteError
from ._ops import UNSET, Command, NetworkSpec, Op, Page, Signal, Sleep

try:
    from typing import Literal
except ImportError:  # pragma: no cover
    pass

T = TypeVar("T")
PathLike = Union[str, "os.PathLike[str]"]


class Transport:
    """Sends `Call`s with one keep-alive httpx client, retrying what is safe."""

    def __init__(self, config: Config, http: Optional[httpx.Client] = None):
        self.config = config
        self.requests = RequestBuilder(config, own_client=http is None)
        # A client passed in is used whole (and left open); one made here
        # is used whole only where the environment names a proxy, else
        # requests go straight to its transport.
        self._own = http is None
        self.transport: Optional[httpx.HTTPTransport] = None
        if http is None:
            self.transport = sync_transport()
        self.http = http or httpx.Client(
            base_url=config.base_url, headers=config.headers(), timeout=config.httpx_timeout(), transport=self.transport
        )
        # Small calls skip httpx where nothing needs it (see _fast).
        self.fast: Optional[FastHttp] = None
        if self.requests.direct and FastHttp.serves(config.base_url):
            self.fast = FastHttp(config.base_url, self.requests.headers, config.timeout)

    def _send(self, call: Call[Any], content: Any) -> httpx.Response:
        if self.requests.direct and self.transport is not None:
            request = self.requests.build(call, content)
            resp = self.transport.handle_request(request)
            resp.request = request
            return resp
        request = self.http.build_request(
            call.method, self.requests.base + call.path, params=call.params, headers=self.requests.headers_of(call),
            content=content, timeout=httpx.Timeout(**self.requests.timeout(call)),
        )
        return self.http.send(request, stream=True)

    def open(self, call: Call[Any]) -> httpx.Response:
        """Sends `call` and returns its answer unread, or raises its error."""
        attempt = 0
        while True:
            body = call.body
            content: Any = None
            if body is not None:
                content = body.data if body.data is not None else body.chunks()
            try:
                resp = self._send(call, content)
                if resp.status_code >= 400:
                    try:
                        content = _read_capped(resp)
                    finally:
                        resp.close()
                    raise answer_error(resp.status_code, content)
                if call.stream:
                    return resp
                try:
                    resp.read()
                finally:
                    resp.close()
                return resp
            except httpx.TransportError as e:
                delay = retry_delay(call, e, attempt, self.config)
                if delay is None:
                    raise transport_error(e, call) from e
                time.sleep(delay)
                attempt += 1

    def call(self, call: Call[T]) -> T:
        if self.fast is not None and not call.stream and (call.body is None or call.body.data is not None):
            return call.parse(self._fast_call(self.fast, call))
        resp = self.open(call)
        return call.parse(Reply(resp.status_code, resp.headers, resp.content))

    def _fast_call(self, fast: FastHttp, call: Call[Any]) -> Reply:
        """`open` for a call with its body in memory and its answer read whole."""
        body = call.body.data if call.body is not None else None
        timeout = self.config.timeout if call.read_timeout is DEFAULT_TIMEOUT else call.read_timeout
        attempt = 0
        while True:
            try:
                reply = fast.request(call.method, call.path, call.params, call.request_headers(), body, timeout)
            except httpx.TransportError as e:
                delay = retry_delay(call, e, attempt, self.config)
                if delay is None:
                    raise transport_error(e, call) from e
                time.sleep(delay)
                attempt += 1
                continue
            if reply.status >= 400:
                raise answer_error(reply.status, reply.content)
            return reply

    def run(self, op: Op[T]) -> T:
        """Runs an operation that makes several calls (and pauses)."""
        try:
            step = next(op)
            while True:
                if isinstance(step, Sleep):
                    time.sleep(step.seconds)
                    step = op.send(None)
                else:
                    try:
                        result = self.call(step)
                    except HutchError as e:
                        step = op.throw(e)
                    else:
                        step = op.send(result)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    def chunks(self, resp: httpx.Response, chunk_size: int = CHUNK) -> Iterator[bytes]:
        """The body of a streamed answer; a body cut short raises
        `TransferIncompleteError`. Closes the answer at the end."""
        try:
            for c in resp.iter_bytes(chunk_size):
                yield c
        except httpx.TransportError as e:
            raise TransferIncompleteError(
                f"{resp.request.method} {resp.request.url.path}: the answer broke off ({e})",
                code="transfer_incomplete",
            ) from e
        finally:
            resp.close()

    def close(self) -> None:
        if self.fast is not None:
            self.fast.close()
        if self._own:
            self.http.close()


def _read_capped(resp: httpx.Response) -> bytes:
    out = bytearray()
    try:
        for c in resp.iter_bytes():
            out += c
            if len(out) >= ERROR_BODY_CAP:
                break
    except httpx.TransportError:
        pass
    return bytes(out)


# --------------------------------------------------------------------------
# Streams of command events


class ExecStream:
    """The events of a command as they come: `StartEvent`, `StdoutEvent`,
    `StderrEvent`, then `ExitEvent` (pings are skipped unless asked for).

    Iterate it once; use it as a context manager (or call `close`) to let go
    of the connection early. A stream that ends without its exit event
    raises `TransferIncompleteError` (the command may still run: `pid`
    says which one to reattach to)."""

    def __init__(self, transport: Transport, resp: httpx.Response, pings: bool = False):
        self._transport = transport
        self._resp = resp
        self._decoder = EventDecoder(pings)

    @property
    def pid(self) -> Optional[int]:
        return self._decoder.pid

    @property
    def exit(self) -> Optional[models.ExitEvent]:
        """The exit event, once the stream got it."""
        return self._decoder.exit

    def __iter__(self) -> Iterator[models.ExecEvent]:
        for chunk in self._transport.chunks(self._resp, 64 << 10):
            yield from self._decoder.feed(chunk)
        yield from self._decoder.end()

    def collect(self) -> models.ExecResult:
        """Reads the rest of the stream into a result (output not capped)."""
        return exec_result(list(self), self._decoder.exit)

    def close(self) -> None:
        self._resp.close()

    def __enter__(self) -> "ExecStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Process:
    """A command started with `background=True` (or any command holding a
    slot, by its pid): signal it, feed its stdin, reattach to its output."""

    def __init__(self, sandbox: "Sandbox", pid: int):
        self.sandbox = sandbox
        self.pid = pid

    def __repr__(self) -> str:
        return f"Process(sandbox={self.sandbox.id!r}, pid={self.pid})"

    def signal(self, sig: Signal = "TERM") -> None:
        """Sends `sig` ("TERM", "SIGKILL", 9, signal.SIGINT) to its whole tree."""
        self.sandbox._t.call(ops.signal_process(self.sandbox.id, self.pid, sig))

    def kill(self) -> None:
        self.signal("KILL")

    def stdin(self, data: Union[str, bytes], eof: bool = False) -> None:
        """Writes UTF-8 text to its stdin; `eof=True` closes it after."""
        self.sandbox._t.call(ops.write_stdin(self.sandbox.id, self.pid, data, eof))

    def close_stdin(self) -> None:
        self.stdin("", eof=True)

    def stream(self, pings: bool = False) -> ExecStream:
        """Reattaches: its kept output, then live output, then its exit.
        Only a command still holding its slot can be attached to; once it
        ended this raises `NotFoundError` (attach first, then signal)."""
        t = self.sandbox._t
        return ExecStream(t, t.open(ops.attach_process(self.sandbox.id, self.pid)), pings)

    def wait(self) -> models.ExecResult:
        """Reattaches and waits for it to end (see `stream`)."""
        with self.stream() as s:
            return s.collect()


# --------------------------------------------------------------------------
# Sandboxes


class Sandbox:
    """A sandbox: run commands, move files, open ports. Used as a context
    manager it is deleted on exit.

    `info` is what the daemon said last (`refresh()` asks again)."""

    def __init__(self, client: "Hutch", info: models.SandboxInfo):
        self._client = client
        self._t = client._transport
        self.info = info
        self.files = Files(self)
        self.access = Access(self)

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, state={self.info.state!r})"

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

    def refresh(self) -> models.SandboxInfo:
        return self._update(self._t.call(ops.get_sandbox(self.id)))

    def delete(self) -> models.SandboxInfo:
        """Terminates it (again is a no-op)."""
        return self._update(self._t.call(ops.delete_sandbox(self.id)))

    def extend(self, by: Optional[Duration] = None, *, until: Optional[str] = None) -> models.SandboxInfo:
        """Moves its expiry: `by` ("10m", 600) or `until` (RFC 3339)."""
        return self._update(self._t.call(ops.extend_sandbox(self.id, by, until)))

    def grant(self, scopes: Sequence[str], ttl: Duration = 3600) -> models.Grant:
        """A token for an end user: this sandbox only, `scopes` only
        (`exec`, `files:read`, `files:write`, `pty`, `ports:N`), for `ttl`
        (at most a day). The token is shown only here."""
        return self._t.call(ops.create_grant(self.id, scopes, ttl))

    def suspend(self) -> models.SandboxInfo:
        """Freezes every process; memory and files are kept."""
        return self._update(self._t.call(ops.suspend_sandbox(self.id)))

    def resume(self) -> models.SandboxInfo:
        return self._update(self._t.call(ops.resume_sandbox(self.id)))

    # Issue 11 adds here: snapshot(), fork(count), diff() (see _ops).

    @overload
    def exec(
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
    def exec(
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
    ) -> Process: ...

    def exec(
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
    ) -> Union[models.ExecResult, Process]:
        """Runs a command: a string in a shell, a list as argv.

        Returns its `ExecResult` (any exit code; each stream capped at 1 MiB),
        or with `background=True` a `Process` at once. The request carries an
        Idempotency-Key (a fresh one unless given): a retry after a dropped
        connection replays the first outcome and never runs it twice."""
        body = ops.exec_body(command, env=env, cwd=cwd, user=user, timeout=timeout, keep_output=keep_output,
                             stdin=stdin, background=background)
        if background:
            return Process(self, self._t.call(ops.exec_background_call(self.id, body, idempotency_key)))
        return self._t.call(ops.exec_call(self.id, body, idempotency_key))

    def exec_stream(
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
    ) -> ExecStream:
        """Runs a command and streams its events (NDJSON) as they happen.
        Refusals (not running, no slot) raise here, before the first event."""
        body = ops.exec_body(command, env=env, cwd=cwd, user=user, timeout=timeout, keep_output=keep_output,
                             stdin=stdin)
        return ExecStream(self._t, self._t.open(ops.exec_stream_call(self.id, body, idempotency_key)), pings)

    def processes(self) -> List[models.ProcessInfo]:
        """The commands holding a slot (running, or with descendants alive)."""
        return self._t.call(ops.list_processes(self.id))

    def process(self, pid: int) -> Process:
        """A handle on a command by its pid (to signal or reattach)."""
        return Process(self, pid)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        try:
            self.delete()
        except NotFoundError:
            pass


class Files:
    """A sandbox's files. Paths are absolute or relative to /workspace."""

    def __init__(self, sandbox: Sandbox):
        self._sb = sandbox
        self._t = sandbox._t

    # ---- raw, streamed

    def read(self, path: str) -> bytes:
        """The whole file (use `stream` or `download` for large ones)."""
        return b"".join(self.stream(path))

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return self.read(path).decode(encoding)

    def stream(self, path: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
        """The file's bytes as they arrive, never held whole. The request is
        made at once (errors raise here); close the iterator to stop early."""
        resp = self._t.open(ops.download_file(self._sb.id, path))
        return self._t.chunks(resp, chunk_size)

    def download(self, path: str, dest: Union[PathLike, BinaryIO]) -> int:
        """Streams the file into a local path (written beside it, then renamed:
        a download that breaks off leaves nothing) or a binary file. Returns
        the bytes written."""
        if not isinstance(dest, (str, os.PathLike)):
            n = 0
            for c in self.stream(path):
                dest.write(c)
                n += len(c)
            return n
        target = Path(dest)
        tmp = target.with_name(f".{target.name}.hutch-{os.getpid()}-{id(self)}")
        try:
            with open(tmp, "wb") as f:
                n = self.download(path, f)
            os.replace(tmp, target)
            return n
        finally:
            if tmp.exists():
                tmp.unlink()

    def write(self, path: str, data: Union[bytes, str, BinaryIO, Iterable[bytes]]) -> None:
        """Writes a file from bytes, text, a binary file or an iterable of
        bytes, streamed (up to 1 GiB). The parent must exist. All or nothing."""
        self._t.call(ops.upload_file(self._sb.id, path, data_body(data)))

    def upload(self, local_path: PathLike, path: str) -> None:
        """Streams a local file to `path`."""
        self._t.call(ops.upload_file(self._sb.id, path, local_file_body(local_path)))

    # ---- base64 JSON routes (at most 8 MiB)

    def read_base64(self, path: str) -> bytes:
        """The file's bytes through the JSON route (`files/read`, ≤ 8 MiB)."""
        return self._t.call(ops.read_base64(self._sb.id, path))

    def write_base64(self, path: str, data: Union[bytes, str]) -> None:
        """Writes through the JSON route (`files/write`, ≤ 8 MiB)."""
        self._t.call(ops.write_base64(self._sb.id, path, data))

    # ---- listings

    def list(
        self,
        path: str = "/workspace",
        *,
        recursive: bool = True,
        include_sha256: bool = False,
        limit: Optional[int] = None,
        cursor: Optional[str] = None,
    ) -> Page[models.FileEntry]:
        """One page of the entries below `path`, sorted by path."""
        return self._t.call(ops.list_files(self._sb.id, path, recursive, include_sha256, limit, cursor))

    def iter(self, path: str = "/workspace", *, recursive: bool = True, include_sha256: bool = False,
             page_size: Optional[int] = None) -> Iterator[models.FileEntry]:
        """Every entry below `path`, page after page."""
        cursor = None
        while True:
            page = self.list(path, recursive=recursive, include_sha256=include_sha256, limit=page_size,
                             cursor=cursor)
            yield from page.items
            cursor = page.next_cursor
            if not cursor:
                return

    # ---- archives

    def upload_archive(self, path: str,
                       archive: Union[bytes, BinaryIO, PathLike, Iterable[bytes]]) -> models.ArchiveResult:
        """Unpacks a tar (or tar.gz: a local path, bytes, a binary file or an
        iterable of bytes) into the directory `path`, streamed; all or nothing."""
        return self._t.call(ops.upload_archive(self._sb.id, ops.archive_source(archive), path))

    def upload_dir(self, local_dir: PathLike, path: str, *, follow_symlinks: bool = False) -> models.ArchiveResult:
        """Packs a local directory as it is sent and unpacks it into `path`
        (made if missing; existing directories are merged into)."""
        return self._t.call(ops.upload_archive(self._sb.id, ops.dir_source(local_dir, follow_symlinks), path))

    def download_archive(self, path: str) -> Iterator[bytes]:
        """A tar of the directory `path`, as it is read."""
        return self._t.chunks(self._t.open(ops.download_archive(self._sb.id, path)))

    def download_dir(self, path: str, local_dir: PathLike) -> ExtractResult:
        """Unpacks the directory `path` into `local_dir` as it streams; the
        files appear only once the whole archive arrived."""
        chunks = self.download_archive(path)
        ex = TarExtractor(local_dir)
        try:
            for c in chunks:
                ex.feed(c)
        except BaseException:
            ex.abort()
            raise
        return ex.finish()

    # ---- file parts

    def write_part(self, path: str, *, offset: int, size: int, sha256: str, data: bytes) -> models.FilePartResult:
        """One part of a file sent in parts (`size` and `sha256` of the whole file)."""
        return self._t.call(ops.file_part(self._sb.id, path, offset, size, sha256, data))

    def upload_parts(self, source: Union[PathLike, BinaryIO], path: str,
                     part_size: int = ops.PART_CAP) -> models.FilePartResult:
        """Sends a local file (or a seekable binary file) in parts of at most
        8 MiB through the JSON route; nothing appears at `path` until the
        last part checks out against the file's SHA-256."""
        if isinstance(source, (str, os.PathLike)):
            with open(source, "rb") as f:
                return self._t.run(ops.upload_parts(self._sb.id, f, path, part_size))
        return self._t.run(ops.upload_parts(self._sb.id, source, path, part_size))


class Access:
    """Port access grants of a sandbox: a URL and a short-lived token per port."""

    def __init__(self, sandbox: Sandbox):
        self._sb = sandbox
        self._t = sandbox._t

    def create(self, port: int, expires_in: Optional[Duration] = None) -> models.AccessGrant:
        """A grant for `port` (up to 5 minutes; the token is shown only here)."""
        return self._t.call(ops.create_access(self._sb.id, port, expires_in))

    def list(self) -> List[models.AccessGrant]:
        return self._t.call(ops.list_access(self._sb.id))

    def revoke(self, grant: Union[str, models.AccessGrant]) -> None:
        """Revokes one grant; its open connections close at once."""
        gid = grant.id if isinstance(grant, models.AccessGrant) else grant
        self._t.call(ops.revoke_access(self._sb.id, gid))

    def revoke_all(self) -> None:
        self._t.call(ops.revoke_all_access(self._sb.id))


class Sandboxes:
    def __init__(self, client: "Hutch"):
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
    ) -> Sandbox:
        """Creates a sandbox and waits (up to `wait`, 5 minutes by default)
        until it runs. `ttl` is its lifetime ("10m", 600); `network` its
        policy ("deny_all", "private", {"egress": "default", "allow": [...]}).
        `storage` is "disk" or "memory"; `snapshot` starts it from a snapshot
        (id or name) instead of a template; `on_expire="pause"` pauses it at
        its expiry instead of ending it, kept `paused_ttl` ("7d" by default);
        `idle_timeout` ("10m") pauses it (or with `on_idle="delete"` ends it)
        after that long with no API use and no command running.
        A retry after a dropped connection gets the same sandbox."""
        call = ops.create_sandbox(
            template=template, ttl=ttl, memory_mb=memory_mb, vcpus=vcpus, disk_mib=disk_mib, pids=pids, env=env,
            metadata=metadata, network=network, wait=wait, idempotency_key=idempotency_key,
            default_timeout=self._t.config.timeout, volumes=volumes, storage=storage, snapshot=snapshot,
            on_expire=on_expire, paused_ttl=paused_ttl, idle_timeout=idle_timeout, on_idle=on_idle,
        )
        return Sandbox(self._client, self._t.run(ops.create_sandbox_op(call, wait)))

    def get(self, sandbox_id: str) -> Sandbox:
        """A handle on an existing sandbox."""
        return Sandbox(self._client, self._t.call(ops.get_sandbox(sandbox_id)))

    def list(self, *, limit: Optional[int] = None, cursor: Optional[str] = None,
             owner: Optional[str] = None) -> Page[Sandbox]:
        """One page, newest first; `owner` (admin key): a key id or "*"."""
        page = self._t.call(ops.list_sandboxes(limit, cursor, owner))
        return Page([Sandbox(self._client, i) for i in page.items], page.next_cursor)

    def iter(self, *, owner: Optional[str] = None, page_size: Optional[int] = None) -> Iterator[Sandbox]:
        """Every sandbox (terminated ones included), page after page."""
        cursor = None
        while True:
            page = self.list(limit=page_size, cursor=cursor, owner=owner)
            yield from page.items
            cursor = page.next_cursor
            if not cursor:
                return

    def delete(self, sandbox_id: str) -> models.SandboxInfo:
        return self._t.call(ops.delete_sandbox(sandbox_id))


# --------------------------------------------------------------------------
# Templates, builds, images, keys


class Builds:
    def __init__(self, client: "Hutch"):
        self._t = client._transport

    def list(self, template: Union[str, models.Template]) -> List[models.Build]:
        return self._t.call(ops.list_builds(ops.template_id(template)))

    def get(self, template: Union[str, models.Template], build_id: str) -> models.Build:
        return self._t.call(ops.get_build(ops.template_id(template), build_id))

    def logs(self, template: Union[str, models.Template], build_id: str, *, follow: bool = False) -> Iterator[str]:
        """The build's log line by line; `follow` waits for lines until it ends."""
        resp = self._t.open(ops.build_logs(ops.template_id(template), build_id, follow))
        lines = TextLines()
        for chunk in self._t.chunks(resp, 64 << 10):
            yield from lines.feed(chunk)
        yield from lines.end()


class Volumes:
    """Volumes: files that outlive sandboxes (see `sandboxes.create(volumes=...)`)."""

    def __init__(self, client: "Hutch"):
        self._t = client._transport

    def create(self, name: str, *, size_mib: Optional[int] = None) -> models.Volume:
        """A volume of `size_mib` MiB (1024 by default): writes past it fail."""
        return self._t.call(ops.create_volume(name, size_mib))

    def list(self, *, owner: Optional[str] = None) -> List[models.Volume]:
        return self._t.call(ops.list_volumes(owner))

    def get(self, volume: Union[str, models.Volume]) -> models.Volume:
        """By id or name."""
        return self._t.call(ops.get_volume(ops.volume_ref(volume)))

    def resize(self, volume: Union[str, models.Volume], size_mib: int) -> models.Volume:
        """Grows it (`volume_shrink_refused` for a smaller size)."""
        return self._t.call(ops.resize_volume(ops.volume_ref(volume), size_mib))

    def delete(self, volume: Union[str, models.Volume]) -> None:
        """Deletes it and its files (`volume_in_use` while a sandbox mounts it)."""
        self._t.call(ops.delete_volume(ops.volume_ref(volume)))


class Templates:
    def __init__(self, client: "Hutch"):
        self._client = client
        self._t = client._transport
        self.builds = Builds(client)

    def create(
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
        """A template: an image ("base", "python", "node", a store image),
        resources, environment, warm pool (min, max), a startup command and
        a readiness check ({"port": 8080} or {"command": ...})."""
        fields = ops.template_fields(
            image=image, class_=class_, memory_mb=memory_mb, vcpus=vcpus, disk_mib=disk_mib, pids=pids, env=env,
            default_ttl=default_ttl, max_ttl=max_ttl, warm=warm, startup=startup, readiness=readiness,
            network=network,
        )
        return self._t.call(ops.create_template(name, fields))

    def list(self, *, owner: Optional[str] = None) -> List[models.Template]:
        return self._t.call(ops.list_templates(owner))

    def get(self, template: Union[str, models.Template]) -> models.Template:
        return self._t.call(ops.get_template(ops.template_id(template)))

    def update(self, template: Union[str, models.Template], *, image: Any = UNSET, class_: Any = UNSET,
               memory_mb: Any = UNSET, vcpus: Any = UNSET, disk_mib: Any = UNSET, pids: Any = UNSET,
               env: Any = UNSET, default_ttl: Any = UNSET, max_ttl: Any = UNSET, warm: Any = UNSET,
               startup: Any = UNSET, readiness: Any = UNSET, network: Any = UNSET) -> models.Template:
        """Replaces the fields given; `startup=None` / `readiness=None` remove them."""
        fields = ops.template_fields(
            image=image, class_=class_, memory_mb=memory_mb, vcpus=vcpus, disk_mib=disk_mib, pids=pids, env=env,
            default_ttl=default_ttl, max_ttl=max_ttl, warm=warm, startup=startup, readiness=readiness,
            network=network,
        )
        return self._t.call(ops.update_template(ops.template_id(template), fields))

    def delete(self, template: Union[str, models.Template]) -> None:
        self._t.call(ops.delete_template(ops.template_id(template)))

    def build(
        self,
        template: Union[str, models.Template],
        context: ops.BuildContext,
        *,
        on_log: Optional[Callable[[str], Any]] = None,
        wait: bool = True,
        follow_symlinks: bool = False,
    ) -> models.Build:
        """Builds the template from a directory holding a Dockerfile (packed
        as a tar.gz as it is sent), a .tar.gz file, or its bytes. With `wait`
        (the default) follows the log, handing each line to `on_log`, and
        returns the finished build; a failed build raises `BuildError`
        (code `build_failed`, `.build` set)."""
        tid = ops.template_id(template)
        build = self._t.call(ops.start_build(tid, ops.context_body(context, follow_symlinks)))
        if not wait:
            return build
        for line in self.builds.logs(tid, build.id, follow=True):
            if on_log is not None:
                on_log(line)
        return self._t.run(ops.finished_build(tid, build.id))


class Images:
    def __init__(self, client: "Hutch"):
        self._t = client._transport

    def list(self) -> List[models.Image]:
        """Images the caller may name in a template (`base` is built in)."""
        return self._t.call(ops.list_images())


class Snapshots:
    """Snapshots of sandboxes' files (issue 11 adds taking and listing them
    here; the daemon's routes have them already)."""

    def __init__(self, client: "Hutch"):
        self._t = client._transport

    def export_stream(self, snapshot: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
        """The snapshot (its id or a name of the key's) as an image archive
        (an OCI layout and a `docker save` manifest in one tar) as it
        arrives. The request is made at once: a snapshot of a sandbox on
        `base` raises `ConflictError` (`snapshot_not_exportable`) here."""
        resp = self._t.open(ops.export_snapshot(snapshot))
        return self._t.chunks(resp, chunk_size)

    def export(self, snapshot: str, dest: Union[PathLike, BinaryIO]) -> int:
        """Saves the snapshot's image archive to a local path (written beside
        it, then renamed: an export that breaks off leaves nothing) or a
        binary file, for `docker load`, `podman load` or `hutch image
        import`. Returns the bytes written."""
        if not isinstance(dest, (str, os.PathLike)):
            n = 0
            for c in self.export_stream(snapshot):
                dest.write(c)
                n += len(c)
            return n
        target = Path(dest)
        tmp = target.with_name(f".{target.name}.hutch-{os.getpid()}-{id(self)}")
        try:
            with open(tmp, "wb") as f:
                n = self.export(snapshot, f)
            os.replace(tmp, target)
            return n
        finally:
            if tmp.exists():
                tmp.unlink()


class Keys:
    """API keys (the admin key only)."""

    def __init__(self, client: "Hutch"):
        self._t = client._transport

    def list(self) -> List[models.ApiKey]:
        return self._t.call(ops.list_keys())

    def create(self, name: str, *, e2b: bool = False,
               quotas: Union[models.Quotas, Mapping[str, Any], None] = None) -> models.ApiKey:
        """A key (never an admin key); its `secret` is shown only here."""
        return self._t.call(ops.create_key(name, e2b, quotas))

    def update(self, key_id: str, *, quotas: Union[models.Quotas, Mapping[str, Any], None]) -> models.ApiKey:
        """Replaces the key's quotas (one left out is removed)."""
        return self._t.call(ops.set_key_quotas(key_id, quotas))

    def revoke(self, key_id: str) -> None:
        """Revokes it; its sandboxes end now."""
        self._t.call(ops.revoke_key(key_id))

    def rotate_grant_secret(self, key_id: str) -> Dict[str, Any]:
        """Replaces the key's grant secret: every grant it minted is
        refused from now on (the key itself or the admin key)."""
        return self._t.call(ops.rotate_grant_secret(key_id))


# --------------------------------------------------------------------------
# The client


class Hutch:
    """A client of one hutch daemon.

    `base_url` defaults to HUTCH_URL (else http://127.0.0.1:7700), `api_key`
    to HUTCH_API_KEY. `timeout` (seconds or "30s") bounds connecting and
    each wait for an ordinary answer; commands wait as long as their own
    `timeout` allows. `max_retries` connection errors are retried where it is
    safe. Close it (or use it as a context manager) to free its connections."""

    def __init__(
        self,
        base_url: Optional[str] = None,
        api_key: Optional[str] = None,
        *,
        timeout: Duration = 60,
        max_retries: int = 3,
        http_client: Optional[httpx.Client] = None,
    ):
        self.config = Config.make(base_url, api_key, timeout, max_retries)
        self._transport = Transport(self.config, http_client)
        self.sandboxes = Sandboxes(self)
        self.templates = Templates(self)
        self.volumes = Volumes(self)
        self.images = Images(self)
        self.keys = Keys(self)
        self.snapshots = Snapshots(self)

    @property
    def base_url(self) -> str:
        return self.config.base_url

    def run(
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
        """One command in a fresh sandbox, destroyed before the answer
        (`POST /v1/executions`); `sandbox_id` names it."""
        return self._transport.call(
            ops.execution_call(
                command, template=template, memory_mb=memory_mb, vcpus=vcpus, disk_mib=disk_mib, pids=pids,
                network=network, env=env, cwd=cwd, user=user, timeout=timeout, keep_output=keep_output,
                stdin=stdin, idempotency_key=idempotency_key, default_timeout=self.config.timeout,
            )
        )

    def usage(self, key: Optional[str] = None) -> models.Usage:
        """What the caller's key (or, for the admin key, `key`) holds against its quotas."""
        return self._transport.call(ops.usage(key))

    def health(self) -> bool:
        return self._transport.call(ops.health())

    def metrics(self) -> str:
        """Prometheus text (figures of the caller's own templates and the host's)."""
        return self._transport.call(ops.metrics())

    def openapi(self) -> Dict[str, Any]:
        return self._transport.call(ops.openapi())

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> "Hutch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
