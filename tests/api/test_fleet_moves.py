"""Moves through the fleet's OCI registry (Debian's docker-registry here, on
loopback): two nodes with `--registry`; a sandbox of node B writes files and
is paused to disk (pushed as it pauses), B is killed (-9), and a resume
sent to node A takes it (once B's heartbeats stop), pulls its image and
files, and runs it on A with the same id and its files; a snapshot made on
B starts a sandbox on A; a paused sandbox on `base` (the host's own files)
and a snapshot of it are refused with `not_movable`.

The image exists only on B (imported there): A makes it from the pull.

Then B comes back: a template build made on A is pushed as it succeeds and
B pulls it for a sandbox placed there; B drains, gives that sandbox (paused
to disk) to A, and says it is drained once its unmovable paused sandbox (on
`base`) is deleted.

And a sandbox paused to disk while its node had no registry (so never
pushed) is pushed by its node's drain once the node has one, handed to the
other node, and resumes there with its files."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import requests


from conftest import Client, Daemon, expect_error, expect_status, wait_for
from test_builds import build
# `registry` (test_images's fixture): asked before the fleet, so stopped after it.
from test_images import api_import, docker_save, registry, two_layers, uname  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from oci_images import Layer, Registry  # noqa: E402

NODE_A, NODE_B = "move-a", "move-b"


def delete_everywhere(key: str, nodes: dict[str, Daemon]) -> list[str]:
    """Deletes every sandbox through the node it is on (a dead node is
    started again for that) and every snapshot; what failed."""
    problems = []
    first = next(iter(nodes.values()))
    listed = Client(first.base, key).get("/v1/sandboxes", params={"limit": 1000})
    if listed.status_code != 200:
        return [f"list: {listed.status_code} {listed.text}"]
    for sb in listed.json()["sandboxes"]:
        if sb["state"] == "terminated":
            continue
        d = nodes[sb["node"]]
        if not d.alive():
            d.kill_strays()
            d.start()
        r = Client(d.base, key).delete(f"/v1/sandboxes/{sb['id']}")
        if r.status_code != 200:
            problems.append(f"delete {sb['id']} on {sb['node']}: {r.status_code} {r.text}")
    c = Client(first.base, key)
    for snap in c.get("/v1/snapshots").json().get("snapshots", []):
        r = c.delete(f"/v1/snapshots/{snap['id']}")
        if r.status_code not in (200, 204, 404):
            problems.append(f"delete snapshot {snap['id']}: {r.status_code} {r.text}")
    return problems


def resume_through(c: Client, sid: str) -> dict | None:
    """The resumed sandbox, or None while its node is not yet taken for gone."""
    r = c.post(f"/v1/sandboxes/{sid}/resume", {}, timeout=120)
    # Refused as another node's, or sent on to that node, which does not answer.
    if (r.status_code, r.json().get("code")) in ((409, "sandbox_on_other_node"), (502, "node_unreachable")):
        return None
    expect_status(r, 200)
    return r.json()


def test_a_paused_sandbox_and_a_snapshot_of_a_killed_node_start_on_another(registry: Registry, fleet_of):  # noqa: F811
    url = f"http://127.0.0.1:{registry.port}/hutch-fleet"
    a, b = fleet_of([NODE_A, NODE_B], env={"HUTCH_REGISTRY": url})
    key = a.admin_key()
    on_a, on_b = Client(a.base, key), Client(b.base, key)
    try:
        # An image on B only; a sandbox of it on B writes, deletes and adds.
        image = uname("moving")
        lower, upper = two_layers(uuid.uuid4().hex)
        # Tools that need the C library only.
        tools = Layer()
        for tool in ("rm", "head", "sha256sum"):
            tools = tools.file(f"usr/bin/{tool}", Path(f"/usr/bin/{tool}").read_bytes(), 0o755)
        archive = docker_save([lower, tools.bytes(), upper], ["MOVED=yes"], "x/m:1")
        expect_status(api_import(on_b, archive, name=image), 201)
        r = on_b.post("/v1/templates", {"name": uname("tpl"), "image": image})
        expect_status(r, 201)
        r_tpl = r.json()
        sb = on_b.create(template=r_tpl["name"], wait_seconds=60, node=NODE_B)
        sid = sb["id"]
        assert sb["node"] == NODE_B, sb
        digest = on_b.sh(sid, "echo moved > /workspace/note && "
                              "head -c 3000000 /dev/urandom > /workspace/blob && sha256sum /workspace/blob")
        # A deletion of a lower file: a whiteout in the top layer.
        on_b.sh(sid, "rm /data/kept", user="root")
        # A snapshot of it (pushed as it is made), then it pauses to disk (pushed too).
        r = on_b.post(f"/v1/sandboxes/{sid}/snapshots", {"name": "before-move"})
        expect_status(r, 201)
        snap = r.json()
        r = on_b.post(f"/v1/sandboxes/{sid}/suspend", {"mode": "disk"})
        expect_status(r, 200)
        assert r.json()["state"] == "paused", r.json()
        # A sandbox on `base`, paused to disk too: its files are B's host's own.
        on_base = on_b.create(node=NODE_B)["id"]
        r = on_b.post(f"/v1/sandboxes/{on_base}/snapshots", {})
        expect_status(r, 201)
        base_snap = r.json()["id"]
        expect_status(on_b.post(f"/v1/sandboxes/{on_base}/suspend", {"mode": "disk"}), 200)

        b.kill9()
        b.kill_strays()

        # Through A, once B is taken for gone: the same sandbox, on A, its files intact.
        moved = wait_for("node A to take the paused sandbox", lambda: resume_through(on_a, sid),
                         timeout=60, interval=0.5)
        assert moved["id"] == sid and moved["node"] == NODE_A and moved["state"] == "running", moved
        assert on_a.sandbox(sid)["node"] == NODE_A
        assert on_a.sh(sid, "cat /workspace/note; echo $MOVED") == "moved\nyes\n"
        assert on_a.sh(sid, "sha256sum /workspace/blob") == digest
        assert on_a.sh(sid, "test -e /data/kept && echo there || echo gone; cat /opq/new") == "gone\nnew\n"
        # It keeps working here: a pause and a resume on A.
        expect_status(on_a.post(f"/v1/sandboxes/{sid}/suspend", {"mode": "disk"}), 200)
        assert resume_through(on_a, sid)["node"] == NODE_A
        assert on_a.sh(sid, "cat /workspace/note") == "moved\n"

        # The snapshot made on B starts a sandbox on A.
        child = on_a.create(snapshot=snap["id"], wait_seconds=60)
        assert child["node"] == NODE_A, child
        assert on_a.sh(child["id"], "cat /workspace/note; sha256sum /workspace/blob") == "moved\n" + digest

        # The sandbox on `base` cannot move: said so, and it stays B's.
        e = expect_error(on_a.post(f"/v1/sandboxes/{on_base}/resume", {}), 409, "not_movable")
        assert "base" in e["error"], e
        assert on_a.sandbox(on_base)["node"] == NODE_B
        e = expect_error(on_a.post("/v1/sandboxes", {"snapshot": base_snap}), 409, "not_movable")
        assert base_snap in e["error"] and "base" in e["error"], e

        # B comes back. A template build made on A is pushed as it succeeds,
        # and B, which lacks its image, pulls it for a sandbox placed there.
        b.start()
        done, log = build(on_a, r_tpl["id"], {"Dockerfile": "COPY built.txt /workspace/built.txt\n",
                                         "built.txt": "built on A\n"})
        assert done["state"] == "succeeded", (done, log)
        assert "Pushed to the fleet's registry as 127.0.0.1:" in log, log
        def create_on_b() -> dict | None:
            # None until A's view of the fleet has B active again.
            r = on_a.post("/v1/sandboxes", {"template": r_tpl["name"], "wait_seconds": 60, "node": NODE_B,
                                            "ttl_seconds": 900})
            if r.status_code == 400 and "not an active node" in r.text:
                return None
            expect_status(r, 201)
            return r.json()

        built = wait_for("a create placed on B", create_on_b, timeout=30, interval=0.2)
        assert built["node"] == NODE_B and built["state"] == "running", built
        assert on_b.sh(built["id"], "cat /workspace/built.txt; echo $MOVED") == "built on A\nyes\n"

        # B drains: its paused sandbox that can move goes to A (pushed as it
        # paused); the one on `base` stays, and B is not drained while it does.
        on_b.sh(built["id"], "echo before-drain > /workspace/drain")
        expect_status(on_b.post(f"/v1/sandboxes/{built['id']}/suspend", {"mode": "disk"}), 200)
        r = on_a.post(f"/v1/nodes/{NODE_B}/drain", {})
        expect_status(r, 200)
        wait_for("node B to give its paused sandbox to A",
                 lambda: on_a.sandbox(built["id"])["node"] == NODE_A, timeout=30, interval=0.2)
        assert on_a.sandbox(built["id"])["state"] == "paused"
        listed = {n["name"]: n for n in on_a.get("/v1/nodes").json()["nodes"]}
        assert (listed[NODE_B]["sandboxes"], listed[NODE_B]["drained"]) == (1, False), listed[NODE_B]
        assert on_a.sandbox(on_base)["node"] == NODE_B
        expect_status(on_b.delete(f"/v1/sandboxes/{on_base}"), 200)
        listed = {n["name"]: n for n in on_a.get("/v1/nodes").json()["nodes"]}
        assert (listed[NODE_B]["sandboxes"], listed[NODE_B]["drained"]) == (0, True), listed[NODE_B]
        # Resumed through B (which answers for what is A's now): on A, its files pulled.
        resumed = resume_through(on_b, built["id"])
        assert resumed["node"] == NODE_A and resumed["state"] == "running", resumed
        assert on_a.sh(built["id"], "cat /workspace/drain /workspace/built.txt") == "before-drain\nbuilt on A\n"
    finally:
        problems = delete_everywhere(key, {NODE_A: a, NODE_B: b})
        assert not problems, problems


def catalog(registry: Registry) -> list[str]:
    r = requests.get(f"{registry.base}/v2/_catalog", params={"n": 1000}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["repositories"]


def test_a_paused_sandbox_never_pushed_is_pushed_at_drain_and_resumes_on_the_other_node(
    registry: Registry, fleet_of  # noqa: F811
):
    url = f"http://127.0.0.1:{registry.port}/hutch-drain"
    # A has the registry from the start; B has none when its sandbox pauses.
    (a,) = fleet_of(["drain-a"], env={"HUTCH_REGISTRY": url})
    (b,) = fleet_of(["drain-b"])
    key = a.admin_key()
    on_a, on_b = Client(a.base, key), Client(b.base, key)
    try:
        # An image on B only, a sandbox of it on B that writes, paused to disk.
        image = uname("unpushed")
        lower, upper = two_layers(uuid.uuid4().hex)
        expect_status(api_import(on_b, docker_save([lower, upper], ["UNPUSHED=yes"], "x/u:1"), name=image), 201)
        r = on_b.post("/v1/templates", {"name": uname("tpl"), "image": image})
        expect_status(r, 201)
        sid = on_b.create(template=r.json()["name"], wait_seconds=60, node="drain-b", ttl_seconds=900)["id"]
        on_b.sh(sid, "echo kept > /workspace/note")
        r = on_b.post(f"/v1/sandboxes/{sid}/suspend", {"mode": "disk"})
        expect_status(r, 200)
        assert r.json()["state"] == "paused", r.json()

        pushed_as = f"hutch-drain/sandbox-{sid}"
        assert pushed_as not in catalog(registry), "paused without a registry: never pushed"

        # B starts again with the registry, and is drained: its pass pushes
        # the sandbox (never pushed) and hands it to A.
        b.stop()
        b.extra_env["HUTCH_REGISTRY"] = url
        b.start()
        expect_status(on_a.post("/v1/nodes/drain-b/drain", {}), 200)
        wait_for("node B to push its paused sandbox and give it to A",
                 lambda: on_a.sandbox(sid)["node"] == "drain-a", timeout=60, interval=0.2)
        assert on_a.sandbox(sid)["state"] == "paused"
        assert pushed_as in catalog(registry)
        listed = {n["name"]: n for n in on_a.get("/v1/nodes").json()["nodes"]}
        assert (listed["drain-b"]["sandboxes"], listed["drain-b"]["drained"]) == (0, True), listed["drain-b"]
        # Resumed through B (draining, it answers for A's): on A, with its
        # files pulled from the registry.
        resumed = resume_through(on_b, sid)
        assert resumed["node"] == "drain-a" and resumed["state"] == "running", resumed
        assert on_a.sh(sid, "cat /workspace/note; echo $UNPUSHED") == "kept\nyes\n"
    finally:
        problems = delete_everywhere(key, {"drain-a": a, "drain-b": b})
        assert not problems, problems
