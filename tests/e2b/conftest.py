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
from net_instances import NetInstance  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BIN = REPO / "target" / "x86_64-unknown-linux-gnu" / "debug" / "hutch"
START_TIMEOUT = 30
TEST_TIMEOUT = 180


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


@pytest.fixture(scope="session")
def daemon():
    if not BIN.is_file() or not (BIN.parent / "hutch-agent").is_file():
        pytest.fail(f"hutch binaries not found at {BIN.parent}: cargo build --workspace", pytrace=False)
    # Short run directory: it holds unix sockets.
    root = Path(tempfile.mkdtemp(prefix="he2b-", dir="/tmp"))
    state, run = root / "state", root / "run"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HUTCH_")}
    env["HUTCH_RUN_DIR"] = str(run)
    net = NetInstance.claim()
    env["HUTCH_NET_INSTANCE"] = str(net.number)
    log = open(root / "daemon.log", "wb")
    proc = subprocess.Popen(
        [str(BIN), "serve", "--listen", f"127.0.0.1:{port}", "--state-dir", str(state)],
        env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
    )
    log.close()

    def healthy():
        if proc.poll() is not None:
            raise AssertionError(f"hutch serve exited: {(root / 'daemon.log').read_text()[-2000:]}")
        try:
            return requests.get(base + "/healthz", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    wait_for("hutch serve", healthy, timeout=START_TIMEOUT, interval=0.05)
    out = subprocess.run(
        [str(BIN), "key", "create", "--e2b", "--json", "--name", "e2b-tests", "--state-dir", str(state)],
        env=env, capture_output=True, text=True, timeout=30, check=True,
    )
    secret = json.loads(out.stdout)["secret"]
    assert secret.startswith("e2b_")
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN")}
    os.environ.update({"E2B_API_URL": base, "E2B_SANDBOX_URL": base, "E2B_API_KEY": secret})
    os.environ.pop("E2B_DOMAIN", None)
    try:
        yield {"base": base, "key": secret, "root": root}
    finally:
        try:
            from e2b import Sandbox, SandboxQuery, SandboxState

            for sb in Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING, SandboxState.PAUSED]),
                                   limit=100).next_items():
                Sandbox.kill(sb.sandbox_id)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
            net.release()


@pytest.fixture(scope="session")
def shared(daemon):
    """One sandbox for the tests that only read or write inside it."""
    from e2b import Sandbox

    sb = Sandbox.create(metadata={"suite": "e2b", "kind": "shared"}, envs={"SUITE_VAR": "hutch"}, timeout=600)
    yield sb
    sb.kill()


@pytest.fixture
def sandbox(daemon):
    """A fresh sandbox, killed after the test."""
    from e2b import Sandbox

    sb = Sandbox.create(timeout=300)
    yield sb
    sb.kill()
