"""The unmodified E2B JavaScript SDKs (npm `e2b` and
`@e2b/code-interpreter`, pinned in tests/e2b-js) against this session's
daemon (its code-interpreter image built first): `node --test` over tests/e2b-js/test with the
SDK pointed at the daemon by the environment variables it reads, and a
second key of another owner for the foreign-sandbox checks. Node's own
report is the failure message. Nothing is skipped: no Node (20.18.1 or
newer) or no `npm ci` in tests/e2b-js fails loudly."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import TEST_CLASS

JS = Path(__file__).resolve().parents[1] / "e2b-js"
# The suite's files run this many at once (each waits on the daemon far more
# than it computes).
CONCURRENCY = 3
# A test that hangs fails on its own rather than holding the whole run.
TEST_TIMEOUT_MS = 120_000


def node() -> str:
    path = shutil.which("node")
    if path is None:
        pytest.fail("node not found: apt-get install nodejs npm (scripts/test.sh does)", pytrace=False)
    version = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    v = tuple(int(x) for x in re.match(r"v(\d+)\.(\d+)\.(\d+)", version).groups())
    # The SDK's engines: ">=20.18.1 <21 || >=22".
    if not ((20, 18, 1) <= v < (21,) or v >= (22,)):
        pytest.fail(f"node {version} is not one the SDK runs on (20.18.1+ or 22+): see scripts/test.sh",
                    pytrace=False)
    if not (JS / "node_modules" / "e2b").is_dir():
        pytest.fail(f"the SDK is not installed: (cd {JS} && npm ci)", pytrace=False)
    return path


@pytest.mark.timeout(900)
def test_javascript_sdk_suite(daemon, interpreter_image):
    exe = node()
    other = daemon["daemon"].make_key("e2b-js-other")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "HUTCH_"))}
    env.update({
        "E2B_API_URL": daemon["base"],
        "E2B_SANDBOX_URL": daemon["base"],
        "E2B_API_KEY": daemon["key"],
        "E2B_OTHER_API_KEY": other,
        # The daemon's --e2b-domain, which `getHost` names.
        "E2B_TEST_PORT_DOMAIN": daemon["domain"],
        # The daemon's default class: what its runsc does not do is `todo` there.
        "HUTCH_TEST_CLASS": TEST_CLASS,
    })
    files = sorted(str(p.relative_to(JS)) for p in (JS / "test").glob("*.test.mjs"))
    assert files, f"no tests in {JS / 'test'}"
    run = subprocess.run(
        [exe, "--test", f"--test-concurrency={CONCURRENCY}", f"--test-timeout={TEST_TIMEOUT_MS}",
         "--test-reporter=spec", *files],
        cwd=JS, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=840,
    )
    if run.returncode != 0:
        pytest.fail(f"node --test exited {run.returncode}\n{run.stdout}\n{run.stderr}", pytrace=False)
