"""The unmodified `e2b-code-interpreter` SDK against hutch's built-in
`code-interpreter-v1` template.

The template's image (the `code-interpreter` preset: Debian, Python and
Node, a venv of locked wheels, hutch's own interpreter server) is built
once, up front, with `hutch image build` into the daemon's state
directory, so a failing build shows its own error rather than a create
that times out. The SDK then reaches the server on port 49999 through
`E2B_SANDBOX_URL` and the `E2b-Sandbox-Port` header.
"""

from __future__ import annotations

import base64
import json

import pytest
import requests


# The first build of the image (mmdebstrap, the wheels) takes minutes.
pytestmark = pytest.mark.timeout(900)

PORT = 49999
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def image(interpreter_image):
    """The template's image (built once per session: conftest)."""


@pytest.fixture(scope="module")
def interp(image):
    from e2b_code_interpreter import Sandbox

    sb = Sandbox.create(envs={"SANDBOX_VAR": "from-create"}, timeout=600)
    yield sb
    sb.kill()


def test_run_code_returns_the_value_and_keeps_state_between_calls(interp):
    ex = interp.run_code("1+1")
    assert ex.error is None, ex.error
    assert ex.text == "2" and [r.is_main_result for r in ex.results] == [True]
    assert interp.run_code("counter = 40").results == []
    ex = interp.run_code("counter += 2\ncounter")
    assert ex.text == "42"
    assert ex.execution_count is not None and ex.execution_count >= 3


def test_stdout_and_stderr_reach_the_callbacks_and_the_logs(interp):
    out, err = [], []
    ex = interp.run_code(
        "import sys\nprint('to out')\nprint('to err', file=sys.stderr)\n'done'",
        on_stdout=out.append, on_stderr=err.append,
    )
    assert ex.logs.stdout == ["to out\n"] and ex.logs.stderr == ["to err\n"]
    assert [(m.line, m.error) for m in out] == [("to out\n", False)]
    assert [(m.line, m.error) for m in err] == [("to err\n", True)]
    assert ex.text == "done"


def test_an_error_carries_its_name_value_and_traceback(interp):
    seen = []
    ex = interp.run_code("def f():\n    return 1 / 0\nf()", on_error=seen.append)
    assert ex.error is not None and ex.results == []
    assert (ex.error.name, ex.error.value) == ("ZeroDivisionError", "division by zero")
    assert "return 1 / 0" in ex.error.traceback and "ZeroDivisionError" in ex.error.traceback
    assert [e.name for e in seen] == ["ZeroDivisionError"]
    # The context lives on.
    assert interp.run_code("'still here'").text == "still here"


def test_rich_results_html_png_and_dataframes(interp):
    ex = interp.run_code("from IPython.display import HTML\nHTML('<b>bold</b>')")
    assert ex.results[0].html == "<b>bold</b>"

    ex = interp.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.title('t')\nplt.show()"
    )
    assert ex.error is None, ex.error
    charts = [r for r in ex.results if r.png]
    assert len(charts) == 1 and not charts[0].is_main_result
    assert base64.b64decode(charts[0].png).startswith(PNG_MAGIC)

    ex = interp.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', None]})")
    assert ex.error is None, ex.error
    r = ex.results[0]
    assert "<table" in r.html and "a" in r.text
    assert r.data == {"a": [1, 2], "b": ["x", None]}


def test_env_vars_of_the_sandbox_and_of_one_execution(interp):
    code = "import os\n(os.environ.get('SANDBOX_VAR'), os.environ.get('RUN_VAR'))"
    assert interp.run_code(code).text == "('from-create', None)"
    assert interp.run_code(code, envs={"RUN_VAR": "once", "SANDBOX_VAR": "over"}).text == "('over', 'once')"
    # An execution's variables end with it.
    assert interp.run_code(code).text == "('from-create', None)"


def test_a_timeout_raises_and_the_context_runs_the_next_call(interp):
    from e2b.exceptions import TimeoutException

    interp.run_code("timed = 'before'")
    with pytest.raises(TimeoutException):
        interp.run_code("import time\nwhile True:\n    time.sleep(0.1)", timeout=2)
    # The abandoned execution was interrupted: the context is free and kept
    # its state.
    assert interp.run_code("timed").text == "before"


def test_contexts_keep_their_own_state_and_can_be_restarted_and_removed(interp):
    from e2b.exceptions import NotFoundException

    interp.run_code("shared_default = 1")
    ctx = interp.create_code_context(cwd="/tmp")
    assert (ctx.language, ctx.cwd) == ("python", "/tmp")
    assert interp.run_code("import os\nos.getcwd()", context=ctx).text == "/tmp"
    interp.run_code("mine = 'ctx'", context=ctx)
    assert interp.run_code("mine", context=ctx).text == "ctx"
    assert interp.run_code("'shared_default' in dir()", context=ctx).text == "False"
    assert interp.run_code("'mine' in dir()").text == "False"
    assert ctx.id in [c.id for c in interp.list_code_contexts()]

    interp.restart_code_context(ctx)
    ex = interp.run_code("mine", context=ctx)
    assert ex.error is not None and ex.error.name == "NameError"

    interp.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in interp.list_code_contexts()]
    with pytest.raises(NotFoundException):
        interp.run_code("1", context=ctx)


def test_javascript_keeps_state_streams_output_and_reports_errors(interp):
    ctx = interp.create_code_context(language="javascript")
    assert ctx.language == "javascript"
    out = []
    ex = interp.run_code("let n = 20; console.log('js out'); n * 2", context=ctx, on_stdout=out.append)
    assert ex.error is None, ex.error
    assert ex.text == "40" and ex.logs.stdout == ["js out\n"] and [m.line for m in out] == ["js out\n"]
    assert interp.run_code("n + 1", context=ctx).text == "21"
    assert interp.run_code("await new Promise(r => setTimeout(() => r(7), 50))", context=ctx).text == "7"
    ex = interp.run_code("throw new TypeError('boom')", context=ctx)
    assert (ex.error.name, ex.error.value) == ("TypeError", "boom") and "boom" in ex.error.traceback
    # `language` without a context: the language's default context.
    assert interp.run_code("typeof n", language="javascript").text == "undefined"
    interp.remove_code_context(ctx)


def test_bad_input_is_refused(interp, daemon):
    from e2b.exceptions import InvalidArgumentException, SandboxException

    with pytest.raises(SandboxException, match="ruby"):
        interp.run_code("puts 1", language="ruby")
    with pytest.raises(InvalidArgumentException):
        interp.run_code("1", language="python", context=interp.list_code_contexts()[0])

    base = daemon["base"]
    headers = {"E2b-Sandbox-Id": interp.sandbox_id, "E2b-Sandbox-Port": str(PORT)}
    body = json.dumps({"code": "1"})
    # Executing code takes the sandbox's access token; a context listing
    # does not (the SDK sends none there).
    r = requests.post(f"{base}/execute", data=body, headers=headers, timeout=30)
    assert r.status_code == 401, r.text
    r = requests.post(f"{base}/execute", data=body, headers={**headers, "X-Access-Token": "x" * 64}, timeout=30)
    assert r.status_code == 401, r.text
    assert requests.get(f"{base}/contexts", headers=headers, timeout=30).status_code == 200
    r = requests.get(f"{base}/contexts", headers={**headers, "E2b-Sandbox-Port": "0"}, timeout=30)
    assert r.status_code == 400, r.text


def test_a_sandbox_of_another_template_or_owner_is_not_reached(interp, daemon):
    from e2b import Sandbox

    base = daemon["base"]
    plain = Sandbox.create(timeout=120)
    try:
        # No token: only the interpreter's template has open context routes.
        h = {"E2b-Sandbox-Id": plain.sandbox_id, "E2b-Sandbox-Port": str(PORT)}
        assert requests.get(f"{base}/contexts", headers=h, timeout=30).status_code == 401
        # One sandbox's token does not open another's port.
        h = {"E2b-Sandbox-Id": interp.sandbox_id, "E2b-Sandbox-Port": str(PORT),
             "X-Access-Token": plain._envd_access_token}
        r = requests.post(f"{base}/execute", data=json.dumps({"code": "1"}), headers=h, timeout=30)
        assert r.status_code == 401, r.text
        # A sandbox whose port nothing listens on answers E2B's 502.
        h = {"E2b-Sandbox-Id": plain.sandbox_id, "E2b-Sandbox-Port": "8123",
             "X-Access-Token": plain._envd_access_token}
        r = requests.get(f"{base}/anything", headers=h, timeout=30)
        assert r.status_code == 502 and r.json()["port"] == 8123, r.text
    finally:
        plain.kill()


async def test_the_async_sdk_runs_code_with_callbacks(image):
    from e2b_code_interpreter import AsyncSandbox

    sb = await AsyncSandbox.create(timeout=120)
    try:
        out = []
        ex = await sb.run_code("print('async out')\n6 * 7", on_stdout=out.append)
        assert ex.text == "42" and [m.line for m in out] == ["async out\n"]
        ctx = await sb.create_code_context(language="javascript")
        assert (await sb.run_code("[1, 2].length", context=ctx)).text == "2"
        assert ctx.id in [c.id for c in await sb.list_code_contexts()]
    finally:
        await sb.kill()


def test_a_sandbox_without_public_traffic_opens_its_contexts_to_its_traffic_token_only(image, daemon):
    from e2b_code_interpreter import Sandbox

    sb = Sandbox.create(timeout=300, network={"allow_public_traffic": False})
    try:
        assert sb.traffic_access_token
        # The SDK sends the token itself: contexts and code work as usual.
        ctx = sb.create_code_context()
        assert sb.run_code("6 * 7", context=ctx).text == "42"
        base = daemon["base"]
        h = {"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": str(PORT)}
        assert requests.get(f"{base}/contexts", headers=h, timeout=30).status_code == 401
        wrong = {**h, "E2B-Traffic-Access-Token": "x" * 64}
        assert requests.get(f"{base}/contexts", headers=wrong, timeout=30).status_code == 401
        right = {**h, "E2B-Traffic-Access-Token": sb.traffic_access_token}
        assert requests.get(f"{base}/contexts", headers=right, timeout=30).status_code == 200
    finally:
        sb.kill()
