"""Two daemons (nodes) sharing one PostgreSQL database: each acts only on
its own node's sandboxes; reads show every node's; an operation on another
node's sandbox is refused with `sandbox_on_other_node`; `/v1/nodes` lists
both with their heartbeats.

The fleet's PostgreSQL comes from conftest's `pg_admin` (one throwaway
cluster per test session unless HUTCH_TEST_DAEMON_POSTGRES names one)."""

import json
import subprocess

import pytest

from conftest import Client, expect_error, wait_for

NODE_A, NODE_B = "fleet-a", "fleet-b"


@pytest.fixture
def fleet(fleet_of):
    """Nodes A and B on one database; A starts first (and makes the admin key)."""
    return fleet_of([NODE_A, NODE_B])


def node_of(c: Client, sandbox_id: str) -> dict:
    r = c.get(f"/v1/sandboxes/{sandbox_id}")
    assert r.status_code == 200, r.text
    return r.json()


def ticks(c: Client) -> int:
    text = c.get("/metrics").text
    line = next(l for l in text.splitlines() if l.startswith("hutch_reconciler_ticks_total "))
    return int(float(line.split()[1]))


def test_nodes_share_a_database_and_act_only_on_their_own_sandboxes(fleet):
    a, b = fleet
    key = a.admin_key()
    on_a = Client(a.base, key, a.clients)
    on_b = Client(b.base, key)

    sb = on_a.create()
    sid = sb["id"]
    assert sb["node"] == NODE_A, sb
    assert on_a.exec(sid, "echo hi")["stdout"] == "hi\n"

    # B reads A's sandbox (list and get), naming its node.
    listed = on_b.get("/v1/sandboxes").json()
    mine = [s for s in listed["sandboxes"] if s["id"] == sid]
    assert mine and mine[0]["node"] == NODE_A, listed
    assert node_of(on_b, sid)["state"] == "running"

    # B refuses to act on it, naming the owner node; nothing changed.
    for method, path, body in [
        ("POST", f"/v1/sandboxes/{sid}/exec", {"command": "echo no"}),
        ("DELETE", f"/v1/sandboxes/{sid}", None),
        ("POST", f"/v1/sandboxes/{sid}/suspend", {"mode": "memory"}),
        ("POST", f"/v1/sandboxes/{sid}/extend", {"by": 60}),
        ("GET", f"/v1/sandboxes/{sid}/files?path=/etc/hostname", None),
    ]:
        kw = {"data": json.dumps(body), "headers": {"Content-Type": "application/json"}} if body else {}
        r = on_b.request(method, path, **kw)
        e = expect_error(r, 409, "sandbox_on_other_node")
        assert NODE_A in e["error"], e

    # B's reconciler runs past A's sandbox (three more passes) and ends nothing of it.
    start = ticks(on_b)
    wait_for("three passes of B's reconciler", lambda: ticks(on_b) >= start + 3, timeout=30)
    assert node_of(on_a, sid)["state"] == "running"

    # A restart of B (its recovery) leaves A's sandbox alone.
    b.stop()
    b.start()
    assert node_of(on_b, sid)["state"] == "running"
    assert on_a.exec(sid, "echo still")["stdout"] == "still\n"

    # Both nodes are listed, with heartbeats after their start.
    def beating():
        nodes = {n["name"]: n for n in on_b.get("/v1/nodes").json()["nodes"]}
        fresh = all(n["heartbeat_at"] > n["started_at"] for n in nodes.values())
        return set(nodes) == {NODE_A, NODE_B} and fresh and nodes

    nodes = wait_for("both nodes to heartbeat", beating, timeout=30)
    assert nodes[NODE_A]["state"] == "active" and nodes[NODE_B]["state"] == "active"
    assert nodes[NODE_A]["sandboxes"] >= 1 and nodes[NODE_B]["sandboxes"] == 0, nodes
    assert nodes[NODE_A]["advertise"] == a.base and nodes[NODE_B]["advertise"] == b.base
    assert nodes[NODE_A]["capacity"]["sandboxes"] > 0 and "container" in nodes[NODE_A]["capacity"]["classes"]

    # Admins only.
    user = a.new_client("fleet-user")
    expect_error(Client(b.base, user.key).get("/v1/nodes"), 403, "forbidden")

    # The CLI, through B's API.
    p = subprocess.run(
        [str(b.binary), "node", "list", "--url", b.base, "--api-key", key],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 0, p.stderr
    assert NODE_A in p.stdout and NODE_B in p.stdout and "active" in p.stdout, p.stdout

    # A deletes its own.
    r = on_a.delete(f"/v1/sandboxes/{sid}")
    assert r.status_code == 200, r.text
    assert node_of(on_b, sid)["state"] == "terminated"
