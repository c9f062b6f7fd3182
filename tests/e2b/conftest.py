"""The unmodified E2B Python SDK against a real `hutch serve`.

One daemon per session (free port, its own state and run directories), an
E2B-shaped key made with `hutch key create --e2b`, and the SDK pointed at the
daemon with E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY only. At the end
every sandbox the key made is killed through the SDK, and the daemon is
stopped by its pid. Nothing is skipped: a missing binary fails loudly.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from host_cleanup import unmount_under  # noqa: E402
from net_instances import NetInstance  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BIN = REPO / "target" / "x86_64-unknown-linux-gnu" / "debug" / "hutch"
START_TIMEOUT = 30
TEST_TIMEOUT = 180
# The isolation class of the sandboxes the suite makes: HUTCH_TEST_CLASS
# (`container` when unset), the daemons' default class (`hutch serve
# --default-class`), so E2B's `base` and every template built here run in
# it; scripts/test.sh runs the suite again with `gvisor`.
TEST_CLASS = os.environ.get("HUTCH_TEST_CLASS", "container")

# What the gvisor class's runsc (Debian 12's, 0.0~20221219) does not do; the
# tests that need it are marked with `on_class("gvisor", reason=...)`.
# Its sentry refuses AT_NO_AUTOMOUNT in statx and newfstatat (EINVAL): GNU
# coreutils' `stat` and `ls -l` fail on every path (python's os.stat works).
GVISOR_STATX = "runsc 20221219 refuses statx(AT_NO_AUTOMOUNT): coreutils' stat and ls fail"
# Its gofer refuses user.* extended attributes on the sandbox's files
# (setxattr: EOPNOTSUPP): file metadata kept as xattrs cannot be kept there.
GVISOR_XATTRS = "runsc 20221219's gofer refuses user.* xattrs (EOPNOTSUPP)"


def on_class(*classes: str, reason: str):
    """Marks a test expected to fail when the suite runs in one of
    `classes`, for a `reason` the class owns (what it does not do);
    strict: a pass there fails the run, so the mark goes once it does."""
    return pytest.mark.xfail(TEST_CLASS in classes, reason=f"{TEST_CLASS} class: {reason}", strict=True)


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("timeout"):
        raise pytest.UsageError("pytest-timeout is required: pip install -r tests/e2b/requirements.txt")
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, predicate, timeout=10.0, interval=0.1):
    deadline = time.monotonic() + timeout
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
        time.sleep(interval)


class E2bDaemon:
    """A `hutch serve` of its own (free port, state and run directories, a
    network instance), with an E2B key; `stop` ends it by its pid."""

    def __init__(self, extra_env: dict | None = None):
        if not BIN.is_file() or not (BIN.parent / "hutch-agent").is_file():
            pytest.fail(f"hutch binaries not found at {BIN.parent}: cargo build --workspace", pytrace=False)
        # Short run directory: it holds unix sockets.
        self.root = Path(tempfile.mkdtemp(prefix="he2b-", dir="/tmp"))
        state, run = self.root / "state", self.root / "run"
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("HUTCH_")}
        env["HUTCH_RUN_DIR"] = str(run)
        env["HUTCH_DEFAULT_CLASS"] = TEST_CLASS
        env.update(extra_env or {})
        self.net = NetInstance.claim()
        env["HUTCH_NET_INSTANCE"] = str(self.net.number)
        # Sandbox ports by E2B host name: `<port>-<id>.e2b.localhost:<port>`
        # (tests send that Host to 127.0.0.1).
        self.domain = f"e2b.localhost:{self.port}"
        self.state, self.env = state, env
        try:
            self.spawn()
            self.key = self.make_key("e2b-tests", state, env)
        except BaseException:
            self.stop()
            raise

    def spawn(self):
        log = open(self.root / "daemon.log", "ab")
        self.proc = subprocess.Popen(
            [str(BIN), "serve", "--listen", f"127.0.0.1:{self.port}", "--state-dir", str(self.state),
             "--e2b-domain", self.domain],
            env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
        )
        log.close()
        wait_for("hutch serve", self.healthy, timeout=START_TIMEOUT, interval=0.05)

    def restart(self):
        """SIGTERM (its sandboxes run on), then the same daemon again."""
        self.terminate()
        self.spawn()

    def terminate(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)

    def healthy(self):
        if self.proc.poll() is not None:
            raise AssertionError(f"hutch serve exited: {(self.root / 'daemon.log').read_text()[-2000:]}")
        try:
            return requests.get(self.base + "/healthz", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def make_key(self, name, state=None, env=None):
        out = subprocess.run(
            [str(BIN), "key", "create", "--e2b", "--json", "--name", name, "--state-dir", str(state or self.state)],
            env=env or self.env, capture_output=True, text=True, timeout=30, check=True,
        )
        secret = json.loads(out.stdout)["secret"]
        assert secret.startswith("e2b_")
        return secret

    def opts(self, key=None) -> dict:
        """The SDK's connection options for this daemon."""
        return {"api_key": key or self.key, "api_url": self.base, "sandbox_url": self.base}

    def kill_all(self, key=None):
        from e2b import Sandbox, SandboxQuery, SandboxState

        query = SandboxQuery(state=[SandboxState.RUNNING, SandboxState.PAUSED])
        for sb in Sandbox.list(query=query, limit=100, **self.opts(key)).next_items():
            Sandbox.kill(sb.sandbox_id, **self.opts(key))

    def stop(self):
        try:
            if getattr(self, "proc", None) is not None:
                self.terminate()
        finally:
            self.net.release()
            # The storage image stays mounted when sandboxes outlived the
            # daemon: unmounted (lazily), then the whole root goes.
            unmount_under(self.root)
            shutil.rmtree(self.root, ignore_errors=True)


# The session's daemon, for the log a failed test reports.
SESSION_DAEMON: list = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test carries the tail of the session daemon's log: what the
    daemon said about a request is often the only trace of why it failed."""
    report = yield
    if report.when == "call" and report.failed and SESSION_DAEMON:
        log = SESSION_DAEMON[0].root / "daemon.log"
        if log.is_file():
            with open(log, "rb") as f:
                f.seek(max(0, log.stat().st_size - 8000))
                report.sections.append(("daemon log (tail)", f.read().decode(errors="replace")))
    return report


@pytest.fixture(scope="session")
def daemon():
    d = E2bDaemon()
    SESSION_DAEMON.append(d)
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN")}
    os.environ.update({"E2B_API_URL": d.base, "E2B_SANDBOX_URL": d.base, "E2B_API_KEY": d.key})
    os.environ.pop("E2B_DOMAIN", None)
    try:
        yield {"base": d.base, "key": d.key, "root": d.root, "domain": d.domain, "port": d.port, "daemon": d}
    finally:
        try:
            d.kill_all()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            SESSION_DAEMON.clear()
            d.stop()


@pytest.fixture(scope="session")
def interpreter_image(daemon):
    """The `code-interpreter` image of the built-in `code-interpreter-v1`
    template, built once into the daemon's state directory with `hutch image
    build` (minutes the first time: mmdebstrap, the wheels), so that a
    failing build shows its own error rather than a create that times out."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HUTCH_")}
    out = subprocess.run(
        [str(BIN), "image", "build", "code-interpreter", "--local", "--state-dir", str(daemon["root"] / "state")],
        env=env, capture_output=True, text=True, timeout=840,
    )
    assert out.returncode == 0, f"the code-interpreter image did not build:\n{out.stderr[-4000:]}"
    assert out.stdout.startswith("code-interpreter ("), out.stdout


@pytest.fixture(scope="session")
def shared(daemon):
    """One sandbox for the tests that only read or write inside it."""
    from e2b import Sandbox

    # Long enough for the whole suite in the slowest class (gvisor: ~11 min).
    sb = Sandbox.create(metadata={"suite": "e2b", "kind": "shared"}, envs={"SUITE_VAR": "hutch"}, timeout=1800)
    yield sb
    sb.kill()


@pytest.fixture
def sandbox(daemon):
    """A fresh sandbox, killed after the test."""
    from e2b import Sandbox

    sb = Sandbox.create(timeout=300)
    yield sb
    sb.kill()
