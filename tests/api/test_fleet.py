"""Nodes sharing one PostgreSQL database: any node answers any call (a
call for another node's sandbox is forwarded to it, streams, WebSocket
upgrades and the port proxy included); creates are placed across the
nodes; each node's own work (its reconciler, its recovery) touches only
its sandboxes; `/v1/nodes` lists them with their heartbeats. Events are
the fleet's (one sequence of ids, streams that follow every node's, a
`Last-Event-ID` that resumes on any node), each webhook delivery is sent
by one node, of daemons starting together on an empty database one
makes the admin key, and a node's restart fails only its own unfinished
builds.

The fleet's PostgreSQL comes from conftest's `pg_admin` (one throwaway
cluster per test session unless HUTCH_TEST_DAEMON_POSTGRES names one)."""

import base64
import queue
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import requests

from conftest import Client, EventStream, expect_error, expect_status, stdout_of, wait_for

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

    sb = on_b.create(node=NODE_A)
    sid = sb["id"]
    assert sb["node"] == NODE_A, sb
    assert on_a.exec(sid, "echo hi")["stdout"] == "hi\n"

    # B reads A's sandbox (list and get), naming its node.
    listed = on_b.get("/v1/sandboxes").json()
    mine = [s for s in listed["sandboxes"] if s["id"] == sid]
    assert mine and mine[0]["node"] == NODE_A, listed
    assert node_of(on_b, sid)["state"] == "running"

    # B answers for it: the calls are forwarded to A, which acts.
    assert on_b.exec(sid, "echo via b")["stdout"] == "via b\n"
    r = on_b.post(f"/v1/sandboxes/{sid}/extend", {"by": 60})
    assert r.status_code == 200, r.text

    # A call that says a node forwarded it is answered where it lands:
    # B, which does not act on A's sandbox (nothing loops).
    r = on_b.post(f"/v1/sandboxes/{sid}/exec", {"command": "echo no"}, headers={"hutch-node": NODE_A})
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

    # Only an admin names a sandbox's node, and only an active node.
    expect_error(Client(b.base, user.key).post("/v1/sandboxes", {"node": NODE_A}), 403, "forbidden")
    expect_error(on_b.post("/v1/sandboxes", {"node": "no-such-node"}), 400, "invalid_request")

    # A volume made on B has its files on B: calls for it through A are
    # answered by B, and a create through A that mounts it goes to B.
    u_a, u_b = Client(a.base, user.key), Client(b.base, user.key)
    r = u_b.post("/v1/volumes", {"name": "on-b", "size_mib": 64})
    assert r.status_code == 201, r.text
    vid = r.json()["id"]
    vsb = u_a.create(volumes=[{"name": "on-b", "path": "/data"}])
    assert vsb["node"] == NODE_B, vsb
    u_a.sh(vsb["id"], "head -c 1048576 /dev/urandom > /data/blob")
    # Only B reads its usage.
    wait_for("B to show the volume's usage through A",
             lambda: u_a.get("/v1/volumes/on-b").json()["used_bytes"] >= 1 << 20, timeout=30)
    r = u_a.request("PATCH", f"/v1/volumes/{vid}", json={"size_mib": 128})
    assert r.status_code == 200 and r.json()["size_mib"] == 128, r.text
    expect_error(u_a.delete("/v1/volumes/on-b"), 409, "volume_in_use")
    assert u_a.delete(f"/v1/sandboxes/{vsb['id']}").status_code == 200
    assert u_a.delete("/v1/volumes/on-b").status_code == 204
    # Its files went with it, on B.
    assert not (b.state_dir / "storage" / "fs" / "volumes" / vid).exists()

    # A deletes its own.
    r = on_a.delete(f"/v1/sandboxes/{sid}")
    assert r.status_code == 200, r.text
    assert node_of(on_b, sid)["state"] == "terminated"


def test_any_node_answers_for_any_sandbox_and_creates_spread(fleet_of):
    """Three nodes: 30 sandboxes created through A land on all three; each
    is listed, executed in and has its files written and read through the
    other nodes; streams, a PTY and the port proxy pass through a node
    that does not own the sandbox; E2B's API too."""
    import websocket

    from test_proxy import grant, start_app, via_path

    a, b, c = fleet_of(["fleet-a", "fleet-b", "fleet-c"])
    key = a.admin_key()
    via = {d.name: Client(d.base, key, a.clients if d is a else None) for d in (a, b, c)}

    made = [via["fleet-a"].create() for _ in range(30)]
    nodes = {sb["node"] for sb in made}
    assert nodes == {"fleet-a", "fleet-b", "fleet-c"}, [sb["node"] for sb in made]

    listed = {s["id"]: s["node"] for s in via["fleet-c"].list_all()}
    for sb in made:
        assert listed.get(sb["id"]) == sb["node"], (sb, listed.get(sb["id"]))

    for i, sb in enumerate(made):
        sid = sb["id"]
        others = [n for n in ("fleet-a", "fleet-b", "fleet-c") if n != sb["node"]]
        first, second = via[others[0]], via[others[1]]
        out = first.exec(sid, f"echo {sid} > /workspace/who; cat /workspace/who")
        assert out["exit_code"] == 0 and out["stdout"] == f"{sid}\n", out
        r = second.get(f"/v1/sandboxes/{sid}/files", params={"path": "/workspace/who"})
        assert r.status_code == 200 and r.content == f"{sid}\n".encode(), (r.status_code, r.text)
        data = base64.b64encode(f"file {i}".encode()).decode()
        r = second.post(f"/v1/sandboxes/{sid}/files/write", {"path": "/workspace/n", "data": data})
        assert r.status_code == 204, r.text
        assert via[sb["node"]].sh(sid, "cat /workspace/n") == f"file {i}"

    # A stream (NDJSON) through a node that does not own the sandbox.
    remote = next(sb for sb in made if sb["node"] == "fleet-c")
    sid = remote["id"]
    r = via["fleet-a"].exec_raw(
        sid,
        {"command": "echo first; sleep 0.2; echo second"},
        headers={"Accept": "application/x-ndjson"},
        stream=True,
    )
    assert r.status_code == 200, r.text
    stream = EventStream(r)
    events = stream.rest()
    assert stdout_of(events) == "first\nsecond\n", events

    # A PTY (a WebSocket upgrade) through B.
    url = f"{b.base.replace('http://', 'ws://', 1)}/v1/sandboxes/{sid}/pty"
    ws = websocket.create_connection(url, header=[f"Authorization: Bearer {key}"], timeout=30)
    try:
        ws.send_binary(b"echo pty-$((6*7))\n")
        seen = b""
        deadline = time.monotonic() + 30
        while b"pty-42" not in seen and time.monotonic() < deadline:
            op, data = ws.recv_data()
            if op == websocket.ABNF.OPCODE_BINARY:
                seen += data
        assert b"pty-42" in seen, seen
    finally:
        ws.close()

    # The port proxy's path form through A, with an access grant made through B.
    start_app(via["fleet-b"], sid)
    token = grant(via["fleet-b"], sid)["token"]
    r = via_path(a, sid, "/hello", token)
    assert r.status_code == 200, r.text

    # Without a key, the owner node refuses it, as it would directly.
    r = requests.post(f"{a.base}/v1/sandboxes/{sid}/exec", json={"command": "true"}, timeout=30)
    expect_error(r, 401, "unauthorized")

    # E2B: a create through A, read and killed through the others.
    e2b = {"X-API-Key": key}
    r = requests.post(f"{a.base}/sandboxes", json={"templateID": "base"}, headers=e2b, timeout=60)
    assert r.status_code == 201, r.text
    eid = r.json()["sandboxID"]
    for d in (b, c):
        r = requests.get(f"{d.base}/sandboxes/{eid}", headers=e2b, timeout=30)
        assert r.status_code == 200 and r.json()["sandboxID"] == eid, r.text
    r = requests.delete(f"{c.base}/sandboxes/{eid}", headers=e2b, timeout=60)
    assert r.status_code == 204, r.text

    # Deletes through any node.
    for i, sb in enumerate(made):
        r = via[("fleet-a", "fleet-b", "fleet-c")[i % 3]].delete(f"/v1/sandboxes/{sb['id']}")
        assert r.status_code == 200, r.text
    states = {s["id"]: s["state"] for s in via["fleet-b"].list_all()}
    assert all(states.get(sb["id"], "terminated") == "terminated" for sb in made), states


def test_a_node_that_does_not_answer_is_named(fleet_of):
    """A call for the sandbox of a node that is down is refused with
    `node_unreachable`, naming the node; once it is back, calls reach it."""
    a, b = fleet_of(["fleet-a", "fleet-b"])
    key = a.admin_key()
    on_a, on_b = Client(a.base, key, a.clients), Client(b.base, key, b.clients)
    # Creates through B spread over both nodes: take one that landed on B.
    sid = on_a.create(node="fleet-b")["id"]
    b.kill9()
    r = on_a.post(f"/v1/sandboxes/{sid}/exec", {"command": "true"})
    e = expect_error(r, 502, "node_unreachable")
    assert "fleet-b" in e["error"], e
    b.start()
    assert on_a.exec(sid, "echo back")["stdout"] == "back\n"


def warm_on(d, key: str, tid: str) -> int:
    """Ready warm sandboxes of a template on node `d` (its /metrics)."""
    text = Client(d.base, key).get("/metrics").text
    for line in text.splitlines():
        if line.startswith("hutch_warm_pool_size{") and f'template_id="{tid}"' in line:
            return int(float(line.split()[-1]))
    return 0


def test_a_warm_pool_is_the_fleets_and_creates_go_where_it_is(fleet_of):
    """A template's warm sizes are the fleet's: three warm sandboxes are
    split 2 + 1 over two nodes; a create of it, through either node, is
    served by a warm sandbox, and the pool refills to three."""
    a, b = fleet_of(["fleet-a", "fleet-b"])
    key = a.admin_key()
    on_a, on_b = Client(a.base, key, a.clients), Client(b.base, key, b.clients)
    r = on_a.post("/v1/templates", {"name": "fleet-warm", "warm": {"min": 3, "max": 3}})
    assert r.status_code == 201, r.text
    tid = r.json()["id"]

    def split():
        counts = (warm_on(a, key, tid), warm_on(b, key, tid))
        return counts == (2, 1) and counts

    wait_for("the pool split 2 + 1 over the nodes", split, timeout=60)
    def claims() -> int:
        total = 0
        for d in (a, b):
            line = next(l for l in Client(d.base, key).get("/metrics").text.splitlines()
                        if l.startswith("hutch_warm_claims_total "))
            total += int(float(line.split()[1]))
        return total

    before = claims()
    sb = on_b.create(template="fleet-warm")
    assert sb["node"] in ("fleet-a", "fleet-b"), sb
    assert claims() == before + 1, "the create was not served by a warm sandbox"
    wait_for("the pool to refill to three", lambda: warm_on(a, key, tid) + warm_on(b, key, tid) == 3, timeout=60)


def read_events(stream, n: int, timeout: float = 60) -> list[dict]:
    """The next `n` events of an `Sse` stream, each awaited at most
    `timeout` seconds (a stream that stalls fails the test in time)."""
    got: queue.Queue = queue.Queue()

    def pump():
        try:
            for _ in range(n):
                got.put(stream.next())
        except Exception as e:  # noqa: BLE001 - handed to the test's thread
            got.put(e)

    threading.Thread(target=pump, daemon=True).start()
    out = []
    for _ in range(n):
        try:
            e = got.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the stream stalled after {len(out)} of {n} events: {out}") from None
        if isinstance(e, Exception):
            raise e
        out.append(e)
    return out


def test_events_and_webhook_deliveries_are_the_fleets(fleet_of):
    """Both nodes emit at once: one sequence of ids (none given twice, the
    same list through either node); a stream on A follows B's events too,
    in id order; a `Last-Event-ID` seen on A resumes on B; and each webhook
    delivery reaches the receiver once, sent by one node."""
    from test_events import ENV, Receiver, Sse, deliveries, events, verify

    a, b = fleet_of([NODE_A, NODE_B], env=ENV)
    key = a.admin_key()
    on = {NODE_A: Client(a.base, key), NODE_B: Client(b.base, key)}
    rx = Receiver()
    streams = []
    made = []
    try:
        r = on[NODE_A].post("/v1/webhooks", {"url": rx.url, "events": ["sandbox.created", "sandbox.ready"]})
        expect_status(r, 201)
        hook = r.json()
        live = Sse(on[NODE_A])
        streams.append(live)
        # Creates on both nodes at once, each through the node it lands on.
        nodes = [NODE_A, NODE_B] * 4
        with ThreadPoolExecutor(len(nodes)) as pool:
            made = list(pool.map(lambda n: on[n].create(node=n), nodes))
        assert sorted(sb["node"] for sb in made) == sorted(nodes)
        # created and ready of each: A's stream has B's too, in id order.
        seen = read_events(live, 2 * len(made))
        assert {e["sandbox_id"] for e in seen} == {sb["id"] for sb in made}, seen
        ids = [e["id"] for e in seen]
        assert ids == sorted(ids) and len(set(ids)) == len(ids), ids
        # One sequence: the same events through either node, no id twice.
        listed = events(on[NODE_A])
        assert events(on[NODE_B]) == listed
        assert len({e["id"] for e in listed}) == len(listed)
        assert [e for e in listed if e["id"] >= ids[0]] == seen
        # A cursor seen on A resumes on B: the events after it, in order.
        mid = seen[len(seen) // 2 - 1]["id"]
        resumed = Sse(on[NODE_B], last=mid)
        streams.append(resumed)
        after = [e for e in seen if e["id"] > mid]
        assert read_events(resumed, len(after)) == after
        # Each delivery is sent once (no second node sends it too).
        def all_delivered():
            ds = deliveries(on[NODE_A], hook["id"])
            return len(ds) == len(seen) and all(d["status"] == "delivered" for d in ds) and ds

        ds = wait_for("every delivery delivered", all_delivered, timeout=60, interval=0.2)
        assert all(d["attempts"] == 1 for d in ds), ds
        got = rx.requests()
        sent = sorted(h["hutch-delivery-id"] for h, _, _ in got)
        assert sent == sorted(str(d["id"]) for d in ds), "each delivery sent once"
        # The id a receiver gets is the event's (the store's).
        assert sorted(verify(hook["secret"], h, body)["id"] for h, body, _ in got) == ids
    finally:
        for s in streams:
            s.close()
        rx.close()
        for sb in made:
            expect_status(on[sb["node"]].delete(f"/v1/sandboxes/{sb['id']}"), 200)


def test_daemons_starting_together_on_an_empty_database_make_one_admin_key(fleet_of, monkeypatch):
    """Two nodes started at once on an empty database: one admin key, its
    secret in one node's admin.key, and it works through both."""
    from conftest import Daemon

    # fleet_of starts its nodes one after another: made unstarted here,
    # then started together.
    monkeypatch.setattr(Daemon, "start", lambda self, *args, **kwargs: self)
    made = fleet_of(["first-a", "first-b"])
    monkeypatch.undo()
    with ThreadPoolExecutor(len(made)) as pool:
        list(pool.map(lambda d: d.start(), made))
    files = [d.state_dir / "admin.key" for d in made if (d.state_dir / "admin.key").exists()]
    assert len(files) == 1, files
    key = files[0].read_text().strip()
    for d in made:
        r = Client(d.base, key).get("/v1/keys")
        expect_status(r, 200)
        admins = [k for k in r.json()["keys"] if k["admin"]]
        assert len(admins) == 1, admins


def test_a_nodes_restart_fails_only_its_own_unfinished_builds(fleet_of):
    """A build runs on A; B restarting (its start fails the builds a
    stopped daemon left) leaves it building; A's own restart fails it."""
    from test_builds import build_log, make_template, start_build, wait_build

    a, b = fleet_of([NODE_A, NODE_B])
    on_a = Client(a.base, a.admin_key())
    t = make_template(on_a)
    bld = start_build(on_a, t["id"], {"Dockerfile": "RUN echo started; exec sleep 600\n"})
    try:
        wait_for("the step to run", lambda: "\nstarted\n" in build_log(on_a, t["id"], bld["id"]),
                 timeout=60, interval=0.1)
        b.stop()
        b.start()
        r = on_a.get(f"/v1/templates/{t['id']}/builds/{bld['id']}")
        expect_status(r, 200)
        assert r.json()["state"] == "building", r.json()
        a.kill9()
        a.start()
        done = wait_build(on_a, t["id"], bld["id"], timeout=30)
        assert done["state"] == "failed" and "interrupted" in done["error"], done
    finally:
        on_a.delete(f"/v1/templates/{t['id']}")
