"""The gvisor isolation class: templates with `class: "gvisor"` run their
sandboxes under runsc (a user-space kernel in front of the host's), with
the container class's API: commands, files, environment, network policy,
memory limit, and a delete that leaves nothing on the host (mounts,
processes, cgroups, runsc's state)."""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import threading
import uuid

import pytest

from conftest import Client, Daemon, leftovers, wait_cleaned, wait_for


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def read(api: Client, sid: str, path: str) -> bytes:
    r = api.post(f"/v1/sandboxes/{sid}/files/read", {"path": path})
    assert r.status_code == 200, r.text
    return base64.b64decode(r.json()["data"])


def tname() -> str:
    return f"gv-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def gvisor_template(api: Client):
    name = tname()
    r = api.post("/v1/templates", {"name": name, "class": "gvisor", "env": {"FROM_TEMPLATE": "yes"}})
    assert r.status_code == 201, r.text
    assert r.json()["class"] == "gvisor"
    yield name
    api.delete(f"/v1/templates/{name}")


@pytest.fixture
def gsb(api: Client, gvisor_template: str):
    sb = api.create(template=gvisor_template)
    yield sb
    api.delete(f"/v1/sandboxes/{sb['id']}")


def test_a_gvisor_sandbox_runs_under_runsc(api: Client, gsb: dict):
    assert gsb["state"] == "running" and gsb["class"] == "gvisor", gsb
    # gVisor's kernel says who it is: the release it reports is its own.
    assert api.sh(gsb["id"], "uname -r") != subprocess.run(["uname", "-r"], capture_output=True, text=True).stdout
    assert api.sandbox(gsb["id"])["class"] == "gvisor"


def test_exec_output_exit_code_env_and_users(api: Client, gsb: dict):
    res = api.exec(gsb["id"], "echo out; echo err >&2; exit 7")
    assert (res["stdout"], res["stderr"], res["exit_code"]) == ("out\n", "err\n", 7), res
    assert api.sh(gsb["id"], "id -u; pwd") == "1000\n/workspace\n"
    assert api.sh(gsb["id"], "id -u", user="root") == "0\n"
    assert api.sh(gsb["id"], "echo $FROM_TEMPLATE $MINE", env={"MINE": "1"}) == "yes 1\n"


def test_files_write_and_read(api: Client, gsb: dict):
    sid = gsb["id"]
    data = "héllo\n".encode() * 1000
    r = api.post(f"/v1/sandboxes/{sid}/files/write", {"path": "/workspace/a.txt", "data": b64(data)})
    assert r.status_code in (200, 204), r.text
    assert api.sh(sid, "wc -c < /workspace/a.txt; python3 -c 'import os; print(os.stat(\"/workspace/a.txt\").st_uid)'") \
        == f"{len(data)}\n1000\n"
    api.sh(sid, "echo from-inside > /workspace/b.txt")
    assert read(api, sid, "/workspace/b.txt") == b"from-inside\n"
    # A symlink climbing out of the root resolves inside it (the agent
    # resolves paths itself under gVisor, which has no openat2).
    api.sh(sid, "ln -s /../../../../workspace/b.txt /workspace/link")
    assert read(api, sid, "/workspace/link") == b"from-inside\n"


def _host_server():
    """A TCP service on the host's own address; returns (addr, port, stop)."""
    r = subprocess.run(["ip", "-j", "route", "get", "1.1.1.1"], capture_output=True, text=True, timeout=10)
    addr = json.loads(r.stdout)[0]["prefsrc"]
    srv = socket.create_server((addr, 0))
    srv.settimeout(0.2)
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            c.sendall(b"host\n")
            c.close()
        srv.close()

    threading.Thread(target=loop, daemon=True).start()
    return addr, srv.getsockname()[1], stop


ROUTE = ("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
         "try:\n    s.connect(('192.0.2.1', 53)); print('src', s.getsockname()[0])\n"
         "except OSError as e: print('unreachable', e.errno)\n"
         "print('ifaces', sorted(n for _, n in socket.if_nameindex()))\n")


def test_network_policy_applies(api: Client, gvisor_template: str):
    """Default: the sandbox has its address from the host's namespace (runsc's
    netstack took it), and the host's policy still keeps it off the host.
    deny_all: loopback only."""
    addr, port, stop = _host_server()
    sb = api.create(template=gvisor_template)
    closed = api.create(template=gvisor_template, network={"egress": "deny_all"})
    try:
        with socket.create_connection((addr, port), timeout=3) as c:
            assert c.recv(10) == b"host\n"
        out = api.sh(sb["id"], f"python3 -c \"{ROUTE}\"")
        assert f"src {sb['network']['addresses'][0]}" in out, (out, sb["network"])
        res = api.exec(sb["id"], argv=["python3", "-c",
                       f"import socket\ntry:\n socket.create_connection(('{addr}', {port}), timeout=3); print('reached')\n"
                       "except OSError as e: print('refused')"])
        assert res["stdout"] == "refused\n", res
        out = api.sh(closed["id"], f"python3 -c \"{ROUTE}\"")
        assert "unreachable" in out and "ifaces ['lo']" in out, out
    finally:
        stop.set()
        api.destroy(sb["id"])
        api.destroy(closed["id"])


def test_memory_limit_holds(daemon: Daemon, api: Client, gvisor_template: str):
    """A command that allocates past the sandbox's memory does not get it.
    gVisor's sentry is in the sandbox's cgroup, so the host's limit caps the
    sandbox as a whole: the command is killed, or the sandbox ends (the
    host's OOM killer picks the sentry), and then nothing of it is left."""
    sb = api.create(template=gvisor_template, memory_mb=256)
    sid = sb["id"]
    fill = "python3 -c 'import os; x = os.urandom(600 << 20); print(len(x))'"
    try:
        r = api.exec_raw(sid, {"command": fill, "timeout_seconds": 60})
        if r.status_code == 200:
            res = r.json()
            assert res["exit_code"] != 0 and "629145600" not in res["stdout"], res
        else:
            assert r.status_code >= 500, r.text
            wait_for("the sandbox to end", lambda: api.sandbox(sid)["state"] == "terminated", timeout=30)
    finally:
        api.destroy(sid)
    wait_cleaned(daemon, sid)


def test_delete_leaves_nothing(daemon: Daemon, api: Client, gvisor_template: str):
    sb = api.create(template=gvisor_template)
    sid = sb["id"]
    assert api.sh(sid, "echo up") == "up\n"
    assert (daemon.run_dir / "gvb" / sid).is_dir()
    api.destroy(sid)
    wait_cleaned(daemon, sid)
    assert not leftovers(daemon.run_dir, sid)


def test_daemon_restart_adopts_a_gvisor_sandbox(own_daemon: Daemon):
    own_daemon.start()
    api = own_daemon.client()
    name = tname()
    r = api.post("/v1/templates", {"name": name, "class": "gvisor"})
    assert r.status_code == 201, r.text
    sb = api.create(template=name)
    sid = sb["id"]
    api.sh(sid, "echo kept > /workspace/k")
    own_daemon.stop()
    own_daemon.start()
    api = own_daemon.client()
    assert api.sandbox(sid)["state"] == "running"
    assert api.sh(sid, "cat /workspace/k") == "kept\n"
    api.destroy(sid)
    wait_cleaned(own_daemon, sid)
    api.delete(f"/v1/templates/{name}")
