"""Every API operation, once: what to send and how to read the answer.

Each function returns a `Call` (one request) or an operation generator that
yields `Call`s and receives their parsed answers (several requests: file
parts). The sync and the async client run the same calls; they differ only
in how they wait.

Where the state routes of issue 11 go when the daemon has them: snapshot,
fork and diff of a sandbox beside `exec` below (`snapshot_sandbox`,
`fork_sandbox`, `diff_sandbox`), `/v1/snapshots` and `/v1/volumes` as
sections of their own like templates (volumes are there); `create_sandbox`
then takes `snapshot=` (it takes `volumes=`).
"""

from __future__ import annotations

import base64
import hashlib
import os
import signal as _signal
import time
from pathlib import Path
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any, BinaryIO, Dict, Generator, Generic, Iterator, List, Mapping, Optional, Sequence, TypeVar, Union

from . import models
from ._archive import form_chunks, gzip_chunks, new_boundary, tar_chunks
from ._core import (
    DEFAULT_TIMEOUT,
    Body,
    Call,
    Reply,
    as_json,
    data_body,
    local_file_body,
    idempotency_headers,
    json_body,
    no_content,
    query,
    seg,
)
from ._duration import Duration, parse_duration, whole_seconds
from ._errors import BuildError, error_for

T = TypeVar("T")

#: Seconds added to a command's own timeout before the client stops waiting
#: for its answer (the daemon ends it at its timeout and then answers).
EXEC_GRACE = 30.0
#: Largest part of a file-parts upload (the daemon's cap, decoded).
PART_CAP = 8 << 20
#: Largest file the base64 routes take.
INLINE_CAP = 8 << 20

Command = Union[str, Sequence[str]]
NetworkSpec = Union[str, Mapping[str, Any], models.Network]
Signal = Union[str, int, _signal.Signals]
#: A mount: `{"name", "path", "read_only"}`, or `"NAME:/path[:ro]"` as the CLI takes it.
VolumeSpec = Union[str, Mapping[str, Any]]



@dataclass
class Sleep:
    """An operation's pause (between polls)."""

    seconds: float


Op = Generator[Union[Call[Any], Sleep], Any, T]


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


#: A field left out of an update (`None` removes startup/readiness).
UNSET: Any = _Unset()


@dataclass
class Page(Generic[T]):
    """One page of a listing; iterate it for its items; `next_cursor` asks for
    the next (None on the last page)."""

    items: List[T]
    next_cursor: Optional[str] = None

    def __iter__(self) -> Iterator[T]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


def _drop_none(d: Mapping[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _obj(value: Any) -> Any:
    """A dataclass or mapping as a JSON object without its None fields."""
    if value is None:
        return None
    if is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    if isinstance(value, Mapping):
        return _drop_none(value)
    raise TypeError(f"expected a mapping, got {type(value).__name__}")


def network_json(spec: Optional[NetworkSpec]) -> Optional[Dict[str, Any]]:
    """`network` of a create: "deny_all", {"egress": ..., "allow": [...]} or a Network."""
    if spec is None:
        return None
    if isinstance(spec, str):
        return {"egress": spec}
    if isinstance(spec, models.Network):
        out: Dict[str, Any] = {"egress": spec.egress}
        if spec.allow:
            out["allow"] = list(spec.allow)
        if spec.deny:
            out["deny"] = list(spec.deny)
        return out
    return dict(_obj(spec))


def limits_json(vcpus: Optional[float], disk_mib: Optional[int], pids: Optional[int]) -> Optional[Dict[str, Any]]:
    limits = _drop_none({"vcpus": vcpus, "disk_mib": disk_mib, "pids": pids})
    return limits or None


def _seconds(value: Optional[Duration], what: str) -> Optional[int]:
    return None if value is None else whole_seconds(value, what)


# --------------------------------------------------------------------------
# Sandboxes


def _sandbox(reply: Reply) -> models.SandboxInfo:
    return models.SandboxInfo.from_json(reply.json())


def create_sandbox(
    *,
    template: Optional[str],
    ttl: Optional[Duration],
    memory_mb: Optional[int],
    vcpus: Optional[float],
    disk_mib: Optional[int],
    pids: Optional[int],
    env: Optional[Mapping[str, str]],
    metadata: Optional[Mapping[str, str]],
    network: Optional[NetworkSpec],
    wait: Optional[Duration],
    idempotency_key: Optional[str],
    default_timeout: float,
    volumes: Optional[Sequence[VolumeSpec]] = None,
    storage: Optional[str] = None,
    snapshot: Optional[str] = None,
    on_expire: Optional[str] = None,
    paused_ttl: Optional[Duration] = None,
    idle_timeout: Optional[Duration] = None,
    on_idle: Optional[str] = None,
) -> Call[models.SandboxInfo]:
    wait_seconds = None if wait is None else min(whole_seconds(wait, "wait"), DAEMON_WAIT_CAP)
    body = _drop_none(
        {
            "template": template,
            "ttl_seconds": _seconds(ttl, "ttl"),
            "memory_mb": memory_mb,
            "limits": limits_json(vcpus, disk_mib, pids),
            "env": dict(env) if env else None,
            "metadata": dict(metadata) if metadata else None,
            "network": network_json(network),
            "wait_seconds": wait_seconds,
            "volumes": volumes_json(volumes),
            "storage": storage,
            "snapshot": snapshot,
            "on_expire": on_expire,
            "paused_ttl_seconds": _seconds(paused_ttl, "paused_ttl"),
            "idle_timeout_seconds": _seconds(idle_timeout, "idle_timeout"),
            "on_idle": on_idle,
        }
    )
    return Call(
        "POST",
        "/v1/sandboxes",
        _sandbox,
        body=json_body(body),
        headers=idempotency_headers(idempotency_key),
        resend=True,
        # The daemon waits up to wait_seconds (10 by default) for the start.
        read_timeout=default_timeout + (10 if wait_seconds is None else wait_seconds),
    )


#: Most seconds one create asks the daemon to wait; longer waits poll.
DAEMON_WAIT_CAP = 60


def create_sandbox_op(create: Call[models.SandboxInfo], wait: Optional[Duration]) -> Op[models.SandboxInfo]:
    """Creates, then polls while the sandbox is `starting` (a preset image
    building, a slow readiness check) for up to `wait` seconds in all."""
    wait = None if wait is None else parse_duration(wait, "wait")
    started = time.monotonic()
    info: models.SandboxInfo = yield create
    delay = 0.1
    while info.state == "starting" and wait is not None and time.monotonic() - started < wait:
        yield Sleep(delay)
        delay = min(delay * 2, 2.0)
        info = yield get_sandbox(info.id)
    if info.state in ("terminating", "terminated") and info.last_error_code:
        raise error_for(info.last_error_code, f"sandbox {info.id} did not start ({info.last_error_code})")
    return info


def get_sandbox(sandbox_id: str) -> Call[models.SandboxInfo]:
    return Call("GET", f"/v1/sandboxes/{seg(sandbox_id)}", _sandbox, resend=True)


def list_sandboxes(
    limit: Optional[int], cursor: Optional[str], owner: Optional[str]
) -> Call[Page[models.SandboxInfo]]:
    def parse(reply: Reply) -> Page[models.SandboxInfo]:
        d = reply.json()
        return Page([models.SandboxInfo.from_json(s) for s in d["sandboxes"]], d.get("next_cursor"))

    return Call("GET", "/v1/sandboxes", parse, params=query(limit=limit, cursor=cursor, owner=owner), resend=True)


def delete_sandbox(sandbox_id: str) -> Call[models.SandboxInfo]:
    # Terminating is idempotent.
    return Call("DELETE", f"/v1/sandboxes/{seg(sandbox_id)}", _sandbox, resend=True)


def extend_sandbox(sandbox_id: str, by: Optional[Duration], until: Optional[str]) -> Call[models.SandboxInfo]:
    if (by is None) == (until is None):
        raise ValueError("extend takes exactly one of by= and until=")
    body = {"by": whole_seconds(by, "by")} if by is not None else {"until": until}
    # `until` sets an absolute expiry: sending it twice is harmless; `by` adds.
    return Call("POST", f"/v1/sandboxes/{seg(sandbox_id)}/extend", _sandbox, body=json_body(body),
                resend=until is not None)


def suspend_sandbox(sandbox_id: str) -> Call[models.SandboxInfo]:
    return Call("POST", f"/v1/sandboxes/{seg(sandbox_id)}/suspend", _sandbox)


def resume_sandbox(sandbox_id: str) -> Call[models.SandboxInfo]:
    return Call("POST", f"/v1/sandboxes/{seg(sandbox_id)}/resume", _sandbox)


# --------------------------------------------------------------------------
# Commands


def exec_body(
    command: Command,
    *,
    env: Optional[Mapping[str, str]] = None,
    cwd: Optional[str] = None,
    user: Optional[str] = None,
    timeout: Optional[Duration] = None,
    keep_output: Optional[bool] = None,
    stdin: Union[str, bytes, None] = None,
    background: bool = False,
) -> Dict[str, Any]:
    """The JSON of a command: a string runs in a shell, a sequence as argv."""
    body: Dict[str, Any] = {}
    if isinstance(command, str):
        body["command"] = command
    elif isinstance(command, (bytes, bytearray)):
        raise TypeError("command: pass a str (run in a shell) or a sequence of str (argv)")
    else:
        argv = list(command)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise TypeError("argv: a non-empty sequence of str")
        body["argv"] = argv
    if env:
        body["env"] = dict(env)
    if cwd is not None:
        body["cwd"] = cwd
    if user is not None:
        body["user"] = user
    if timeout is not None:
        body["timeout_seconds"] = whole_seconds(timeout, "timeout")
    if keep_output is not None:
        body["keep_output"] = keep_output
    if stdin is not None:
        if isinstance(stdin, (bytes, bytearray)):
            try:
                stdin = bytes(stdin).decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError("stdin: the API takes UTF-8 text; write binary data to a file instead") from None
        body["stdin"] = stdin
    if background:
        body["background"] = True
    return body


def _answer_wait(body: Mapping[str, Any], extra: float = 0.0) -> Optional[float]:
    """How long to wait for a command's answer: its timeout and a grace, or
    as long as it runs when it has none."""
    t = body.get("timeout_seconds")
    return None if t is None else t + EXEC_GRACE + extra


def exec_call(sandbox_id: str, body: Dict[str, Any], idempotency_key: Optional[str]) -> Call[models.ExecResult]:
    def parse(reply: Reply) -> models.ExecResult:
        return models.ExecResult.from_json(reply.json())

    return Call(
        "POST",
        f"/v1/sandboxes/{seg(sandbox_id)}/exec",
        parse,
        body=json_body(body),
        headers=idempotency_headers(idempotency_key),
        resend=True,
        read_timeout=_answer_wait(body),
    )


def exec_background_call(sandbox_id: str, body: Dict[str, Any], idempotency_key: Optional[str]) -> Call[int]:
    def parse(reply: Reply) -> int:
        return int(reply.json()["pid"])

    return Call(
        "POST",
        f"/v1/sandboxes/{seg(sandbox_id)}/exec",
        parse,
        body=json_body(body),
        headers=idempotency_headers(idempotency_key),
        resend=True,
    )


def exec_stream_call(sandbox_id: str, body: Dict[str, Any], idempotency_key: Optional[str]) -> Call[None]:
    headers = idempotency_headers(idempotency_key)
    headers["Accept"] = "application/x-ndjson"
    # The daemon pings every 15 s: a minute of silence is a dead connection.
    return Call(
        "POST",
        f"/v1/sandboxes/{seg(sandbox_id)}/exec",
        no_content,
        body=json_body(body),
        headers=headers,
        resend=True,
        read_timeout=60.0,
        stream=True,
    )


def list_processes(sandbox_id: str) -> Call[List[models.ProcessInfo]]:
    def parse(reply: Reply) -> List[models.ProcessInfo]:
        return [models.ProcessInfo.from_json(p) for p in reply.json()["processes"]]

    return Call("GET", f"/v1/sandboxes/{seg(sandbox_id)}/processes", parse, resend=True)


def signal_name(sig: Signal) -> Union[str, int]:
    if isinstance(sig, _signal.Signals):
        return sig.name
    if isinstance(sig, bool) or not isinstance(sig, (str, int)):
        raise TypeError("signal: a name ('TERM', 'SIGKILL'), a number or a signal.Signals")
    return sig


def signal_process(sandbox_id: str, pid: int, sig: Signal) -> Call[None]:
    # Not resent: a signal delivered twice is not the same as once.
    return Call("POST", f"/v1/sandboxes/{seg(sandbox_id)}/processes/{int(pid)}/signal", no_content,
                body=json_body({"signal": signal_name(sig)}))


def write_stdin(sandbox_id: str, pid: int, data: Union[str, bytes], eof: bool) -> Call[None]:
    if isinstance(data, (bytes, bytearray)):
        data = bytes(data).decode("utf-8")
    return Call("POST", f"/v1/sandboxes/{seg(sandbox_id)}/processes/{int(pid)}/stdin", no_content,
                body=json_body({"data": data, "eof": eof}))


def attach_process(sandbox_id: str, pid: int) -> Call[None]:
    return Call("GET", f"/v1/sandboxes/{seg(sandbox_id)}/processes/{int(pid)}/stream", no_content,
                headers={"Accept": "application/x-ndjson"}, resend=True, read_timeout=60.0, stream=True)


def execution_call(
    command: Command,
    *,
    template: Optional[str],
    memory_mb: Optional[int],
    vcpus: Optional[float],
    disk_mib: Optional[int],
    pids: Optional[int],
    network: Optional[NetworkSpec],
    env: Optional[Mapping[str, str]],
    cwd: Optional[str],
    user: Optional[str],
    timeout: Optional[Duration],
    keep_output: Optional[bool],
    stdin: Union[str, bytes, None],
    idempotency_key: Optional[str],
    default_timeout: float,
) -> Call[models.ExecResult]:
    body = exec_body(command, env=env, cwd=cwd, user=user, timeout=timeout, keep_output=keep_output, stdin=stdin)
    body.update(
        _drop_none(
            {
                "template": template,
                "memory_mb": memory_mb,
                "limits": limits_json(vcpus, disk_mib, pids),
                "network": network_json(network),
            }
        )
    )

    def parse(reply: Reply) -> models.ExecResult:
        return models.ExecResult.from_json(reply.json())

    wait = _answer_wait(body, extra=default_timeout)
    return Call("POST", "/v1/executions", parse, body=json_body(body), headers=idempotency_headers(idempotency_key),
                resend=True, read_timeout=wait)


# --------------------------------------------------------------------------
# Files


def _files(sandbox_id: str) -> str:
    return f"/v1/sandboxes/{seg(sandbox_id)}"


def download_file(sandbox_id: str, path: str) -> Call[None]:
    return Call("GET", _files(sandbox_id) + "/files", no_content, params={"path": path},
                headers={"Accept": "application/octet-stream"}, resend=True, stream=True)


def upload_file(sandbox_id: str, path: str, body: Body) -> Call[None]:
    # The daemon writes the whole file or nothing: sending it again (a
    # replayable body) gives the same file.
    return Call("PUT", _files(sandbox_id) + "/files", no_content, params={"path": path}, body=body, resend=True)


def read_base64(sandbox_id: str, path: str) -> Call[bytes]:
    def parse(reply: Reply) -> bytes:
        return base64.b64decode(reply.json()["data"])

    return Call("POST", _files(sandbox_id) + "/files/read", parse, body=json_body({"path": path}), resend=True)


def write_base64(sandbox_id: str, path: str, data: Union[bytes, str]) -> Call[None]:
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if len(raw) > INLINE_CAP:
        raise ValueError(f"write_base64 takes at most {INLINE_CAP} bytes; use write() (streamed) for more")
    body = {"path": path, "data": base64.b64encode(raw).decode()}
    return Call("POST", _files(sandbox_id) + "/files/write", no_content, body=json_body(body), resend=True)


def list_files(
    sandbox_id: str,
    path: Optional[str],
    recursive: Optional[bool],
    include_sha256: Optional[bool],
    limit: Optional[int],
    cursor: Optional[str],
) -> Call[Page[models.FileEntry]]:
    def parse(reply: Reply) -> Page[models.FileEntry]:
        d = reply.json()
        return Page([models.FileEntry.from_json(e) for e in d["entries"]], d.get("next_cursor"))

    params = query(path=path, recursive=recursive, include_sha256=include_sha256, limit=limit, cursor=cursor)
    return Call("GET", _files(sandbox_id) + "/files/list", parse, params=params, resend=True)


def archive_source(archive: Any) -> Body:
    """A tar or tar.gz to upload: a local path, bytes, a binary file or an iterable of bytes."""
    if isinstance(archive, (str, os.PathLike)):
        return local_file_body(archive)
    return data_body(archive)


def dir_source(local_dir: Any, follow_symlinks: bool) -> Body:
    """A local directory, packed as a tar while it is sent (again on a retry)."""
    root = Path(local_dir)
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a directory")
    return Body(factory=lambda: tar_chunks(root, follow_symlinks), content_type="application/x-tar")


def upload_archive(sandbox_id: str, archive: Body, path: str) -> Call[models.ArchiveResult]:
    def parse(reply: Reply) -> models.ArchiveResult:
        d = reply.json()
        return models.ArchiveResult(path=d["path"], files=d["files"], bytes=d["bytes"])

    boundary = new_boundary()

    def form() -> Iterator[bytes]:
        return form_chunks(boundary, {"path": path}, "archive", "archive.tar", archive.chunks())

    ctype = f"multipart/form-data; boundary={boundary}"
    body = Body(once=form(), content_type=ctype) if archive.one_shot else Body(factory=form,
                                                                                       content_type=ctype)
    # All or nothing on the daemon; the same archive again makes the same tree.
    return Call("POST", _files(sandbox_id) + "/archives", parse, body=body, resend=True, read_timeout=None)


def download_archive(sandbox_id: str, path: str) -> Call[None]:
    return Call("GET", _files(sandbox_id) + "/archives", no_content, params={"path": path},
                headers={"Accept": "application/x-tar"}, resend=True, stream=True)


def file_part(sandbox_id: str, path: str, offset: int, size: int, sha256: str,
              data: bytes) -> Call[models.FilePartResult]:
    def parse(reply: Reply) -> models.FilePartResult:
        d = reply.json()
        return models.FilePartResult(path=d["path"], offset=d["offset"], size=d["size"], received=d["received"],
                                     complete=d["complete"])

    body = {"path": path, "offset": offset, "size": size, "sha256": sha256,
            "data": base64.b64encode(data).decode()}
    # A part may be resent from any offset up to what was received.
    return Call("POST", _files(sandbox_id) + "/file-parts", parse, body=json_body(body), resend=True)


def upload_parts(sandbox_id: str, f: BinaryIO, path: str, part_size: int) -> Op[models.FilePartResult]:
    """Sends a seekable binary file in parts of `part_size` bytes: one pass for
    its SHA-256, then the parts, each held only while it is sent."""
    if not 0 < part_size <= PART_CAP:
        raise ValueError(f"part_size must be 1 to {PART_CAP} bytes")
    start = f.tell()
    digest = hashlib.sha256()
    size = 0
    while True:
        chunk = f.read(1 << 20)
        if not chunk:
            break
        digest.update(chunk)
        size += len(chunk)
    sha = digest.hexdigest()
    offset = 0
    result: Optional[models.FilePartResult] = None
    while result is None or not result.complete:
        f.seek(start + offset)
        data = f.read(min(part_size, size - offset))
        result = yield file_part(sandbox_id, path, offset, size, sha, data)
        assert result is not None
        offset = result.received
    return result


# --------------------------------------------------------------------------
# Port access


def _grant(reply: Reply) -> models.AccessGrant:
    return models.AccessGrant.from_json(reply.json())


def create_access(sandbox_id: str, port: int, expires_in: Optional[Duration]) -> Call[models.AccessGrant]:
    body = _drop_none({"port": port, "expires_in_seconds": _seconds(expires_in, "expires_in")})
    return Call("POST", _files(sandbox_id) + "/access", _grant, body=json_body(body))


def create_grant(sandbox_id: str, scopes: Sequence[str], ttl: Duration) -> Call[models.Grant]:
    body = {"scopes": list(scopes), "ttl_seconds": whole_seconds(ttl, "ttl")}
    return Call("POST", _files(sandbox_id) + "/grants", lambda r: models.Grant.from_json(r.json()),
                body=json_body(body))


def rotate_grant_secret(key_id: str) -> Call[Dict[str, Any]]:
    return Call("POST", f"/v1/keys/{seg(key_id)}/grant-secret/rotate", lambda r: r.json())


def list_access(sandbox_id: str) -> Call[List[models.AccessGrant]]:
    def parse(reply: Reply) -> List[models.AccessGrant]:
        return [models.AccessGrant.from_json(g) for g in reply.json()["grants"]]

    return Call("GET", _files(sandbox_id) + "/access", parse, resend=True)


def revoke_access(sandbox_id: str, grant_id: str) -> Call[None]:
    return Call("DELETE", _files(sandbox_id) + f"/access/{seg(grant_id)}", no_content, resend=True)


def revoke_all_access(sandbox_id: str) -> Call[None]:
    return Call("DELETE", _files(sandbox_id) + "/access", no_content, resend=True)


# --------------------------------------------------------------------------
# Volumes


def volumes_json(volumes: Optional[Sequence[VolumeSpec]]) -> Optional[List[Dict[str, Any]]]:
    """The `volumes` of a create: mappings as given, "NAME:/path[:ro]" read."""
    if not volumes:
        return None
    out: List[Dict[str, Any]] = []
    for v in volumes:
        if isinstance(v, str):
            name, sep, rest = v.partition(":")
            path, read_only = rest, False
            for suffix, ro in ((":ro", True), (":rw", False)):
                if rest.endswith(suffix):
                    path, read_only = rest[: -len(suffix)], ro
            if not sep or not name or not path.startswith("/"):
                raise ValueError(f"volume {v!r}: give NAME:/path[:ro]")
            out.append({"name": name, "path": path, "read_only": read_only})
        elif isinstance(v, Mapping):
            out.append(dict(v))
        else:
            raise TypeError("a volume mount is a mapping or 'NAME:/path[:ro]'")
    return out


def _volume(reply: Reply) -> models.Volume:
    return models.Volume.from_json(reply.json())


def volume_ref(volume: Union[str, models.Volume]) -> str:
    return volume.id if isinstance(volume, models.Volume) else volume


def create_volume(name: str, size_mib: Optional[int]) -> Call[models.Volume]:
    # Not resent: a second create would be `volume_name_taken`.
    return Call("POST", "/v1/volumes", _volume, body=json_body(_drop_none({"name": name, "size_mib": size_mib})))


def list_volumes(owner: Optional[str]) -> Call[List[models.Volume]]:
    def parse(reply: Reply) -> List[models.Volume]:
        return [models.Volume.from_json(v) for v in reply.json()["volumes"]]

    return Call("GET", "/v1/volumes", parse, params=query(owner=owner), resend=True)


def get_volume(volume: str) -> Call[models.Volume]:
    return Call("GET", f"/v1/volumes/{seg(volume)}", _volume, resend=True)


def resize_volume(volume: str, size_mib: int) -> Call[models.Volume]:
    return Call("PATCH", f"/v1/volumes/{seg(volume)}", _volume, body=json_body({"size_mib": size_mib}), resend=True)


def delete_volume(volume: str) -> Call[None]:
    return Call("DELETE", f"/v1/volumes/{seg(volume)}", no_content)


# --------------------------------------------------------------------------
# Templates and builds


def _template(reply: Reply) -> models.Template:
    return models.Template.from_json(reply.json())


def _startup(value: Any) -> Any:
    if value is None or isinstance(value, Mapping):
        return value
    if isinstance(value, str):
        return {"command": value}
    raise TypeError("startup: a command string")


def _warm(value: Any) -> Any:
    if isinstance(value, tuple):
        lo, hi = value
        return {"min": lo, "max": hi}
    return _obj(value)


def template_fields(
    *,
    image: Any = UNSET,
    class_: Any = UNSET,
    memory_mb: Any = UNSET,
    vcpus: Any = UNSET,
    disk_mib: Any = UNSET,
    pids: Any = UNSET,
    env: Any = UNSET,
    default_ttl: Any = UNSET,
    max_ttl: Any = UNSET,
    warm: Any = UNSET,
    startup: Any = UNSET,
    readiness: Any = UNSET,
    network: Any = UNSET,
) -> Dict[str, Any]:
    """The JSON of a template's fields; UNSET ones are left out, and for an
    update `startup=None`/`readiness=None` send null (remove it)."""
    out: Dict[str, Any] = {}
    if image is not UNSET and image is not None:
        out["image"] = image
    if class_ is not UNSET and class_ is not None:
        out["class"] = class_
    if memory_mb is not UNSET and memory_mb is not None:
        out["memory_mb"] = memory_mb
    limits = {k: v for k, v in (("vcpus", vcpus), ("disk_mib", disk_mib), ("pids", pids))
              if v is not UNSET and v is not None}
    if limits:
        out["limits"] = limits
    if env is not UNSET and env is not None:
        out["env"] = dict(env)
    if default_ttl is not UNSET and default_ttl is not None:
        out["default_ttl_seconds"] = whole_seconds(default_ttl, "default_ttl")
    if max_ttl is not UNSET and max_ttl is not None:
        out["max_ttl_seconds"] = whole_seconds(max_ttl, "max_ttl")
    if warm is not UNSET and warm is not None:
        out["warm"] = _warm(warm)
    if startup is not UNSET:
        out["startup"] = _startup(startup)
    if readiness is not UNSET:
        out["readiness"] = _obj(readiness)
    if network is not UNSET and network is not None:
        out["network"] = network_json(network)
    return out


def create_template(name: str, fields: Dict[str, Any]) -> Call[models.Template]:
    body = {"name": name, **{k: v for k, v in fields.items() if v is not None}}
    # No Idempotency-Key on this route: a lost answer is not resent (a
    # second create would be `template_name_taken`).
    return Call("POST", "/v1/templates", _template, body=json_body(body))


def list_templates(owner: Optional[str]) -> Call[List[models.Template]]:
    def parse(reply: Reply) -> List[models.Template]:
        return [models.Template.from_json(t) for t in reply.json()["templates"]]

    return Call("GET", "/v1/templates", parse, params=query(owner=owner), resend=True)


def get_template(template_id: str) -> Call[models.Template]:
    return Call("GET", f"/v1/templates/{seg(template_id)}", _template, resend=True)


def update_template(template_id: str, fields: Dict[str, Any]) -> Call[models.Template]:
    return Call("PATCH", f"/v1/templates/{seg(template_id)}", _template, body=json_body(fields))


def delete_template(template_id: str) -> Call[None]:
    return Call("DELETE", f"/v1/templates/{seg(template_id)}", no_content)


def _build(reply: Reply) -> models.Build:
    return models.Build.from_json(reply.json())


def start_build(template_id: str, body: Body) -> Call[models.Build]:
    # Not resent: a second request would queue a second build.
    return Call("POST", f"/v1/templates/{seg(template_id)}/builds", _build, body=body)


def list_builds(template_id: str) -> Call[List[models.Build]]:
    def parse(reply: Reply) -> List[models.Build]:
        return [models.Build.from_json(b) for b in reply.json()["builds"]]

    return Call("GET", f"/v1/templates/{seg(template_id)}/builds", parse, resend=True)


def get_build(template_id: str, build_id: str) -> Call[models.Build]:
    return Call("GET", f"/v1/templates/{seg(template_id)}/builds/{seg(build_id)}", _build, resend=True)


def build_logs(template_id: str, build_id: str, follow: bool) -> Call[None]:
    # A step may print nothing for a long time: a follow waits as long as the build runs.
    return Call("GET", f"/v1/templates/{seg(template_id)}/builds/{seg(build_id)}/logs", no_content,
                params=query(follow=follow or None), headers={"Accept": "text/plain"}, resend=True,
                read_timeout=None if follow else DEFAULT_TIMEOUT, stream=True)


BuildContext = Union[str, "os.PathLike[str]", bytes, BinaryIO]


def template_id(template: Union[str, models.Template]) -> str:
    return template.id if isinstance(template, models.Template) else template


def context_body(context: BuildContext, follow_symlinks: bool) -> Body:
    """A build context: a directory (packed as a tar.gz while it is sent), a
    .tar.gz file, or its bytes or binary file."""
    if isinstance(context, (str, os.PathLike)) and Path(context).is_dir():
        root = Path(context)
        return Body(factory=lambda: gzip_chunks(tar_chunks(root, follow_symlinks)), content_type="application/gzip")
    if isinstance(context, (str, os.PathLike)):
        return local_file_body(context, "application/gzip")
    return data_body(context, "application/gzip")


def finished_build(template: str, build_id: str) -> Op[models.Build]:
    """The build once it ended (its log stream ends with it; a short poll
    covers the moment between the two); a failed build raises."""
    build: models.Build = yield get_build(template, build_id)
    delay = 0.05
    for _ in range(40):
        if build.done:
            break
        yield Sleep(delay)
        delay = min(delay * 2, 1.0)
        build = yield get_build(template, build_id)
    if build.state == "failed":
        err = BuildError(f"build {build.id} failed: {build.error}", code="build_failed", body=build)
        err.build = build
        raise err
    return build


def list_images() -> Call[List[models.Image]]:
    def parse(reply: Reply) -> List[models.Image]:
        return [models.Image.from_json(i) for i in reply.json()["images"]]

    return Call("GET", "/v1/images", parse, resend=True)


# --------------------------------------------------------------------------
# Snapshots


def export_snapshot(snapshot: str) -> Call[None]:
    """`GET /v1/snapshots/{id}/export`: an image archive, streamed."""
    return Call("GET", f"/v1/snapshots/{seg(snapshot)}/export", no_content,
                headers={"Accept": "application/x-tar"}, resend=True, stream=True)


# --------------------------------------------------------------------------
# Keys and usage (the admin key)


def _key(reply: Reply) -> models.ApiKey:
    return models.ApiKey.from_json(reply.json())


def _quotas(quotas: Union[models.Quotas, Mapping[str, Any], None]) -> Dict[str, Any]:
    if quotas is None:
        return {}
    if isinstance(quotas, models.Quotas):
        return quotas.to_json()
    return _drop_none(quotas)


def list_keys() -> Call[List[models.ApiKey]]:
    def parse(reply: Reply) -> List[models.ApiKey]:
        return [models.ApiKey.from_json(k) for k in reply.json()["keys"]]

    return Call("GET", "/v1/keys", parse, resend=True)


def create_key(name: str, e2b: bool, quotas: Union[models.Quotas, Mapping[str, Any], None]) -> Call[models.ApiKey]:
    body: Dict[str, Any] = {"name": name, "quotas": _quotas(quotas)}
    if e2b:
        body["e2b"] = True
    return Call("POST", "/v1/keys", _key, body=json_body(body))


def set_key_quotas(key_id: str, quotas: Union[models.Quotas, Mapping[str, Any], None]) -> Call[models.ApiKey]:
    # Replaces the quotas whole: the same request again changes nothing.
    return Call("PATCH", f"/v1/keys/{seg(key_id)}", _key, body=json_body(_quotas(quotas)), resend=True)


def revoke_key(key_id: str) -> Call[None]:
    return Call("DELETE", f"/v1/keys/{seg(key_id)}", no_content, resend=True)


def usage(key: Optional[str]) -> Call[models.Usage]:
    def parse(reply: Reply) -> models.Usage:
        return models.Usage.from_json(reply.json())

    return Call("GET", "/v1/usage", parse, params=query(key=key), resend=True)


# --------------------------------------------------------------------------
# The daemon


def health() -> Call[bool]:
    return Call("GET", "/healthz", lambda r: r.content.strip() == b"ok", resend=True)


def openapi() -> Call[Dict[str, Any]]:
    return Call("GET", "/v1/openapi.json", as_json, resend=True)


def metrics() -> Call[str]:
    return Call("GET", "/metrics", lambda r: r.content.decode(), headers={"Accept": "text/plain"}, resend=True)

