"""The `process` isolation class over the API: a template with
`"class": "process"` makes sandboxes that are tenants of one shared host
container (a uid, a home, a cgroup and a Landlock domain each). Commands,
files, env and delete work as for containers; two sandboxes cannot read,
write, see or signal each other; each is held to its own limits; what the
class cannot do is refused with `class_unsupported`."""

from __future__ import annotations

import base64
import contextlib

import requests
from conftest import Client, expect_error, expect_status, wait_for


@contextlib.contextmanager
def process_template(api: Client, name: str, **extra):
    body = {"name": name, "class": "process", "memory_mb": 128, "limits": {"pids": 32}, **extra}
    r = api.post("/v1/templates", body)
    expect_status(r, 201)
    t = r.json()
    try:
        yield t
    finally:
        expect_status(api.delete(f"/v1/templates/{t['id']}"), (204, 404))


@contextlib.contextmanager
def sandboxes(api: Client, template: str, n: int, **body):
    made: list[dict] = []
    try:
        for _ in range(n):
            made.append(api.create(template=template, **body))
        yield made
    finally:
        for sb in made:
            expect_status(api.delete(f"/v1/sandboxes/{sb['id']}"), (200, 404))


def write(api: Client, sid: str, path: str, data: bytes):
    return api.post(f"/v1/sandboxes/{sid}/files/write", {"path": path, "data": base64.b64encode(data).decode()})


def read(api: Client, sid: str, path: str):
    return api.post(f"/v1/sandboxes/{sid}/files/read", {"path": path})


def test_create_exec_files_env_delete(api: Client):
    with process_template(api, "proc-basic", env={"FROM_TEMPLATE": "t"}) as t:
        with sandboxes(api, t["name"], 1, env={"FROM_REQUEST": "r"}) as [sb]:
            sid = sb["id"]
            assert api.sandbox(sid)["class"] == "process"
            out = api.sh(sid, "id -u; pwd; echo $HOME $FROM_TEMPLATE $FROM_REQUEST")
            uid, cwd, env = out.splitlines()
            assert int(uid) >= 10000, out
            assert cwd == f"/home/{sid}", out
            assert env == f"/home/{sid} t r", out
            expect_status(write(api, sid, "notes.txt", b"hello"), (200, 204))
            assert api.sh(sid, "cat ~/notes.txt") == "hello"
            r = read(api, sid, f"/home/{sid}/notes.txt")
            expect_status(r, 200)
            # Exit codes, stderr and a background command, as for containers.
            res = api.exec(sid, "echo err >&2; exit 3")
            assert res["exit_code"] == 3 and res["stderr"] == "err\n", res
            pid = api.background(sid, "sleep 60")
            assert pid in [p["pid"] for p in api.processes(sid)]
        # Deleted: its home is gone from the host container.
        with sandboxes(api, t["name"], 1) as [other]:
            out = api.exec(other["id"], f"test -e /home/{sid} && echo left || echo gone")
            assert out["stdout"] == "gone\n", out


def test_two_sandboxes_cannot_reach_each_other(api: Client):
    with process_template(api, "proc-pair") as t, sandboxes(api, t["name"], 2) as [a, b]:
        ida, idb = a["id"], b["id"]
        api.sh(ida, "echo secret > ~/s; echo t > $TMPDIR/t")
        pid = api.background(ida, "sleep 300")
        # Neither its home nor its /tmp, through commands or the files API.
        for cmd in (f"cat /home/{ida}/s", f"ls /home/{ida}", f"touch /home/{ida}/x", f"cat /tmp/{ida}/t",
                    "touch /tmp/x", "touch /dev/shm/x", "touch /etc/x"):
            res = api.exec(idb, cmd)
            assert res["exit_code"] != 0, (cmd, res)
        r = read(api, idb, f"/home/{ida}/s")
        assert r.status_code >= 400, r.text
        r = write(api, idb, f"/home/{ida}/planted", b"x")
        assert r.status_code >= 400, r.text
        # Not its processes: invisible in /proc, kill answers EPERM, not listed.
        out = api.exec(idb, f"test -e /proc/{pid} && echo visible; kill -9 {pid}; echo rc=$?")
        assert "visible" not in out["stdout"] and "rc=1" in out["stdout"], out
        assert pid not in [p["pid"] for p in api.processes(idb)]
        expect_status(api.post(f"/v1/sandboxes/{idb}/processes/{pid}/signal", {"signal": "SIGKILL"}), 404)
        assert pid in [p["pid"] for p in api.processes(ida)]


def test_each_is_held_to_its_own_limits(api: Client):
    with process_template(api, "proc-limits") as t, sandboxes(api, t["name"], 2) as [a, b]:
        # A fork bomb meets its own pids limit (32): the other runs on.
        out = api.exec(a["id"], "for i in $(seq 64); do sleep 5 & done 2>&1; echo done", timeout_seconds=30)
        assert "Resource temporarily unavailable" in out["stdout"], out
        assert api.sh(b["id"], "for i in $(seq 16); do true & done; wait; echo ok") == "ok\n"
        # Memory past its limit (128 MiB) is an OOM kill of its own.
        res = api.exec(a["id"], "head -c 300m /dev/zero | tail > /dev/null", timeout_seconds=30)
        assert res["exit_code"] != 0, res
        assert api.sh(b["id"], "echo fine") == "fine\n"


def test_what_the_class_cannot_do_is_refused(api: Client):
    with process_template(api, "proc-refuse") as t:
        with sandboxes(api, t["name"], 1) as [sb]:
            sid = sb["id"]
            expect_error(api.exec_raw(sid, {"command": "id -u", "user": "root"}), 409, "class_unsupported")
            r = api.post(f"/v1/sandboxes/{sid}/snapshots", {"name": "s"})
            assert r.status_code == 409, r.text
        r = api.post("/v1/sandboxes", {"template": t["name"], "network": {"egress": "deny_all"}})
        expect_error(r, 409, "class_unsupported")
        r = api.post("/v1/sandboxes", {"template": t["name"], "volumes": [{"name": "v", "path": "/data"}]})
        assert r.status_code in (404, 409), r.text


def server_timing(r) -> dict[str, float]:
    out = {}
    for part in r.headers["Server-Timing"].split(","):
        name, _, dur = part.strip().partition(";dur=")
        out[name] = float(dur)
    return out


def test_create_and_exec_say_where_their_time_went(api: Client):
    with process_template(api, "proc-timing") as t:
        r = api.post("/v1/sandboxes", {"template": t["name"]})
        expect_status(r, 201)
        sid = r.json()["id"]
        try:
            created = server_timing(r)
            # Phases in the order they ran, then the total, which holds them.
            assert list(created) == ["auth", "template", "admit", "image", "host", "tenant", "start", "ready",
                                     "total"], created
            assert all(v >= 0 for v in created.values()), created
            assert created["host"] + created["tenant"] <= created["start"] + 0.01, created
            top = sum(created[p] for p in ("auth", "template", "admit", "image", "start", "ready"))
            assert top <= created["total"] + 0.01, created
            x = api.post(f"/v1/sandboxes/{sid}/exec", {"argv": ["true"]})
            expect_status(x, 200)
            ran = server_timing(x)
            assert list(ran) == ["auth", "lookup", "run", "total"], ran
            assert ran["auth"] + ran["lookup"] + ran["run"] <= ran["total"] + 0.01, ran
            # Every answer has one, errors too; nothing of the request in it.
            nf = api.get("/v1/sandboxes/sb-nothere")
            assert list(server_timing(nf)) == ["auth", "total"], nf.headers
            # A refused key's answer too.
            anon = requests.get(api.base + "/v1/sandboxes", timeout=10)
            assert anon.status_code == 401 and list(server_timing(anon)) == ["auth", "total"], anon.headers
            d = api.delete(f"/v1/sandboxes/{sid}")
            expect_status(d, 200)
            ended = server_timing(d)
            assert list(ended) == ["auth", "terminate", "processes", "layer", "network", "finish", "total"], ended
            assert sum(v for k, v in ended.items() if k != "total") <= ended["total"] + 0.01, ended
        finally:
            expect_status(api.delete(f"/v1/sandboxes/{sid}"), (200, 404))


def test_a_warm_pool_serves_process_sandboxes(api: Client):
    # A process template's pool is made with the class's storage (its
    # memory layer), so a create claims from it instead of making a tenant.
    with process_template(api, "proc-warm", warm={"min": 2, "max": 2}) as t:
        tid = t["id"]
        wait_for("the pool", lambda: api.get(f"/v1/templates/{tid}").json()["warm_ready"] >= 2, timeout=30)
        r = api.post("/v1/sandboxes", {"template": t["name"]})
        expect_status(r, 201)
        a = r.json()
        with contextlib.ExitStack() as held:
            held.callback(lambda: api.delete(f"/v1/sandboxes/{a['id']}"))
            assert a["warm"] is True, a
            assert a["storage"] == "memory", a
            # Claimed, not made: no tenant was set up on the request's path.
            assert list(server_timing(r)) == ["auth", "template", "checks", "claim", "total"], r.headers
            b = api.create(template=t["name"])
            held.callback(lambda: api.delete(f"/v1/sandboxes/{b['id']}"))
            assert b["warm"] is True, b
            # Each claimed sandbox is a tenant of its own.
            ua, ha = api.sh(a["id"], "id -u; echo $HOME").splitlines()
            ub, hb = api.sh(b["id"], "id -u; echo $HOME").splitlines()
            assert ua != ub and int(ua) >= 10000 and int(ub) >= 10000, (ua, ub)
            assert (ha, hb) == (f"/home/{a['id']}", f"/home/{b['id']}")
            r = api.exec(b["id"], f"ls /home/{a['id']}")
            assert r["exit_code"] != 0, r
            # The pool refills behind the claims.
            wait_for("the refill", lambda: api.get(f"/v1/templates/{tid}").json()["warm_ready"] >= 2, timeout=30)
