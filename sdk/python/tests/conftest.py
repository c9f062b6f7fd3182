"""The SDK's tests run against a real `hutch serve`, one daemon per session,
started as the end-to-end suite starts its own (tests/api/conftest.py, whose
`Daemon` is reused here: its own port, state and run directories, a network
instance taken through tests/net_instances.py, every sandbox deleted and the
host checked clean at the end).

Needs `cargo build --workspace` first and runs as root, like tests/api.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import pytest

import hutch

REPO = Path(__file__).resolve().parents[3]
TEST_TIMEOUT = 120


def _load_api_conftest():
    """tests/api/conftest.py as a module of its own name (its fixtures are not
    registered here; only its helpers are used)."""
    spec = importlib.util.spec_from_file_location("hutch_api_conftest", REPO / "tests" / "api" / "conftest.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


api = _load_api_conftest()


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    """Caps every test's run time so the suite can never hang."""
    if not config.pluginmanager.hasplugin("timeout"):
        raise pytest.UsageError("pytest-timeout is required: pip install -r tests/api/requirements.txt")
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT))


@pytest.fixture(scope="session")
def daemon():
    """The session's daemon; at the end every sandbox and template of every
    key the tests made is gone and the host holds nothing of them."""
    api.require_root()
    root = Path(tempfile.mkdtemp(prefix="hutch-sdk-tests-"))
    d = api.Daemon(root / "session")
    d.root.mkdir(parents=True)
    try:
        d.start()
        # The admin key's cleanup client (templates, then sandboxes).
        d.client("admin")
        yield d
        problems = []
        if d.alive():
            problems += d.cleanup_all()
            try:
                api.wait_for("sandboxes of the session to leave the host", lambda: not d.host_leftovers(), timeout=15)
            except AssertionError:
                problems += d.host_leftovers()
        code = d.stop()
        if not problems:
            try:
                api.wait_for("the network to leave the host", lambda: not d.network_leftovers(), timeout=10)
            except AssertionError:
                problems += d.network_leftovers()
        if problems:
            d.force_clean()
            d.force_clean_network()
        strays = d.kill_strays()
        if strays:
            problems.append(f"processes of the daemon left after it stopped: {list(strays.values())}")
        if problems:
            pytest.fail("session teardown: " + "; ".join(problems) + f"\ndaemon log:\n{d.log_tail()}", pytrace=False)
        assert code == 0, f"hutch serve exited {code} on SIGTERM; log:\n{d.log_tail()}"
    finally:
        if d.alive():
            d.kill9()
        d.release_net()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def admin_key(daemon) -> str:
    return daemon.admin_key()


@pytest.fixture(scope="session")
def client(daemon, admin_key) -> Iterator[hutch.Hutch]:
    """The admin key's sync client."""
    with hutch.Hutch(daemon.base, admin_key, timeout=60) as c:
        yield c


@pytest.fixture
async def aclient(daemon, admin_key):
    """The admin key's async client (one per test: one per event loop)."""
    async with hutch.AsyncHutch(daemon.base, admin_key, timeout=60) as c:
        yield c


@pytest.fixture
def sandbox(client: hutch.Hutch) -> Iterator[hutch.Sandbox]:
    """A running sandbox, deleted after the test."""
    with client.sandboxes.create(ttl="10m") as sb:
        yield sb


@pytest.fixture
def user_key(client: hutch.Hutch, daemon):
    """A fresh non-admin key (made through the SDK), revoked after the test:
    revocation ends whatever it made."""
    made = []

    def make(name: Optional[str] = None, e2b: bool = False, **quotas) -> hutch.ApiKey:
        k = client.keys.create(name or f"sdk-{uuid.uuid4().hex[:8]}", e2b=e2b, quotas=quotas or None)
        made.append(k)
        return k

    yield make
    for k in made:
        try:
            client.keys.revoke(k.id)
        except hutch.HutchError:
            pass


def marker() -> str:
    return uuid.uuid4().hex[:12]


# --------------------------------------------------------------------------
# A TCP proxy that can drop a connection once the daemon answered


class DroppingProxy:
    """Forwards TCP connections to the daemon. While `drop` is above zero,
    the first answer bytes the daemon sends on a connection are thrown away
    and both sides are closed: the client's request reached the daemon and
    ran, but its answer is lost, as when a network drops mid-call. While
    `cut` is above zero, a connection whose request matches `watch` is
    closed on the client's side as soon as the request went through (the
    daemon's side stays open, so the command goes on).
    `requests` counts request lines matching `watch` that went through."""

    def __init__(self, upstream_port: int, watch: bytes = b""):
        self.upstream = ("127.0.0.1", upstream_port)
        self.watch = watch
        self.drop = 0
        self.dropped = 0
        self.cut = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._conns: List[socket.socket] = []
        self._closed = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                c, _ = self._sock.accept()
            except OSError:
                return
            u = socket.create_connection(self.upstream)
            with self._lock:
                self._conns += [c, u]
            threading.Thread(target=self._up, args=(c, u), daemon=True).start()
            threading.Thread(target=self._down, args=(u, c), daemon=True).start()

    def _up(self, c: socket.socket, u: socket.socket) -> None:
        cutting = False
        pending = b""  # a watched request's bytes, until it went through whole
        try:
            while True:
                data = c.recv(65536)
                if not data:
                    break
                if self.watch:
                    with self._lock:
                        seen = data.count(self.watch)
                        self.requests += seen
                        if seen and self.cut > 0:
                            self.cut -= 1
                            cutting = True
                            pending = data[data.index(self.watch):]
                        elif cutting:
                            pending += data
                u.sendall(data)
                if cutting and _whole_request(pending):
                    _close(c)
                    return
        except OSError:
            pass
        finally:
            if not cutting:
                _close(u)

    def _down(self, u: socket.socket, c: socket.socket) -> None:
        try:
            while True:
                data = u.recv(65536)
                if not data:
                    break
                with self._lock:
                    dropping = self.drop > 0
                    if dropping:
                        self.drop -= 1
                        self.dropped += 1
                if dropping:
                    break
                c.sendall(data)
        except OSError:
            pass
        finally:
            _close(c)
            _close(u)

    def close_connections(self) -> int:
        """Closes every connection open now (as a daemon ends idle
        keep-alive connections); returns how many client connections."""
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            _close(s)
        return len(conns) // 2

    def close(self) -> None:
        self._closed = True
        _close(self._sock)
        with self._lock:
            for s in self._conns:
                _close(s)


def _whole_request(data: bytes) -> bool:
    """Whether `data` (from the request line on) holds a whole request with a
    Content-Length body."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return False
    length = 0
    for line in data[:end].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return len(data) >= end + 4 + length


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass


@pytest.fixture
def proxy(daemon) -> Iterator[Callable[..., DroppingProxy]]:
    made: List[DroppingProxy] = []

    def make(watch: bytes = b"") -> DroppingProxy:
        p = DroppingProxy(daemon.port, watch)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def free_port() -> int:
    return api.free_port()


def wait_for(what: str, predicate: Callable[[], object], timeout: float = 10.0):
    return api.wait_for(what, predicate, timeout=timeout)


os.environ.pop("HUTCH_URL", None)
os.environ.pop("HUTCH_API_KEY", None)
