"""Node loss and drain in a fleet of three daemons on one PostgreSQL
database (conftest's `fleet_of`), with a short --node-lost-after.

Node C is killed with SIGKILL: the other nodes declare it lost once it has
been silent for longer than HUTCH_NODE_LOST_AFTER; its running sandboxes
become `lost` (with a reason naming C), its disk-paused one stays paused
with a note, its owner's quota is freed, creates go on on A and B. C
started again ends on its host what the fleet no longer gives it (its
processes, cgroups, sockets), keeps its paused sandbox, and is active
again. A drained node refuses creates named for it (`node_draining`),
placement passes it by, and it says when it is
empty; `hutch doctor --fleet` fails while a node is lost.

Creates are placed across the nodes: the admin names the node of each
sandbox (`node`), a user's create is made until it lands on the node
wanted."""

from __future__ import annotations

import json
import os
import signal
import subprocess

from conftest import Client, cgroup_dirs, expect_error, expect_status, host_processes_of, wait_cleaned, wait_for

A, B, C = "loss-a", "loss-b", "loss-c"
LOST_AFTER = 6  # seconds; heartbeats every second (fleet_of): room for a loaded host
ENV = {"HUTCH_NODE_LOST_AFTER": f"{LOST_AFTER}s"}


def nodes(c: Client) -> dict[str, dict]:
    r = c.get("/v1/nodes")
    expect_status(r, 200)
    return {n["name"]: n for n in r.json()["nodes"]}


def state_of(c: Client, sid: str) -> dict:
    r = c.get(f"/v1/sandboxes/{sid}")
    expect_status(r, 200)
    return r.json()


def cli(binary, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60)


def metric(c: Client, prefix: str) -> float:
    text = c.get("/metrics").text
    line = next((l for l in text.splitlines() if l.startswith(prefix + " ")), None)
    assert line is not None, f"{prefix} not in /metrics"
    return float(line.split()[1])


def cleanup(made: dict[str, tuple[Client, str]]) -> list[str]:
    """Deletes every sandbox through its own node; what went wrong."""
    problems = []
    for sid, (c, _) in made.items():
        try:
            r = c.delete(f"/v1/sandboxes/{sid}")
            if r.status_code != 200:
                problems.append(f"delete {sid}: {r.status_code} {r.text}")
        except Exception as e:  # noqa: BLE001 - reported, the fixture checks the host
            problems.append(f"delete {sid}: {e}")
    return problems


def test_a_silent_node_is_lost_and_cleans_up_when_it_comes_back(fleet_of):
    a, b, c = fleet_of([A, B, C], env=ENV)
    key = a.admin_key()
    on = {A: Client(a.base, key), B: Client(b.base, key), C: Client(c.base, key)}
    # A user whose quota the loss frees: two sandboxes at most.
    _, user_key = a.new_key("loss-user", "--max-sandboxes", "2")
    user = {n: Client(d.base, user_key) for n, d in [(A, a), (B, b), (C, c)]}
    made: dict[str, tuple[Client, str]] = {}

    def create(node: str, client: dict[str, Client] = on, **body) -> str:
        # The admin names the node; a user's create is placed, so it is
        # made again until it lands there (its others deleted at once).
        if client is on:
            body["node"] = node
        for _ in range(30):
            sb = client[node].create(**body)
            if sb["node"] == node:
                made[sb["id"]] = (client[node], node)
                return sb["id"]
            client[node].destroy(sb["id"])
        raise AssertionError(f"no create through {node} landed on it")

    try:
        for node in (A, B):
            create(node)
        on_c = [create(C), create(C, user), create(C, user)]
        paused = create(C)
        expect_status(on[C].post(f"/v1/sandboxes/{paused}/suspend", {"mode": "disk"}), 200)
        assert state_of(on[C], paused)["state"] == "paused"
        # The user is at its quota (its two sandboxes on C count everywhere).
        expect_error(user[A].post("/v1/sandboxes", {"ttl_seconds": 900}), 429, "quota_exceeded")
        assert all(host_processes_of([sid]) for sid in on_c), "C's sandboxes run on the host"

        c.kill9()

        def c_lost():
            seen = [state_of(on[A], sid) for sid in on_c]
            return all(s["state"] == "lost" for s in seen) and nodes(on[B])[C]["state"] == "lost" and seen

        seen = wait_for(f"node {C}'s sandboxes to be lost", c_lost, timeout=LOST_AFTER * 6)
        for s in seen:
            assert s["last_error_code"] == "node_lost", s
            assert C in s["reason"] and "stopped heartbeating" in s["reason"], s
            assert s["node"] == C, s
        # Its disk-paused sandbox stays paused, with a note.
        p = state_of(on[B], paused)
        assert p["state"] == "paused" and C in p.get("reason", ""), p
        listed = nodes(on[A])
        assert listed[C]["sandboxes"] == 1, listed[C]  # the paused one
        assert listed[A]["state"] == listed[B]["state"] == "active", listed

        # A lost sandbox runs nowhere: asked anywhere, it is not running.
        expect_error(on[A].exec_raw(on_c[0], {"command": "true"}), 409, "sandbox_session_not_running")
        # Creates go on on A and B; the user's quota was freed by the loss.
        for node in (A, B):
            sid = create(node)
            assert on[node].exec(sid, "echo up")["stdout"] == "up\n"
        create(A, user)

        # Operations: the fleet gauges, and the doctor fails while C is lost.
        assert metric(on[A], 'hutch_fleet_nodes{state="lost"}') == 1
        assert metric(on[A], 'hutch_fleet_nodes{state="active"}') == 2
        assert metric(on[A], "hutch_placement_failures_total") == 0
        assert f'hutch_fleet_node_sandboxes{{node="{C}",state="lost"}} 1' in on[A].get("/metrics").text
        doc = cli(a.binary, "doctor", "--fleet", "--url", a.base, "--api-key", key)
        assert doc.returncode == 1, doc.stdout + doc.stderr
        assert C in doc.stdout and "lost" in doc.stdout, doc.stdout
        doc = cli(a.binary, "doctor", "--fleet", "--json", "--url", a.base, "--api-key", key)
        verdicts = {n["node"]["name"]: n["verdict"] for n in json.loads(doc.stdout)["nodes"]}
        assert verdicts == {A: "ok", B: "ok", C: "lost"}, verdicts
        # A lost node is neither drained nor undrained: it comes back by starting.
        expect_error(on[A].post(f"/v1/nodes/{C}/drain"), 409, "conflict")

        # C comes back: it ends on its host what it no longer owns, keeps
        # its paused sandbox, and is active again.
        c.kill_strays()
        c.start()
        for sid in on_c:
            # Its processes may take a moment to be reaped once killed.
            wait_cleaned(c, sid)
            assert not host_processes_of([sid]) and not cgroup_dirs(sid), sid
            assert state_of(on[C], sid)["state"] == "lost"
        assert state_of(on[C], paused)["state"] == "paused"
        wait_for(f"{C} to be active", lambda: nodes(on[A])[C]["state"] == "active", timeout=30)
        doc = cli(a.binary, "doctor", "--fleet", "--url", a.base, "--api-key", key)
        assert doc.returncode == 0, doc.stdout + doc.stderr
        # A's and B's sandboxes were not touched.
        for sid, (client, node) in made.items():
            if node in (A, B):
                assert state_of(client, sid)["state"] == "running", sid
        sid = create(C)
        assert on[C].exec(sid, "echo back")["stdout"] == "back\n"
        # Deleting a lost sandbox, through any node, answers it as it is.
        for node in (C, A):
            r = on[node].delete(f"/v1/sandboxes/{on_c[0]}")
            expect_status(r, 200)
            assert r.json()["state"] == "lost"
    finally:
        problems = cleanup(made)
    assert not problems, problems


def test_a_drained_node_refuses_creates_and_says_when_it_is_empty(fleet_of):
    a, b = fleet_of([A, B], env=ENV)
    key = a.admin_key()
    on_a, on_b = Client(a.base, key), Client(b.base, key)
    made: dict[str, tuple[Client, str]] = {}
    template = None
    try:
        sb = on_b.create(node=B)
        made[sb["id"]] = (on_b, B)
        # A warm pool of two: the fleet's, one on each node.
        r = on_a.post("/v1/templates", {"name": "drain-warm", "warm": {"min": 2, "max": 2}})
        expect_status(r, 201)
        template = r.json()["id"]
        wait_for("B's warm sandbox", lambda: nodes(on_a)[B]["sandboxes"] == 2, timeout=60)

        # Only admin keys drain; unknown nodes are named as such.
        _, user_key = a.new_key("drain-user")
        expect_error(Client(a.base, user_key).post(f"/v1/nodes/{B}/drain"), 403, "forbidden")
        expect_error(on_a.post("/v1/nodes/no-such-node/drain"), 404, "node_not_found")
        p = cli(a.binary, "node", "drain", "no-such-node", "--url", a.base, "--api-key", key)
        assert p.returncode != 0 and "node_not_found" in p.stderr + p.stdout, p.stdout + p.stderr

        # The CLI drains B through A; B refuses creates at once.
        p = cli(a.binary, "node", "drain", B, "--url", a.base, "--api-key", key)
        assert p.returncode == 0, p.stderr
        assert "draining" in p.stdout and "still holds" in p.stdout, p.stdout
        e = expect_error(on_b.post("/v1/sandboxes", {"ttl_seconds": 900, "node": B}), 503, "node_draining")
        assert B in e["error"], e
        listed = nodes(on_a)
        assert listed[B]["state"] == "draining" and listed[B]["drained"] is False, listed[B]
        assert "drained" not in listed[A], listed[A]
        # Its sandbox goes on running; A takes creates.
        assert on_b.exec(sb["id"], "echo still")["stdout"] == "still\n"
        sa = on_a.create()
        made[sa["id"]] = (on_a, A)
        # The doctor shows it draining, and is content.
        doc = cli(a.binary, "doctor", "--fleet", "--url", a.base, "--api-key", key)
        assert doc.returncode == 0 and "draining" in doc.stdout, doc.stdout + doc.stderr

        # Once its last sandbox is gone (its warm one drained: a draining
        # node keeps no pool), the operator sees it is empty.
        on_b.destroy(sb["id"])
        del made[sb["id"]]
        wait_for(f"{B} to be drained", lambda: nodes(on_a)[B]["drained"] is True, timeout=30)
        # A keeps the whole pool (the fleet's two: B takes no share) and its own.
        wait_for("A to hold the whole pool", lambda: nodes(on_a)[A]["sandboxes"] == 3, timeout=60)
        p = cli(a.binary, "node", "list", "--url", a.base, "--api-key", key)
        assert p.returncode == 0 and "draining (drained)" in p.stdout, p.stdout

        # A drain outlives a restart of the node.
        b.stop()
        b.start()
        assert nodes(on_a)[B]["state"] == "draining"
        expect_error(on_b.post("/v1/sandboxes", {"ttl_seconds": 900, "node": B}), 503, "node_draining")
        # Sent to B without a node, a create is placed on A.
        placed = on_b.create()
        made[placed["id"]] = (on_a, A)
        assert placed["node"] == A, placed

        # Undrain through the API: B takes sandboxes again.
        r = on_a.post(f"/v1/nodes/{B}/undrain")
        expect_status(r, 200)
        assert r.json()["state"] == "active" and "drained" not in r.json(), r.json()
        sb = on_b.create(node=B)
        made[sb["id"]] = (on_b, B)
        p = cli(a.binary, "node", "undrain", B, "--url", a.base, "--api-key", key, "--json")
        assert p.returncode == 0 and json.loads(p.stdout)["state"] == "active", p.stdout + p.stderr
        # Its pool fills again.
        wait_for("B's warm sandbox again", lambda: nodes(on_a)[B]["sandboxes"] == 2, timeout=60)
    finally:
        problems = cleanup(made)
        if template:
            r = on_a.delete(f"/v1/templates/{template}")
            if r.status_code not in (204, 404):
                problems.append(f"delete template: {r.status_code} {r.text}")
            # Each node drains its own pool of a deleted template.
            try:
                wait_for("the pools to drain", lambda: all(n["sandboxes"] == 0 for n in nodes(on_a).values()), 60)
            except AssertionError as e:
                problems.append(str(e))
    assert not problems, problems


def test_a_node_cut_off_while_running_ends_what_it_lost_when_it_hears_of_it(fleet_of):
    """A node stopped (SIGSTOP) for longer than the limit is declared lost
    while its sandboxes run on; continued, its next heartbeat hears it is
    lost: it ends them on its host, then is active again."""
    a, c = fleet_of([A, C], env=ENV)
    key = a.admin_key()
    on_a, on_c = Client(a.base, key), Client(c.base, key)
    made: dict[str, tuple[Client, str]] = {}
    stopped = False
    try:
        sb = on_c.create(node=C)
        made[sb["id"]] = (on_c, C)
        assert host_processes_of([sb["id"]])
        os.kill(c.proc.pid, signal.SIGSTOP)
        stopped = True
        wait_for(
            f"{sb['id']} to be lost",
            lambda: state_of(on_a, sb["id"])["state"] == "lost",
            timeout=LOST_AFTER * 6,
        )
        # Cut off, the node could not end it: it still runs on the host.
        assert host_processes_of([sb["id"]])
        os.kill(c.proc.pid, signal.SIGCONT)
        stopped = False
        wait_cleaned(c, sb["id"], timeout=30)
        wait_for(f"{C} to be active again", lambda: nodes(on_a)[C]["state"] == "active", timeout=30)
        assert state_of(on_c, sb["id"])["state"] == "lost"
        again = on_c.create(node=C)
        made[again["id"]] = (on_c, C)
        assert on_c.exec(again["id"], "echo again")["stdout"] == "again\n"
    finally:
        if stopped:
            os.kill(c.proc.pid, signal.SIGCONT)
        problems = cleanup(made)
    assert not problems, problems
