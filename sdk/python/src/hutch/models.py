"""Typed views of the API's answers.

Each model is a frozen dataclass built from the JSON the daemon sent; fields
the daemon adds later are kept in `raw` (the answer as sent), so an older SDK
never fails on a newer daemon. Times are RFC 3339 strings in UTC as the API
gives them; `expires_at_datetime`-style helpers parse them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Dict, List, Mapping, Optional, Union


def parse_time(value: Optional[str]) -> Optional[datetime]:
    """An RFC 3339 time of the API as an aware datetime (None stays None)."""
    if value is None:
        return None
    text = value.replace("Z", "+00:00")
    # fromisoformat before 3.11 takes at most 6 fraction digits.
    if "." in text:
        head, _, rest = text.partition(".")
        digits = len(rest) - len(rest.lstrip("0123456789"))
        text = head + "." + rest[:digits][:6].ljust(6, "0") + rest[digits:]
    return datetime.fromisoformat(text)


def _str_map(value: Any) -> Dict[str, str]:
    return dict(value) if isinstance(value, Mapping) else {}


@dataclass(frozen=True)
class Limits:
    vcpus: Optional[float] = None
    disk_mib: Optional[int] = None
    pids: Optional[int] = None
    #: `enforced` once the host applied every cap, `unknown` before (sandboxes only).
    applied: Optional[str] = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Limits":
        return cls(vcpus=d.get("vcpus"), disk_mib=d.get("disk_mib"), pids=d.get("pids"), applied=d.get("applied"))


@dataclass(frozen=True)
class Network:
    """A sandbox's or a template's network policy.

    `applied` (sandboxes only) is what the daemon observed on the host;
    `addresses` the sandbox's addresses."""

    egress: str = "default"
    allow: List[str] = field(default_factory=list)
    deny: List[str] = field(default_factory=list)
    applied: Optional[str] = None
    addresses: List[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Network":
        return cls(
            egress=d.get("egress", "default"),
            allow=list(d.get("allow") or []),
            deny=list(d.get("deny") or []),
            applied=d.get("applied"),
            addresses=list(d.get("addresses") or []),
        )


@dataclass(frozen=True)
class SandboxInfo:
    """A sandbox as `GET /v1/sandboxes/{id}` shows it."""

    id: str
    template: str
    #: starting, running, suspended, paused, terminating, terminated, lost
    state: str
    created_at: str
    expires_at: str
    memory_mb: int
    limits: Limits
    metadata: Dict[str, str]
    network: Network
    owner: str = ""
    last_error_code: Optional[str] = None
    warm: bool = False
    template_id: Optional[str] = None
    template_version: Optional[int] = None
    #: disk or memory: where its files live
    storage: str = "disk"
    #: the snapshot it started from, if any
    snapshot: Optional[str] = None
    #: delete or pause: what happens at its expiry
    on_expire: str = "delete"
    #: how long it is kept once paused at its expiry (seconds)
    paused_ttl_seconds: int = 0
    #: its idle timeout (seconds) and what idleness does, when it has one
    idle_timeout_seconds: Optional[int] = None
    on_idle: Optional[str] = None
    #: since when it is idle (RFC 3339); None while a command runs
    idle_since: Optional[str] = None
    #: the node (daemon) it lives on, which alone acts on it
    node: str = ""
    #: why it is in its state, in words, when known (a lost node's name)
    reason: Optional[str] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "SandboxInfo":
        return cls(
            id=d["id"],
            template=d.get("template", "base"),
            state=d["state"],
            created_at=d.get("created_at", ""),
            expires_at=d.get("expires_at", ""),
            memory_mb=d.get("memory_mb", 0),
            limits=Limits.from_json(d.get("limits") or {}),
            metadata=_str_map(d.get("metadata")),
            network=Network.from_json(d.get("network") or {}),
            owner=d.get("owner", ""),
            last_error_code=d.get("last_error_code"),
            warm=bool(d.get("warm", False)),
            template_id=d.get("template_id"),
            template_version=d.get("template_version"),
            storage=d.get("storage", "disk"),
            snapshot=d.get("snapshot"),
            on_expire=d.get("on_expire", "delete"),
            paused_ttl_seconds=int(d.get("paused_ttl_seconds", 0)),
            idle_timeout_seconds=d.get("idle_timeout_seconds"),
            on_idle=d.get("on_idle"),
            idle_since=d.get("idle_since"),
            node=d.get("node", ""),
            reason=d.get("reason"),
            raw=dict(d),
        )

    @property
    def expires_at_datetime(self) -> Optional[datetime]:
        return parse_time(self.expires_at)


@dataclass(frozen=True)
class ExecResult:
    """A finished command. Each stream is capped at 1 MiB (`*_truncated`)."""

    stdout: str
    stderr: str
    exit_code: int
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    #: The OOM killer ended it (exit_code 137).
    oom_killed: bool = False
    #: Processes it started outlived it (they hold its slot; see `processes()`).
    descendants_alive: bool = False
    duration_ms: int = 0
    output_kept: bool = True
    #: Set for one-shot executions (`client.run`): the sandbox it ran in, now gone.
    sandbox_id: Optional[str] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ExecResult":
        return cls(
            stdout=d.get("stdout", ""),
            stderr=d.get("stderr", ""),
            exit_code=d["exit_code"],
            stdout_truncated=bool(d.get("stdout_truncated", False)),
            stderr_truncated=bool(d.get("stderr_truncated", False)),
            timed_out=bool(d.get("timed_out", False)),
            oom_killed=bool(d.get("oom_killed", False)),
            descendants_alive=bool(d.get("descendants_alive", False)),
            duration_ms=d.get("duration_ms", 0),
            output_kept=bool(d.get("output_kept", True)),
            sandbox_id=d.get("sandbox_id"),
            raw=dict(d),
        )


# ---- command stream events (NDJSON): start, stdout, stderr, ping, exit


@dataclass(frozen=True)
class StartEvent:
    pid: int
    type: str = "start"


@dataclass(frozen=True)
class StdoutEvent:
    data: str
    type: str = "stdout"


@dataclass(frozen=True)
class StderrEvent:
    data: str
    type: str = "stderr"


@dataclass(frozen=True)
class PingEvent:
    """Sent every 15 s while nothing else is; skipped unless asked for."""

    type: str = "ping"


@dataclass(frozen=True)
class ExitEvent:
    exit_code: int
    timed_out: bool = False
    duration_ms: int = 0
    oom_killed: bool = False
    descendants_alive: bool = False
    type: str = "exit"


@dataclass(frozen=True)
class UnknownEvent:
    """An event type this SDK does not know (a newer daemon's)."""

    type: str
    raw: Dict[str, Any] = field(default_factory=dict)


ExecEvent = Union[StartEvent, StdoutEvent, StderrEvent, PingEvent, ExitEvent, UnknownEvent]


@dataclass(frozen=True)
class ProcessInfo:
    """A command holding a slot (`GET /v1/sandboxes/{id}/processes`)."""

    pid: int
    command: List[str]
    user: str
    cwd: str
    tag: Optional[str] = None
    main_exited: bool = False
    exit_code: Optional[int] = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ProcessInfo":
        return cls(
            pid=d["pid"],
            command=list(d.get("command") or []),
            user=d.get("user", ""),
            cwd=d.get("cwd", ""),
            tag=d.get("tag"),
            main_exited=bool(d.get("main_exited", False)),
            exit_code=d.get("exit_code"),
        )


@dataclass(frozen=True)
class FileEntry:
    """One entry of a listing; `path` is relative to the listed directory."""

    path: str
    #: file, directory, symlink or other
    type: str
    size: int
    mode: int
    sha256: Optional[str] = None
    #: why no digest: budget, unreadable or changing
    sha256_skipped: Optional[str] = None
    #: a directory the user cannot list
    unreadable: bool = False

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "FileEntry":
        return cls(
            path=d["path"],
            type=d["type"],
            size=d.get("size", 0),
            mode=d.get("mode", 0),
            sha256=d.get("sha256"),
            sha256_skipped=d.get("sha256_skipped"),
            unreadable=bool(d.get("unreadable", False)),
        )


@dataclass(frozen=True)
class ArchiveResult:
    """An archive upload: the target, the files and bytes written."""

    path: str
    files: int
    bytes: int


@dataclass(frozen=True)
class FilePartResult:
    path: str
    offset: int
    size: int
    received: int
    complete: bool


@dataclass(frozen=True)
class Grant:
    """A credential for an end user: `token` reaches one sandbox, for
    `scopes` only, until `expires_at`. Use it as an API key
    (`Hutch(api_key=grant.token)`) or, for a `ports:N` scope, as the port
    proxy's access token. Rotating the key's grant secret revokes it."""

    token: str
    scopes: List[str]
    expires_at: str
    sandbox_id: str

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Grant":
        return cls(token=d["token"], scopes=list(d["scopes"]), expires_at=d["expires_at"],
                   sandbox_id=d["sandbox_id"])


@dataclass(frozen=True)
class AccessGrant:
    """A short-lived credential for one port of a sandbox.

    Send `token` as the `X-Hutch-Sandbox-Token` header (see `headers`) to
    `url` (`http://<id>--<port>.sandboxes.localhost:<port>/`) or `path_url`
    (for clients without wildcard DNS); or POST it as the form field `token`
    to `cookie_url` for a cookie a browser keeps. The token is only in the
    answer to a create."""

    id: str
    port: int
    url: str
    path_url: str
    expires_at: str
    token: Optional[str] = None

    @property
    def headers(self) -> Dict[str, str]:
        if self.token is None:
            raise ValueError("only a newly created grant carries its token")
        return {"X-Hutch-Sandbox-Token": self.token}

    @property
    def cookie_url(self) -> str:
        return self.url + "_hutch/access"

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "AccessGrant":
        return cls(
            id=d["id"],
            port=d["port"],
            url=d["url"],
            path_url=d["path_url"],
            expires_at=d["expires_at"],
            token=d.get("token"),
        )


@dataclass(frozen=True)
class Warm:
    min: int = 0
    max: int = 0


@dataclass(frozen=True)
class Readiness:
    command: Optional[str] = None
    port: Optional[int] = None
    timeout_seconds: Optional[int] = None


@dataclass(frozen=True)
class Template:
    id: str
    name: str
    version: int
    image: str
    class_: str
    memory_mb: int
    limits: Limits
    env: Dict[str, str]
    default_ttl_seconds: int
    max_ttl_seconds: int
    warm: Warm
    warm_ready: int
    network: Network
    created_at: str
    updated_at: str
    owner: str = ""
    #: the startup command, if any
    startup: Optional[str] = None
    readiness: Optional[Readiness] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Template":
        warm = d.get("warm") or {}
        ready = d.get("readiness")
        startup = d.get("startup")
        return cls(
            id=d["id"],
            name=d["name"],
            version=d["version"],
            image=d.get("image", "base"),
            class_=d.get("class", "container"),
            memory_mb=d.get("memory_mb", 0),
            limits=Limits.from_json(d.get("limits") or {}),
            env=_str_map(d.get("env")),
            default_ttl_seconds=d.get("default_ttl_seconds", 0),
            max_ttl_seconds=d.get("max_ttl_seconds", 0),
            warm=Warm(min=warm.get("min", 0), max=warm.get("max", 0)),
            warm_ready=d.get("warm_ready", 0),
            network=Network.from_json(d.get("network") or {}),
            created_at=d.get("created_at", ""),
            updated_at=d.get("updated_at", ""),
            owner=d.get("owner", ""),
            startup=startup.get("command") if isinstance(startup, Mapping) else None,
            readiness=Readiness(
                command=ready.get("command"), port=ready.get("port"), timeout_seconds=ready.get("timeout_seconds")
            )
            if isinstance(ready, Mapping)
            else None,
            raw=dict(d),
        )


@dataclass(frozen=True)
class Build:
    """A template build: queued, building, succeeded or failed."""

    id: str
    template_id: str
    state: str
    created_at: str
    finished_at: Optional[str] = None
    #: why it failed: the step and its exit code, or the check that did not pass
    error: Optional[str] = None
    #: the template version it made, once it succeeded
    version: Optional[int] = None

    @property
    def done(self) -> bool:
        return self.state in ("succeeded", "failed")

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Build":
        return cls(
            id=d["id"],
            template_id=d["template_id"],
            state=d["state"],
            created_at=d.get("created_at", ""),
            finished_at=d.get("finished_at"),
            error=d.get("error"),
            version=d.get("version"),
        )


@dataclass(frozen=True)
class Image:
    name: str
    layers: int
    size_bytes: int
    #: debian:SUITE+PACKAGES, import:FILE, pull:REF, build ...
    source: str
    created_at: str

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Image":
        return cls(
            name=d["name"],
            layers=d.get("layers", 0),
            size_bytes=d.get("size_bytes", 0),
            source=d.get("source", ""),
            created_at=d.get("created_at", ""),
        )


@dataclass(frozen=True)
class Quotas:
    """A key's caps; None: no cap of the key's own."""

    max_sandboxes: Optional[int] = None
    max_memory_mb: Optional[int] = None
    max_disk_mib: Optional[int] = None
    max_ttl_seconds: Optional[int] = None
    max_builds: Optional[int] = None

    def to_json(self) -> Dict[str, int]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    @classmethod
    def from_json(cls, d: Optional[Mapping[str, Any]]) -> "Quotas":
        d = d or {}
        return cls(
            max_sandboxes=d.get("max_sandboxes"),
            max_memory_mb=d.get("max_memory_mb"),
            max_disk_mib=d.get("max_disk_mib"),
            max_ttl_seconds=d.get("max_ttl_seconds"),
            max_builds=d.get("max_builds"),
        )


@dataclass(frozen=True)
class ApiKey:
    id: str
    name: str
    created_at: str
    admin: bool = False
    revoked_at: Optional[str] = None
    quotas: Quotas = field(default_factory=Quotas)
    #: only in the answer to a create, shown once
    secret: Optional[str] = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ApiKey":
        return cls(
            id=d["id"],
            name=d["name"],
            created_at=d.get("created_at", ""),
            admin=bool(d.get("admin", False)),
            revoked_at=d.get("revoked_at"),
            quotas=Quotas.from_json(d.get("quotas")),
            secret=d.get("secret"),
        )


@dataclass(frozen=True)
class Usage:
    """What a key holds now against its quotas."""

    key_id: str
    sandboxes: int
    memory_mb: int
    disk_mib: int
    builds: int
    quotas: Quotas
    #: volumes kept, and the MiB they may hold (counted in `disk_mib` too)
    volumes: int = 0
    volume_mib: int = 0

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Usage":
        return cls(
            key_id=d["key_id"],
            sandboxes=d.get("sandboxes", 0),
            memory_mb=d.get("memory_mb", 0),
            disk_mib=d.get("disk_mib", 0),
            builds=d.get("builds", 0),
            quotas=Quotas.from_json(d.get("quotas")),
            volumes=d.get("volumes", 0),
            volume_mib=d.get("volume_mib", 0),
        )


@dataclass(frozen=True)
class VolumeHolder:
    """A sandbox (not ended) that mounts a volume."""

    sandbox_id: str
    path: str
    read_only: bool

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "VolumeHolder":
        return cls(sandbox_id=d["sandbox_id"], path=d["path"], read_only=bool(d.get("read_only")))


@dataclass(frozen=True)
class Volume:
    """Files that outlive sandboxes, mounted by them at their creation."""

    id: str
    name: str
    size_mib: int
    used_bytes: int
    mounted_by: List[VolumeHolder]
    created_at: str
    owner: str = ""
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Volume":
        return cls(
            id=d["id"],
            name=d["name"],
            size_mib=d.get("size_mib", 0),
            used_bytes=d.get("used_bytes", 0),
            mounted_by=[VolumeHolder.from_json(h) for h in d.get("mounted_by") or []],
            created_at=d.get("created_at", ""),
            owner=d.get("owner", ""),
            raw=dict(d),
        )
