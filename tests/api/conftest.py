"""End-to-end tests of `hutch serve`: fixtures and helpers.

Each test session starts its own daemon (a free port, its own state and run
directories under a temp dir), stops it with SIGTERM by its pid at the end,
and deletes every sandbox any of its API keys created. A test that restarts
the daemon manages its own instance through `Daemon`.

The suite runs as root against real sandboxes (namespaces, cgroups). A
missing binary or a missing privilege fails loudly; nothing is skipped.

Nothing here may hang: every request has a timeout, the daemon has a start
timeout, every wait loop is bounded, and pytest-timeout caps each test.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import resource
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

import pytest
import requests


REPO = Path(__file__).resolve().parents[2]
TRIPLE = "x86_64-unknown-linux-gnu"
DEBUG_BIN = REPO / "target" / TRIPLE / "debug" / "hutch"

# Seconds: every HTTP request, the daemon's start, its stop.
REQUEST_TIMEOUT = 60
START_TIMEOUT = 30
STOP_TIMEOUT = 15
# Per test, enforced by pytest-timeout.
TEST_TIMEOUT = 300

CGROUP_ROOT = Path("/sys/fs/cgroup")

# The isolation class of the sandboxes the suite makes: HUTCH_TEST_CLASS
# (`container` when unset). Every daemon starts with it as its default class
# (`hutch serve --default-class`), so the builtin `base` template and every
# template a test makes without naming a class run in it; scripts/test.sh
# runs the suite again with `gvisor`. Tests that name a class keep theirs.
TEST_CLASS = os.environ.get("HUTCH_TEST_CLASS", "container")

# What the gvisor class's runsc (Debian 12's, 0.0~20221219) does not do; the
# tests that need it are marked with `on_class("gvisor", reason=...)`.
# Its sentry refuses AT_NO_AUTOMOUNT in statx and newfstatat (EINVAL): GNU
# coreutils' `stat` and `ls -l` fail on every path (python's os.stat works).
GVISOR_STATX = "runsc 20221219 refuses statx(AT_NO_AUTOMOUNT): coreutils' stat and ls fail"
# Its gofer refuses user.* extended attributes on the sandbox's files
# (setxattr: EOPNOTSUPP): file metadata kept as xattrs cannot be kept there.
GVISOR_XATTRS = "runsc 20221219's gofer refuses user.* xattrs (EOPNOTSUPP)"
# By design (ARCHITECTURE.md, the gvisor class): the workload has no cgroup
# of its own, so a command past the memory limit is not killed alone.
GVISOR_NO_WORK_CGROUP = "no per-command cgroup: the sentry, not the command, meets the memory limit"
# Not yet diagnosed: a terminal nobody reads does not hold its command back
# as soon (96 MiB went out; the container class stops it within 48).
GVISOR_PTY_BACKPRESSURE = "an unread terminal's output is not held back as soon under gVisor (open)"


def on_class(*classes: str, reason: str, strict: bool = True):
    """Marks a test expected to fail when the suite runs in one of
    `classes`, for a `reason` the class owns (what it does not do);
    strict: a pass there fails the run, so the mark goes once it does (not
    strict: only for a failure seen once and not yet understood)."""
    return pytest.mark.xfail(TEST_CLASS in classes, reason=f"{TEST_CLASS} class: {reason}", strict=strict)



# --------------------------------------------------------------------------
# pytest configuration


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Caps every test's run time so the suite can never hang."""
    if not config.pluginmanager.hasplugin("timeout"):
        raise pytest.UsageError("pytest-timeout is required: pip install -r tests/api/requirements.txt")
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT))


# --------------------------------------------------------------------------
# Small helpers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.05):
    """Polls `predicate` until it returns something truthy; fails after `timeout`."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
        time.sleep(interval)


def cgroup_dirs(sandbox_id: str) -> list[Path]:
    """Every `hutch/<id>` cgroup directory of a sandbox, in any hierarchy."""
    return [p for p in CGROUP_ROOT.glob(f"*/hutch/{sandbox_id}") if p.exists()]


def frozen(sandbox_id: str) -> bool:
    """Whether the kernel reports the sandbox's cgroup frozen: every process
    in it stopped (`freezer.state` FROZEN on cgroup v1, `frozen 1` in
    `cgroup.events` on v2). Fails when the sandbox has no freezer cgroup."""
    dirs = cgroup_dirs(sandbox_id) + [p for p in [CGROUP_ROOT / "hutch" / sandbox_id] if p.is_dir()]
    for d in dirs:
        if (d / "freezer.state").exists():
            return (d / "freezer.state").read_text().strip() == "FROZEN"
        if (d / "cgroup.freeze").exists():
            return "frozen 1" in (d / "cgroup.events").read_text().splitlines()
    raise AssertionError(f"sandbox {sandbox_id} has no freezer cgroup: {dirs}")


def host_processes_of(ids: Iterable[str]) -> dict[int, str]:
    """Host processes whose cgroup path names one of `ids` (pid -> cgroup line)."""
    wanted = [f"/hutch/{i}" for i in ids]
    found: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            text = (d / "cgroup").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if any(w in line for w in wanted):
                found[int(d.name)] = line
                break
    return found


UID_SLOTS = Path("/run/hutch/uids")


def slot_owners(run_dir: Path) -> dict[str, str]:
    """Host-wide uid slot files taken by the runtime of `run_dir`: file name -> the sandbox id it holds.

    A slot file holds the sandbox id, then the run directory of the runtime that took it."""
    out: dict[str, str] = {}
    if not UID_SLOTS.is_dir():
        return out
    for f in UID_SLOTS.iterdir():
        try:
            lines = f.read_text()[:4096].splitlines()
        except OSError:
            continue
        if len(lines) >= 2 and lines[1] == str(run_dir):
            out[f.name] = lines[0]
    return out


def leftovers(run_dir: Path, sandbox_id: str) -> list[str]:
    """What a destroyed sandbox must no longer hold on the host."""
    left = [f"cgroup {p}" for p in cgroup_dirs(sandbox_id)]
    sock = run_dir / "sockets" / f"{sandbox_id}.sock"
    if sock.exists():
        left.append(f"socket {sock}")
    left += [f"uid slot {UID_SLOTS / n}" for n, owner in slot_owners(run_dir).items() if owner == sandbox_id]
    left += [f"process {pid} ({line})" for pid, line in host_processes_of([sandbox_id]).items()]
    # The gvisor class: its agent directory, OCI bundle, runsc state, mounts.
    for sub in ("gv", "gvb"):
        if (run_dir / sub / sandbox_id).exists():
            left.append(f"gvisor directory {run_dir / sub / sandbox_id}")
    if (run_dir / "runsc").is_dir():
        left += [f"runsc state {p}" for p in (run_dir / "runsc").glob(f"{sandbox_id}*")]
    with open("/proc/self/mountinfo") as f:
        left += [f"mount {line.split()[4]}" for line in f if f"/{sandbox_id}/" in line.split()[4] + "/"]
    return left


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("the end-to-end suite runs as root (real namespaces and cgroups); run it as root", pytrace=False)


# --------------------------------------------------------------------------
# The API client


class ApiError(AssertionError):
    pass


class Client:
    """A keep-alive HTTP client for one API key. Every request has a timeout."""

    def __init__(self, base: str, key: str | None, registry: list["Client"] | None = None):
        self.base = base
        self.key = key
        # Set by a test that revokes the key: nothing left to clean up.
        self.revoked = False
        # The key's id, when known.
        self.key_id: str | None = None
        self.session = requests.Session()
        if key is not None:
            self.session.headers["Authorization"] = f"Bearer {key}"
        if registry is not None:
            registry.append(self)

    def clone(self) -> "Client":
        """Another session with the same key, for use from another thread."""
        return Client(self.base, self.key)

    def request(self, method: str, path: str, *, timeout: float = REQUEST_TIMEOUT, **kw) -> requests.Response:
        return self.session.request(method, self.base + path, timeout=timeout, **kw)

    def get(self, path: str, **kw) -> requests.Response:
        return self.request("GET", path, **kw)

    def post(self, path: str, body=None, *, headers: dict | None = None, **kw) -> requests.Response:
        if body is not None:
            kw["data"] = json.dumps(body)
            headers = {"Content-Type": "application/json", **(headers or {})}
        return self.request("POST", path, headers=headers, **kw)

    def delete(self, path: str, **kw) -> requests.Response:
        return self.request("DELETE", path, **kw)

    # ---- sandboxes

    def create(self, expect: int = 201, idempotency_key: str | None = None, **body) -> dict:
        body.setdefault("ttl_seconds", 900)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        r = self.post("/v1/sandboxes", body, headers=headers)
        expect_status(r, expect)
        sb = r.json()
        assert sb["state"] == "running", sb
        return sb

    def sandbox(self, sandbox_id: str) -> dict:
        r = self.get(f"/v1/sandboxes/{sandbox_id}")
        expect_status(r, 200)
        return r.json()

    def destroy(self, sandbox_id: str) -> dict:
        r = self.delete(f"/v1/sandboxes/{sandbox_id}")
        expect_status(r, 200)
        return r.json()

    def list_all(self, page: int = 1000) -> list[dict]:
        out, cursor = [], None
        for _ in range(1000):
            params = {"limit": page}
            if cursor:
                params["cursor"] = cursor
            r = self.get("/v1/sandboxes", params=params)
            expect_status(r, 200)
            body = r.json()
            out += body["sandboxes"]
            cursor = body.get("next_cursor")
            if not cursor:
                return out
        raise AssertionError("sandbox listing did not end after 1000 pages")

    # ---- commands

    def exec_raw(self, sandbox_id: str, body: dict, idempotency_key: str | None = None, **kw) -> requests.Response:
        headers = dict(kw.pop("headers", None) or {})
        if idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        return self.post(f"/v1/sandboxes/{sandbox_id}/exec", body, headers=headers, **kw)

    def exec(self, sandbox_id: str, command: str | None = None, **body) -> dict:
        """Runs a foreground command and returns its result (any exit code)."""
        if command is not None:
            body["command"] = command
        key = body.pop("idempotency_key", None)
        r = self.exec_raw(sandbox_id, body, key)
        expect_status(r, 200)
        return r.json()

    def sh(self, sandbox_id: str, command: str, **body) -> str:
        """Runs a command that must succeed; returns its stdout."""
        res = self.exec(sandbox_id, command, **body)
        assert res["exit_code"] == 0, f"{command!r} failed: {res}"
        return res["stdout"]

    def background(self, sandbox_id: str, command: str, **body) -> int:
        body.update(command=command, background=True)
        r = self.exec_raw(sandbox_id, body)
        expect_status(r, 200)
        pid = r.json()["pid"]
        assert isinstance(pid, int) and pid > 0, r.text
        return pid

    def processes(self, sandbox_id: str) -> list[dict]:
        r = self.get(f"/v1/sandboxes/{sandbox_id}/processes")
        expect_status(r, 200)
        return r.json()["processes"]

    def cleanup_templates(self) -> list[str]:
        """Deletes every template of this key (which drains its warm pool)."""
        try:
            r = self.get("/v1/templates")
            expect_status(r, 200)
        except (requests.RequestException, AssertionError) as e:
            return [f"list templates: {e}"]
        problems = []
        for t in r.json()["templates"]:
            try:
                d = self.delete(f"/v1/templates/{t['id']}")
                if d.status_code not in (204, 404):
                    problems.append(f"delete template {t['id']}: {d.status_code} {d.text}")
            except requests.RequestException as e:
                problems.append(f"delete template {t['id']}: {e}")
        return problems

    def cleanup(self) -> list[str]:
        """Deletes every template (draining warm pools) and every sandbox
        this key can see that is not terminated."""
        problems = []
        if self.revoked:
            return problems
        problems += self.cleanup_templates()
        try:
            sandboxes = self.list_all()
        except (requests.RequestException, AssertionError) as e:
            return [f"list with key {self.key and self.key[:12]}...: {e}"]
        for sb in sandboxes:
            if sb["state"] == "terminated":
                continue
            try:
                r = self.delete(f"/v1/sandboxes/{sb['id']}")
                if r.status_code != 200:
                    problems.append(f"delete {sb['id']}: {r.status_code} {r.text}")
            except requests.RequestException as e:
                problems.append(f"delete {sb['id']}: {e}")
        problems += self.cleanup_volumes()
        return problems

    def cleanup_volumes(self) -> list[str]:
        """Deletes every volume of this key (once the sandboxes that mount
        them have ended)."""
        try:
            r = self.get("/v1/volumes")
            expect_status(r, 200)
        except (requests.RequestException, AssertionError) as e:
            return [f"list volumes: {e}"]
        problems = []
        for v in r.json()["volumes"]:
            try:
                wait_for(f"volume {v['id']} to be deleted",
                         lambda: self.delete(f"/v1/volumes/{v['id']}").status_code in (204, 404), timeout=15)
            except (requests.RequestException, AssertionError) as e:
                problems.append(f"delete volume {v['id']}: {e}")
        return problems


def expect_status(r: requests.Response, status: int | tuple[int, ...]) -> None:
    ok = status if isinstance(status, tuple) else (status,)
    if r.status_code not in ok:
        raise ApiError(f"{r.request.method} {r.request.url} -> {r.status_code}, expected {status}: {r.text[:2000]}")


def expect_error(r: requests.Response, status: int, code: str) -> dict:
    """Asserts an API error: status, JSON body `{"error", "code"}`."""
    assert r.status_code == status, (
        f"{r.request.method} {r.request.url} -> {r.status_code}, expected {status} {code}: {r.text[:2000]}"
    )
    try:
        body = r.json()
    except ValueError:
        raise AssertionError(f"error body is not JSON: {r.text[:500]!r}") from None
    assert body.get("code") == code, f"expected code {code}, got {body}"
    assert isinstance(body.get("error"), str) and body["error"], body
    return body


def ndjson_events(r: requests.Response) -> list[dict]:
    return [json.loads(line) for line in r.iter_lines() if line]


class EventStream:
    """The events of an NDJSON response as they arrive, read in a thread so
    that every wait for more is bounded (a stream that stalls fails the test
    in time instead of hanging it)."""

    _END = object()

    def __init__(self, r: requests.Response):
        self.r = r
        self.events: list[dict] = []
        self._q: queue.Queue = queue.Queue()
        self._ended = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for line in self.r.iter_lines(chunk_size=1):
                if line:
                    self._q.put(json.loads(line))
        except Exception as e:  # noqa: BLE001 - handed to the reader
            self._q.put(e)
        self._q.put(self._END)

    def _next(self, deadline: float, what: str):
        try:
            item = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"timed out waiting for {what}; events so far: {self.events}") from None
        if isinstance(item, Exception):
            raise item
        return item

    def until(self, what: str, done: Callable[[list[dict]], bool], timeout: float = 30) -> list[dict]:
        """Reads events until `done(events so far)` holds."""
        deadline = time.monotonic() + timeout
        while not done(self.events):
            item = self._next(deadline, what)
            if item is self._END:
                raise AssertionError(f"the stream ended before {what}: {self.events}")
            self.events.append(item)
        return self.events

    def rest(self, timeout: float = 30) -> list[dict]:
        """Reads events until the stream ends."""
        deadline = time.monotonic() + timeout
        while not self._ended:
            item = self._next(deadline, "the end of the stream")
            if item is self._END:
                self._ended = True
            else:
                self.events.append(item)
        return self.events


def stdout_of(events: list[dict]) -> str:
    return "".join(e["data"] for e in events if e["type"] == "stdout")


# --------------------------------------------------------------------------
# The daemon


# Each daemon gets a hutch network instance of its own (subnet, nftables
# table, links), so daemons side by side never touch each other's, also
# those of another test session running at the same time on this host.
sys.path.insert(0, str(REPO / "tests"))
from host_cleanup import unmount_under  # noqa: E402
from net_instances import NetInstance  # noqa: E402


def net_table(instance: int) -> str:
    return "hutch" if instance == 0 else f"hutch{instance}"


def net_links(instance: int) -> list[str]:
    """Host links of a hutch network instance (veths' host ends)."""
    prefix = f"h{instance:02x}s"
    return sorted(p.name for p in Path("/sys/class/net").iterdir() if p.name.startswith(prefix))


def net_table_exists(instance: int) -> bool:
    r = subprocess.run(["nft", "list", "table", "inet", net_table(instance)], capture_output=True, timeout=10)
    return r.returncode == 0


def postgres_database_for_tests() -> str | None:
    """With HUTCH_TEST_DAEMON_POSTGRES (a PostgreSQL URL of a role that may
    create databases, e.g. the one scripts/pg-scratch.sh exports as
    HUTCH_TEST_POSTGRES): a new database's URL, for one daemon's
    `--database`, dropped when the test session ends. Without it, None:
    daemons keep SQLite in their state directory (the default; CI's
    setting)."""
    admin = os.environ.get("HUTCH_TEST_DAEMON_POSTGRES")
    if not admin:
        return None
    name = f"hutch_api_{os.getpid()}_{time.monotonic_ns()}"
    subprocess.run(["psql", "-q", admin, "-c", f"CREATE DATABASE {name}"], check=True, timeout=30)
    atexit.register(
        lambda: subprocess.run(
            ["psql", "-q", admin, "-c", f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"], timeout=30, check=False
        )
    )
    return admin.rsplit("/", 1)[0] + "/" + name


class Daemon:
    """One `hutch serve` process with its own port, state and run dirs."""

    def __init__(self, root: Path, binary: Path = DEBUG_BIN, port: int | None = None, name: str = "daemon"):
        self._net = NetInstance.claim()
        self.net_instance = self._net.number
        # Extra environment (HUTCH_DNS_UPSTREAM, ...) for every start.
        self.extra_env: dict[str, str] = {}
        # The daemon's open-file limit (soft, hard) at start; None: inherited.
        self.nofile: tuple[int, int] | None = None
        if not binary.is_file():
            pytest.fail(
                f"hutch binary not found at {binary}: build it first (cargo build --workspace)", pytrace=False
            )
        agent = binary.parent / "hutch-agent"
        if not agent.is_file():
            pytest.fail(f"hutch-agent not found next to hutch at {agent}: build the workspace", pytrace=False)
        self.binary = binary
        self.root = root
        self.state_dir = root / "state"
        self.run_dir = root / "run"
        self.port = port or free_port()
        self.name = name
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.clients: list[Client] = []
        # Its PostgreSQL database (HUTCH_TEST_DAEMON_POSTGRES), or None: SQLite.
        self.database = postgres_database_for_tests()

    @property
    def log_path(self) -> Path:
        return self.root / f"{self.name}.{self.starts}.log"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def start(self, new_port: bool = False) -> "Daemon":
        assert self.proc is None or self.proc.poll() is not None, "daemon already running"
        if new_port:
            self.port = free_port()
            self.base = f"http://127.0.0.1:{self.port}"
            for c in self.clients:
                c.base = self.base
        self.starts += 1
        env = {k: v for k, v in os.environ.items() if not k.startswith("HUTCH_")}
        env["HUTCH_RUN_DIR"] = str(self.run_dir)
        env["HUTCH_NET_INSTANCE"] = str(self.net_instance)
        env["HUTCH_DEFAULT_CLASS"] = TEST_CLASS
        if self.database:
            env["HUTCH_DATABASE"] = self.database
        env.update(self.extra_env)
        log = open(self.log_path, "wb")
        nofile = self.nofile
        try:
            self.proc = subprocess.Popen(
                [str(self.binary), "serve", "--listen", f"127.0.0.1:{self.port}", "--state-dir", str(self.state_dir)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                preexec_fn=(lambda: resource.setrlimit(resource.RLIMIT_NOFILE, nofile)) if nofile else None,
            )
        finally:
            log.close()
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"hutch serve exited with {self.proc.returncode} while starting; log:\n{self.log_tail()}"
                )
            try:
                r = requests.get(self.base + "/healthz", timeout=2)
                if r.status_code == 200 and r.text.strip() == "ok":
                    return self
            except requests.RequestException:
                pass
            if time.monotonic() >= deadline:
                self.kill9()
                raise AssertionError(f"hutch serve not healthy after {START_TIMEOUT}s; log:\n{self.log_tail()}")
            time.sleep(0.05)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        """SIGTERM by pid, then SIGKILL if it does not exit in time."""
        if not self.alive():
            return self.proc.returncode if self.proc else None
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=STOP_TIMEOUT)
            raise AssertionError(f"hutch serve ignored SIGTERM for {STOP_TIMEOUT}s; log:\n{self.log_tail()}")

    def kill9(self) -> None:
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=STOP_TIMEOUT)

    def admin_key(self) -> str:
        path = self.state_dir / "admin.key"
        mode = path.stat().st_mode & 0o777
        assert mode == 0o600, f"{path} has mode {oct(mode)}, expected 0600"
        return path.read_text().strip()

    def client(self, key: str | None = "admin") -> Client:
        """A client for `key` ("admin": the admin key; None: no header)."""
        if key == "admin":
            key = self.admin_key()
        return Client(self.base, key, self.clients if key else None)

    def cli(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HUTCH_")}
        if self.database:
            env["HUTCH_DATABASE"] = self.database
        return subprocess.run(
            [str(self.binary), *args, "--state-dir", str(self.state_dir)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def new_key(self, name: str, *flags: str) -> tuple[str, str]:
        """A fresh non-admin key: (id, secret). Uses `hutch key create`
        (`flags`: `--e2b`, `--max-sandboxes`, `N`, ...)."""
        p = self.cli("key", "create", "--name", name, "--json", *flags)
        assert p.returncode == 0, f"hutch key create failed ({p.returncode}): {p.stderr}"
        k = json.loads(p.stdout)
        assert k["name"] == name and k["secret"], k
        return k["id"], k["secret"]

    def new_client(self, name: str, *flags: str) -> Client:
        """A client with a key of its own: it sees only its own sandboxes."""
        key_id, secret = self.new_key(name, *flags)
        c = Client(self.base, secret, self.clients)
        c.key_id = key_id
        return c

    def strays(self) -> dict[int, str]:
        """Processes running this daemon's binary for this state dir that are
        not the daemon itself (forked helpers left behind): pid -> status line."""
        me = self.proc.pid if self.alive() else None
        found = {}
        needle = str(self.state_dir).encode()
        for p in Path("/proc").iterdir():
            if not p.name.isdigit() or int(p.name) == me:
                continue
            try:
                cmd = (p / "cmdline").read_bytes()
                if needle not in cmd or b" serve" not in cmd.replace(b"\0", b" "):
                    continue
                status = (p / "status").read_text()
            except OSError:
                continue
            ppid = next((l.split()[1] for l in status.splitlines() if l.startswith("PPid:")), "?")
            line = cmd.replace(b"\0", b" ").decode(errors="replace")
            found[int(p.name)] = f"pid {p.name} ppid {ppid}: {line}"
        return found

    def kill_strays(self) -> dict[int, str]:
        """SIGKILLs (by pid) what `strays` finds; returns what it killed."""
        found = self.strays()
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return found

    def force_clean(self) -> None:
        """Last resort when the API could not clean up: SIGKILL (by pid) every
        process in this daemon's sandboxes' cgroups and remove the cgroups."""
        try:
            ids = self.db_sandbox_ids()
        except (sqlite3.Error, subprocess.SubprocessError):
            return
        for pid in host_processes_of(ids):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while host_processes_of(ids) and time.monotonic() < deadline:
            time.sleep(0.1)
        for i in ids:
            for d in cgroup_dirs(i):
                try:
                    d.rmdir()
                except OSError:
                    pass

    def network_leftovers(self) -> list[str]:
        """What a stopped daemon with no sandboxes left of its network."""
        left = [f"link {n}" for n in net_links(self.net_instance)]
        if net_table_exists(self.net_instance):
            left.append(f"nftables table inet {net_table(self.net_instance)}")
        return left

    def release_net(self) -> None:
        """Gives the network instance back (the daemon has stopped)."""
        self._net.release()

    def teardown_with_network(self) -> list[str]:
        """Ends a module's networked daemon: deletes what its clients made,
        stops it, and waits for its network to leave the host (removed by
        force, and reported, if it does not). The problems found."""
        problems = self.cleanup_all() if self.alive() else []
        self.stop()
        self.kill_strays()
        try:
            wait_for("the network to leave the host", lambda: not self.network_leftovers(), timeout=10)
        except AssertionError:
            problems.append(f"network left on the host: {self.network_leftovers()}")
            self.force_clean_network()
        self.release_net()
        return problems

    def force_clean_network(self) -> None:
        for name in net_links(self.net_instance):
            subprocess.run(["ip", "link", "del", name], capture_output=True, timeout=10)
        subprocess.run(["nft", "delete", "table", "inet", net_table(self.net_instance)], capture_output=True, timeout=10)

    def release_storage(self) -> None:
        """Unmounts the daemon's storage image if a stopped daemon left it
        mounted (it does when sandboxes outlived it); the loop device goes
        with the mount."""
        unmount_under(self.state_dir)

    def db_rows(self, sql: str, params: tuple = ()) -> list[tuple[str, ...]]:
        """Rows of a read of the daemon's database, whichever it is: `?`
        marks parameters; values come back as text on PostgreSQL (through
        psql), as stored on SQLite. Write SQL both read alike (`pooled`,
        not `pooled = 1`)."""
        if self.database:
            args = ["psql", "-XAtq", "-F", "\x1f", "-v", "ON_ERROR_STOP=1", self.database]
            parts = sql.split("?")
            assert len(parts) == len(params) + 1, (sql, params)
            query = parts[0]
            for i, (v, rest) in enumerate(zip(params, parts[1:])):
                args += ["-v", f"p{i}={v}"]
                query += f":'p{i}'" + rest
            out = subprocess.run(args, input=query + ";\n", capture_output=True, text=True, timeout=30, check=True)
            return [tuple(line.split("\x1f")) for line in out.stdout.splitlines()]
        with sqlite3.connect(f"file:{self.state_dir / 'hutch.db'}?mode=ro", uri=True, timeout=10) as db:
            return list(db.execute(sql, params))

    def db_sandbox_ids(self) -> list[str]:
        return [row[0] for row in self.db_rows("SELECT id FROM sandboxes")]

    def cleanup_all(self) -> list[str]:
        problems = []
        for c in self.clients:
            problems += c.cleanup()
        return problems

    def host_leftovers(self) -> list[str]:
        """Anything on the host still held by a sandbox this daemon ever recorded."""
        ids = self.db_sandbox_ids()
        left = []
        for i in ids:
            left += [f"{i}: {x}" for x in leftovers(self.run_dir, i)]
        socks = list((self.run_dir / "sockets").glob("*")) if (self.run_dir / "sockets").is_dir() else []
        left += [f"socket {s}" for s in socks]
        left += [f"uid slot {n} held for {o!r}" for n, o in slot_owners(self.run_dir).items()]
        return sorted(set(left))


def wait_cleaned(d: Daemon, sandbox_id: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        left = leftovers(d.run_dir, sandbox_id)
        if not left:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"sandbox {sandbox_id} left on the host after {timeout}s: {left}")
        time.sleep(0.1)


# --------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="session")
def tmp_root():
    require_root()
    root = Path(tempfile.mkdtemp(prefix="hutch-api-tests-"))
    yield root
    unmount_under(root)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def daemon(tmp_root: Path):
    """The session's daemon. At the end: delete every sandbox, check the host
    holds nothing of them, SIGTERM the daemon."""
    d = Daemon(tmp_root / "session")
    d.root.mkdir(parents=True)
    d.start()
    yield d
    problems = []
    if d.alive():
        problems += d.cleanup_all()
        try:
            wait_for("sandboxes of the session to leave the host", lambda: not d.host_leftovers(), timeout=15)
        except AssertionError:
            problems += d.host_leftovers()
    code = d.stop()
    if not problems:
        try:
            wait_for("the network to leave the host", lambda: not d.network_leftovers(), timeout=10)
        except AssertionError:
            problems += d.network_leftovers()
    if problems:
        d.force_clean()
        d.force_clean_network()
    strays = d.kill_strays()
    if strays:
        problems.append(f"processes of the daemon left after it stopped: {list(strays.values())}")
    d.release_storage()
    d.release_net()
    if problems:
        pytest.fail("session teardown: " + "; ".join(problems) + f"\ndaemon log:\n{d.log_tail()}", pytrace=False)
    assert code == 0, f"hutch serve exited {code} on SIGTERM; log:\n{d.log_tail()}"


@pytest.fixture(scope="session")
def api(daemon: Daemon) -> Client:
    """The admin key's client."""
    return daemon.client("admin")


@pytest.fixture
def sandbox(api: Client):
    """A running sandbox, deleted after the test."""
    sb = api.create()
    yield sb
    api.delete(f"/v1/sandboxes/{sb['id']}")


def stop_and_clean(d: Daemon, problems: list[str], revive: bool = False) -> None:
    """Stops a daemon (started or not) after deleting its sandboxes, and
    checks the host holds nothing of it; what is wrong goes to `problems`.
    `revive`: a daemon found dead is started once more to delete what it
    left (its sandboxes are its own node's only)."""
    if d.starts == 0:
        d.release_net()
        return
    # Helpers a killed daemon left behind hold its port: end them first.
    if not d.alive():
        d.kill_strays()
        if revive:
            try:
                d.start()
            except AssertionError as e:
                problems.append(str(e))
    if d.alive():
        problems += d.cleanup_all()
        try:
            d.stop()
        except AssertionError as e:
            problems.append(str(e))
    d.kill_strays()
    left = wait_for_host_clean(d)
    if left:
        problems.append(f"{d.name}: left on the host: {left}")
        d.force_clean()
    try:
        wait_for("the network to leave the host", lambda: not d.network_leftovers(), timeout=10)
    except AssertionError:
        problems.append(f"{d.name}: network left on the host: {d.network_leftovers()}")
        d.force_clean_network()
    d.release_storage()
    d.release_net()


@pytest.fixture
def own_daemon(tmp_root: Path, request: pytest.FixtureRequest):
    """A daemon the test manages itself (restarts, kills). At the end: every
    sandbox deleted and the daemon stopped."""
    # Short: agent socket paths under the run dir must fit in sun_path (108 bytes).
    n = sum(1 for _ in tmp_root.glob("own-*"))
    root = tmp_root / f"own-{n}"
    root.mkdir(parents=True)
    d = Daemon(root, name="own")
    yield d
    problems: list[str] = []
    stop_and_clean(d, problems, revive=True)
    assert not problems, problems


@pytest.fixture(scope="session")
def pg_admin():
    """A PostgreSQL URL of a role that may create databases:
    HUTCH_TEST_DAEMON_POSTGRES when set, else a throwaway cluster of this
    session's own (scripts/pg-scratch.sh), stopped and removed at its end."""
    given = os.environ.get("HUTCH_TEST_DAEMON_POSTGRES")
    if given:
        yield given
        return
    out = subprocess.run(
        ["bash", "-c", 'source scripts/pg-scratch.sh >&2 && printf "%s\\n%s\\n" "$HUTCH_TEST_POSTGRES" "$pg_scratch_dir"'],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"pg-scratch.sh failed: {out.stderr}"
    url, cluster = out.stdout.split()
    try:
        yield url
    finally:
        # As pg_scratch_stop does (the cluster outlives the shell that made it).
        stop = f'"$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)/pg_ctl" -D {cluster}/data -m immediate -w stop'
        subprocess.run(["runuser", "-u", "postgres", "--", "bash", "-c", stop], capture_output=True, timeout=60)
        subprocess.run(["rm", "-rf", cluster], timeout=60)


@pytest.fixture
def fleet_of(tmp_root: Path, pg_admin: str):
    """A factory of fleets: `fleet_of(["a", "b", "c"], env={...})` starts one
    daemon per node name (in that order; the first makes the admin key), each
    with its own state, run dir, network instance and port, all on one new
    PostgreSQL database, heartbeating every second. At the end: each node's
    sandboxes deleted (a node found dead is started again for that), every
    node stopped, the host checked clean, the database dropped."""
    name = f"hutch_fleet_{time.monotonic_ns()}"
    subprocess.run(["psql", "-q", pg_admin, "-c", f"CREATE DATABASE {name}"], check=True, timeout=30)
    database = pg_admin.rsplit("/", 1)[0] + "/" + name
    made: list[Daemon] = []

    def make(names: list[str], env: dict[str, str] | None = None) -> list[Daemon]:
        nodes = []
        for node in names:
            root = tmp_root / f"fleet-{len(list(tmp_root.glob('fleet-*')))}"
            root.mkdir(parents=True)
            d = Daemon(root, name=node)
            d.database = database
            d.extra_env.update({"HUTCH_NODE": node, "HUTCH_HEARTBEAT": "1s", **(env or {})})
            made.append(d)
            nodes.append(d)
        for d in nodes:
            d.start()
        return nodes

    problems: list[str] = []
    try:
        yield make
    finally:
        for d in reversed(made):
            stop_and_clean(d, problems, revive=True)
        subprocess.run(
            ["psql", "-q", pg_admin, "-c", f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"], timeout=30, check=False
        )
    assert not problems, problems


def wait_for_host_clean(d: Daemon, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        left = d.host_leftovers()
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)
