"""The MCP server, through the official MCP Python client (`mcp` from PyPI):
over streamable HTTP at the daemon's `/mcp`, and over stdio through
`hutch mcp` (a bridge to the same endpoint). The tools run real sandboxes;
refusals are tool errors with hutch's stable error codes; the session's
default sandbox ends with the session unless kept; a session and its
sandboxes belong to one key.

Everything here runs against the session's real daemon."""

from __future__ import annotations

import asyncio
import base64
import os

import httpx2
import pytest
import requests
from mcp.client import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.stdio import stdio_client as raw_stdio_client
from mcp.client.streamable_http import streamable_http_client

from conftest import DEBUG_BIN, Daemon, expect_error, wait_for

TOOLS = {
    "create_sandbox",
    "run_code",
    "exec",
    "read_file",
    "write_file",
    "list_files",
    "expose_port",
    "delete_sandbox",
    "list_sandboxes",
}
# A 1x1 PNG.
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)
CALL_TIMEOUT = 60
# A stand-in for matplotlib.pyplot: open figures that save as PNG.
FAKE_PYPLOT = f"""
import base64
_open = []
class _Figure:
    def savefig(self, path, format=None):
        with open(path, "wb") as f:
            f.write(base64.b64decode({base64.b64encode(PNG).decode()!r}))
def figure(num=None):
    if num not in _open:
        _open.append(num)
    return _Figure()
def get_fignums():
    return list(_open)
"""


@pytest.fixture(scope="module")
def alice(daemon: Daemon):
    return daemon.new_client("mcp-alice")


@pytest.fixture(scope="module")
def bob(daemon: Daemon):
    return daemon.new_client("mcp-bob")


def http_client(daemon: Daemon, key: str) -> Client:
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=CALL_TIMEOUT)
    return Client(streamable_http_client(daemon.base + "/mcp", http_client=http), read_timeout_seconds=CALL_TIMEOUT)


def stdio_client(daemon: Daemon, key: str) -> Client:
    env = {"HUTCH_URL": daemon.base, "HUTCH_API_KEY": key, "PATH": os.environ.get("PATH", "")}
    params = StdioServerParameters(command=str(DEBUG_BIN), args=["mcp"], env=env)
    return Client(params, read_timeout_seconds=CALL_TIMEOUT)


async def call(c: Client, tool: str, /, **args) -> dict:
    """A tool's structured answer; fails on a tool error."""
    r = await c.call_tool(tool, args)
    assert not r.is_error, f"{tool} failed: {r.content}"
    return r.structured_content


async def refused(c: Client, tool: str, want: str, /, **args) -> dict:
    """A tool error with hutch's `{error, code}`."""
    r = await c.call_tool(tool, args)
    assert r.is_error, f"{tool} {args} succeeded: {r.content}"
    body = r.structured_content
    assert body["code"] == want, (tool, args, body)
    assert body["error"], body
    assert want in r.content[0].text
    return body


def state_of(api, sandbox_id: str) -> str:
    r = api.get(f"/v1/sandboxes/{sandbox_id}")
    if r.status_code == 404:
        return "gone"
    assert r.status_code == 200, r.text
    return r.json()["state"]


def wait_ended(api, sandbox_id: str) -> None:
    wait_for(
        f"{sandbox_id} to end with its MCP session",
        lambda: state_of(api, sandbox_id) in ("terminated", "gone"),
        timeout=30,
    )


def test_tools_over_http(daemon: Daemon, alice):
    async def go():
        async with http_client(daemon, alice.key) as c:
            tools = (await c.list_tools()).tools
            assert TOOLS <= {t.name for t in tools}
            for t in tools:
                assert t.input_schema["type"] == "object", t
                assert t.description, t
            run = next(t for t in tools if t.name == "run_code")
            assert run.input_schema["required"] == ["code"]
            assert set(run.input_schema["properties"]) >= {"code", "language", "sandbox_id", "keep"}

            # No sandbox named: the session's default one is made on first use.
            r = await call(c, "run_code", code="print(6 * 7)")
            assert (r["stdout"], r["stderr"], r["exit_code"]) == ("42\n", "", 0), r
            sid = r["sandbox_id"]
            r = await call(c, "run_code", language="bash", code="echo out; echo err >&2; exit 3")
            assert (r["stdout"], r["stderr"], r["exit_code"], r["sandbox_id"]) == ("out\n", "err\n", 3, sid)
            r = await call(c, "run_code", language="node", code="console.log(6 * 7); process.exit(2)")
            assert (r["stdout"], r["exit_code"]) == ("42\n", 2), r
            r = await call(c, "exec", argv=["sh", "-c", "pwd; id -un"])
            assert r["stdout"].splitlines()[0] == "/workspace", r

            # Files: parents made, text back as text, listing.
            await call(c, "write_file", path="src/pkg/hello.py", content="print('hi from a file')\n")
            r = await c.call_tool("read_file", {"path": "/workspace/src/pkg/hello.py"})
            assert not r.is_error and r.content[0].text == "print('hi from a file')\n"
            r = await call(c, "exec", command="python3 src/pkg/hello.py")
            assert r["stdout"] == "hi from a file\n"
            r = await call(c, "list_files", path="src", recursive=True)
            assert {(e["path"], e["type"]) for e in r["entries"]} == {
                ("pkg", "directory"),
                ("pkg/hello.py", "file"),
            }, r

            # Python runs as `python3 -c` does, and its open matplotlib
            # figures come back as images (a stand-in pyplot here: the
            # base template has no matplotlib).
            probe = "import sys, os; print(sys.argv, __name__, os.environ['MPLBACKEND'], 'HUTCH_MCP_FIGURES' in os.environ)"
            r = await call(c, "run_code", code=probe)
            assert r["stdout"] == "['-c'] __main__ Agg False\n" and r["images"] == 0, r
            r = await call(c, "run_code", code="raise SystemExit(7)")
            assert r["exit_code"] == 7, r
            r = await call(c, "run_code", code="1/0")
            assert r["exit_code"] == 1 and "ZeroDivisionError" in r["stderr"], r
            assert r["stderr"].count('File "<string>"') == 1, "the runner's own frame is not shown"
            await call(c, "write_file", path="fake/matplotlib/__init__.py", content="")
            await call(c, "write_file", path="fake/matplotlib/pyplot.py", content=FAKE_PYPLOT)
            plot = "import sys; sys.path.insert(0, 'fake')\nimport matplotlib.pyplot as plt\nplt.figure(3)\nplt.figure(5)\nprint('plotted')"
            res = await c.call_tool("run_code", {"code": plot})
            assert not res.is_error and res.structured_content["stdout"] == "plotted\n", res
            assert res.structured_content["images"] == 2, res
            images = [b for b in res.content if b.type == "image"]
            assert [(b.mime_type, base64.b64decode(b.data)) for b in images] == [("image/png", PNG)] * 2
            r = await call(c, "exec", command="ls -a /tmp | grep -c hutch-mcp-figures || true")
            assert r["stdout"] == "0\n", "the figures' directory is removed"

            # A port: the URL and its token reach a server in the sandbox.
            await call(c, "write_file", path="site/index.html", content="mcp says hello\n")
            await call(
                c,
                "exec",
                command="cd site && nohup python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 &",
            )
            g = await call(c, "expose_port", port=8000)
            assert g["token"] and g["token_header"].lower() == "x-hutch-sandbox-token", g
            assert g["path_url"].startswith(daemon.base + f"/v1/sandboxes/{sid}/ports/8000/"), g

            def served():
                try:
                    r = requests.get(g["path_url"] + "index.html", headers={g["token_header"]: g["token"]}, timeout=5)
                except requests.RequestException:
                    return False
                return r.status_code == 200 and r.text == "mcp says hello\n"

            wait_for("the exposed port to serve", served, timeout=20)
            assert requests.get(g["path_url"], timeout=5).status_code in (401, 403)

            # An explicit sandbox, kept past the session.
            kept = await call(c, "create_sandbox", keep=True, ttl_seconds=600)
            assert kept["state"] == "running" and kept["kept"] is True
            r = await call(c, "run_code", code="import os; print(os.getcwd())")
            assert r["sandbox_id"] == kept["id"], "create_sandbox makes the session's default"
            listed = await call(c, "list_sandboxes")
            assert {sid, kept["id"]} <= {s["id"] for s in listed["sandboxes"]}
            assert listed["session_default"] == kept["id"]
            return sid, kept["id"]

    sid, kept = asyncio.run(go())
    # The client's exit ended the session: its default sandbox ended, the kept one lives.
    wait_ended(alice, sid)
    assert state_of(alice, kept) == "running"
    alice.destroy(kept)


def test_tools_over_stdio(daemon: Daemon, alice):
    async def go():
        async with stdio_client(daemon, alice.key) as c:
            assert TOOLS <= {t.name for t in (await c.list_tools()).tools}
            r = await call(c, "run_code", code="import sys; print(sys.version_info[0])")
            assert (r["stdout"], r["exit_code"]) == ("3\n", 0), r
            sid = r["sandbox_id"]
            # Runs concurrently: a slow call does not hold up a quick one.
            slow = asyncio.create_task(call(c, "exec", command="sleep 1; echo slow"))
            quick = await call(c, "exec", command="echo quick")
            assert quick["stdout"] == "quick\n"
            assert (await slow)["stdout"] == "slow\n"
            # Images come back as images, other bytes as base64.
            await call(c, "write_file", path="plot.png", content=base64.b64encode(PNG).decode(), encoding="base64")
            r = await c.call_tool("read_file", {"path": "plot.png"})
            assert not r.is_error and r.content[0].type == "image", r
            assert r.content[0].mime_type == "image/png" and base64.b64decode(r.content[0].data) == PNG
            await call(c, "write_file", path="blob", content=base64.b64encode(b"\xff\x00\xfe").decode(), encoding="base64")
            r = await call(c, "read_file", path="blob")
            assert (r["encoding"], base64.b64decode(r["content"])) == ("base64", b"\xff\x00\xfe")
            await refused(c, "run_code", "not_found", code="1", sandbox_id="sb-00000000000000ff")
            # The default sandbox ended elsewhere: the next call gets a new one.
            alice.destroy(sid)
            r = await call(c, "run_code", code="print('again')")
            assert r["stdout"] == "again\n" and r["sandbox_id"] != sid, r
            return r["sandbox_id"]

    sid = asyncio.run(go())
    # The end of stdin closed the session, and the sandbox with it.
    wait_ended(alice, sid)


def test_keep_on_the_first_call_keeps_the_default_sandbox(daemon: Daemon, alice):
    async def go():
        async with http_client(daemon, alice.key) as c:
            r = await call(c, "exec", command="echo kept > note", keep=True)
            # keep matters only for the call that makes the sandbox.
            assert (await call(c, "run_code", code="print(open('note').read())"))["sandbox_id"] == r["sandbox_id"]
            other = await call(c, "create_sandbox")
            return r["sandbox_id"], other["id"]

    sid, other = asyncio.run(go())
    # Once the session's other sandbox has ended, the kept one still runs.
    wait_ended(alice, other)
    assert state_of(alice, sid) == "running"
    assert alice.sh(sid, "cat note") == "kept\n"
    alice.destroy(sid)


def test_refusals_carry_stable_codes(daemon: Daemon, alice, bob):
    bobs = bob.create()

    async def go():
        async with http_client(daemon, alice.key) as c:
            # Another key's sandbox answers as one that does not exist.
            for tool, args in [
                ("run_code", {"code": "print(1)"}),
                ("exec", {"command": "true"}),
                ("read_file", {"path": "/etc/hostname"}),
                ("write_file", {"path": "x", "content": "x"}),
                ("list_files", {}),
                ("expose_port", {"port": 8000}),
                ("delete_sandbox", {}),
            ]:
                await refused(c, tool, "not_found", sandbox_id=bobs["id"], **args)
                await refused(c, tool, "not_found", sandbox_id="sb-00000000000000ff", **args)
            await refused(c, "run_code", "not_found", code="1", sandbox_id="../etc")
            # Arguments that do not fit the schema, and bad values.
            await refused(c, "run_code", "invalid_request", code="1", language="cobol")
            await refused(c, "run_code", "invalid_request")
            await refused(c, "exec", "invalid_request", command="true", argv=["true"])
            await refused(c, "exec", "invalid_request", command="true", surprise=1)
            await refused(c, "delete_sandbox", "invalid_request")
            await refused(c, "create_sandbox", "unknown_template", template="no-such-template")
            await refused(c, "expose_port", "invalid_request", port=0)
            r = await call(c, "run_code", code="print('x')", keep=False)
            await refused(c, "read_file", "not_found", path="/workspace/missing.txt")
            await refused(c, "list_files", "invalid_path", path="/workspace/../..")
            deleted = await call(c, "delete_sandbox")
            assert deleted["id"] == r["sandbox_id"]

    asyncio.run(go())
    assert state_of(bob, bobs["id"]) == "running", "bob's sandbox is untouched"
    bob.destroy(bobs["id"])


def test_http_needs_a_key_and_the_session_is_the_keys(daemon: Daemon, alice, bob):
    init = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "test", "version": "0"},
        },
    }
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    for auth in [None, "Bearer nope", "Basic " + alice.key]:
        h = dict(headers, **({"Authorization": auth} if auth else {}))
        r = requests.post(daemon.base + "/mcp", json=init, headers=h, timeout=10)
        expect_error(r, 401, "unauthorized")
    r = requests.get(daemon.base + "/mcp", headers={"Accept": "text/event-stream"}, timeout=10)
    expect_error(r, 401, "unauthorized")

    # A session opened by alice's key is refused to bob's key.
    r = requests.post(
        daemon.base + "/mcp", json=init, headers=dict(headers, Authorization=f"Bearer {alice.key}"), timeout=10
    )
    assert r.status_code == 200, r.text
    session = r.headers["mcp-session-id"]
    h = dict(headers, **{"Mcp-Session-Id": session, "MCP-Protocol-Version": "2025-06-18"})
    note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    r = requests.post(daemon.base + "/mcp", json=note, headers=dict(h, Authorization=f"Bearer {alice.key}"), timeout=10)
    assert r.status_code == 202, r.text
    call_ = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "list_sandboxes", "arguments": {}}}
    r = requests.post(daemon.base + "/mcp", json=call_, headers=dict(h, Authorization=f"Bearer {bob.key}"), timeout=10)
    assert r.status_code == 200, r.text
    assert '"isError":true' in r.text and "unauthorized" in r.text, r.text
    # A body past the endpoint's 4 MiB is refused unread as it streams,
    # whatever it claims to be; one within it is read.
    big = {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
           "params": {"name": "write_file", "arguments": {"path": "/tmp/big", "content": "x" * (4 << 20)}}}
    r = requests.post(daemon.base + "/mcp", json=big, headers=dict(h, Authorization=f"Bearer {alice.key}"), timeout=30)
    assert r.status_code == 413, (r.status_code, r.text[:300])
    r = requests.post(daemon.base + "/mcp", json=call_, headers=dict(h, Authorization=f"Bearer {alice.key}"), timeout=10)
    assert r.status_code == 200 and '"isError":true' not in r.text, r.text[:300]
    r = requests.delete(daemon.base + "/mcp", headers=dict(h, Authorization=f"Bearer {alice.key}"), timeout=10)
    assert r.status_code in (200, 202, 204), r.text


@pytest.mark.parametrize(
    "where, key, says",
    [
        ("nowhere", "alice", "cannot reach the hutch daemon"),
        ("daemon", "hutch_not_a_key", "a valid API key is required"),
    ],
)
def test_stdio_failures_are_clear(daemon: Daemon, alice, where, key, says):
    """No daemon, or a key it refuses: the client's connect fails with why."""
    url = "http://127.0.0.1:1" if where == "nowhere" else daemon.base
    env = {"HUTCH_URL": url, "HUTCH_API_KEY": alice.key if key == "alice" else key, "PATH": os.environ.get("PATH", "")}
    params = StdioServerParameters(command=str(DEBUG_BIN), args=["mcp"], env=env)

    async def go():
        with open(os.devnull, "w") as errlog:
            async with Client(raw_stdio_client(params, errlog=errlog), read_timeout_seconds=20) as c:
                await c.list_tools()

    with pytest.raises(Exception) as e:
        asyncio.run(go())
    assert says in repr(e.value), repr(e.value)


def test_a_stopping_daemon_ends_sessions_but_not_their_sandboxes(own_daemon: Daemon):
    """SIGTERM with a client connected: the session's streams end so the
    daemon can stop, and its sandbox is kept (sessions do not survive a
    restart; the work in them does, to its expiry)."""
    d = own_daemon
    d.start()
    api = d.client("admin")

    async def go():
        async with http_client(d, api.key) as c:
            r = await call(c, "run_code", code="open('/workspace/kept.txt', 'w').write('still here')")
            assert r["exit_code"] == 0, r
            # Stopped while the client holds its session open; stop() fails
            # the test if the daemon ignores SIGTERM.
            assert await asyncio.to_thread(d.stop) == 0, d.log_tail()
            return r["sandbox_id"]

    sid = asyncio.run(go())
    d.start()
    assert state_of(api, sid) == "running"
    r = api.post(f"/v1/sandboxes/{sid}/files/read", {"path": "kept.txt"})
    assert r.status_code == 200 and base64.b64decode(r.json()["data"]) == b"still here", r.text
