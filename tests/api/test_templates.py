"""Templates and warm pools: CRUD per owner, version rules, a template's
limits, env and lifetimes applied to its sandboxes, and warm pools that
fill, are claimed (oldest first, lifetime from the claim), refill, never
hand out an old version, drain on delete and survive a restart."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import time
import uuid
from datetime import datetime

from conftest import Client, Daemon, cgroup_dirs, expect_error, expect_status, wait_cleaned, wait_for


def parse_time(s: str) -> float:
    """RFC 3339 (UTC) to Unix seconds."""
    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def tname(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def make_template(c: Client, expect: int = 201, **body) -> dict:
    body.setdefault("name", tname())
    r = c.post("/v1/templates", body)
    expect_status(r, expect)
    return r.json()


def template(c: Client, tid: str) -> dict:
    r = c.get(f"/v1/templates/{tid}")
    expect_status(r, 200)
    return r.json()


def patch(c: Client, tid: str, body: dict) -> dict:
    r = c.request("PATCH", f"/v1/templates/{tid}", json=body)
    expect_status(r, 200)
    return r.json()


def delete_template(c: Client, tid: str) -> None:
    expect_status(c.delete(f"/v1/templates/{tid}"), 204)


def wait_ready(c: Client, tid: str, n: int, timeout: float = 30) -> dict:
    return wait_for(
        f"template {tid} to have {n} warm sandboxes ready",
        lambda: (lambda t: t if t["warm_ready"] == n else None)(template(c, tid)),
        timeout=timeout,
        interval=0.1,
    )


def pooled_ids(d: Daemon, tid: str) -> list[str]:
    """Unclaimed warm sandboxes of a template, not terminated, from the daemon's database."""
    with sqlite3.connect(f"file:{d.state_dir / 'hutch.db'}?mode=ro", uri=True, timeout=10) as db:
        rows = db.execute(
            "SELECT id FROM sandboxes WHERE pooled = 1 AND template_id = ? AND state != 'terminated' "
            "ORDER BY created_at, id",
            (tid,),
        )
        return [r[0] for r in rows]


def metric(c: Client, line_prefix: str) -> float | None:
    r = c.get("/metrics")
    expect_status(r, 200)
    for line in r.text.splitlines():
        if line.startswith(line_prefix + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def created_ms(d: Daemon, sid: str) -> int:
    """A sandbox's `created_at` as the daemon's database holds it (Unix ms)."""
    with sqlite3.connect(f"file:{d.state_dir / 'hutch.db'}?mode=ro", uri=True, timeout=10) as db:
        (ms,) = db.execute("SELECT created_at FROM sandboxes WHERE id = ?", (sid,)).fetchone()
        return ms


def wait_reconciler_ticks(c: Client, n: int) -> None:
    """Waits until the reconciler has completed `n` more passes (pools tended
    included) than it had when called."""
    start = metric(c, "hutch_reconciler_ticks_total")
    assert start is not None, "no hutch_reconciler_ticks_total in /metrics"
    wait_for(f"{n} reconciler passes", lambda: metric(c, "hutch_reconciler_ticks_total") >= start + n, timeout=30)


# --------------------------------------------------------------------------
# CRUD


def test_template_crud_and_version_rules(api: Client):
    name = tname("crud")
    t = make_template(
        api, name=name, memory_mb=256, limits={"vcpus": 0.5, "pids": 64},
        env={"A": "1"}, default_ttl_seconds=120, max_ttl_seconds=600,
    )
    assert re.fullmatch(r"tpl-[0-9a-f]{16}", t["id"]), t
    assert (t["name"], t["version"], t["image"], t["class"]) == (name, 1, "base", "container")
    assert t["memory_mb"] == 256 and t["limits"] == {"vcpus": 0.5, "disk_mib": 1024, "pids": 64}
    assert t["env"] == {"A": "1"}
    assert (t["default_ttl_seconds"], t["max_ttl_seconds"]) == (120, 600)
    assert t["warm"] == {"min": 0, "max": 0} and t["warm_ready"] == 0
    tid = t["id"]

    listed = api.get("/v1/templates").json()["templates"]
    assert [x for x in listed if x["id"] == tid] == [template(api, tid)]

    # Lifetimes and the pool do not change what runs: same version.
    t = patch(api, tid, {"default_ttl_seconds": 60, "max_ttl_seconds": 300, "warm": {"min": 0, "max": 2}})
    assert t["version"] == 1 and t["default_ttl_seconds"] == 60 and t["warm"]["max"] == 2
    # Env, memory, limits and image do; setting the same value does not.
    assert patch(api, tid, {"env": {"A": "2"}})["version"] == 2
    assert patch(api, tid, {"env": {"A": "2"}})["version"] == 2
    assert patch(api, tid, {"memory_mb": 512})["version"] == 3
    assert patch(api, tid, {"limits": {"pids": 128}})["version"] == 4
    assert patch(api, tid, {"image": "base"})["version"] == 4
    t = template(api, tid)
    assert (t["memory_mb"], t["limits"]["pids"], t["env"]) == (512, 128, {"A": "2"})

    delete_template(api, tid)
    expect_error(api.get(f"/v1/templates/{tid}"), 404, "not_found")
    expect_error(api.request("PATCH", f"/v1/templates/{tid}", json={"memory_mb": 128}), 404, "not_found")
    expect_error(api.delete(f"/v1/templates/{tid}"), 404, "not_found")
    assert tid not in [x["id"] for x in api.get("/v1/templates").json()["templates"]]
    expect_error(api.post("/v1/sandboxes", {"template": name}), 400, "unknown_template")
    expect_error(api.get("/v1/templates/tpl-..%2f..%2fetc"), 404, "not_found")


def test_template_names_are_unique_per_owner(daemon: Daemon, api: Client):
    name = tname("uniq")
    first = make_template(api, name=name)
    expect_error(api.post("/v1/templates", {"name": name}), 409, "template_name_taken")
    # Another key has its own namespace and cannot see ours.
    other = daemon.new_client("templates-other")
    theirs = make_template(other, name=name)
    assert theirs["id"] != first["id"]
    expect_error(other.get(f"/v1/templates/{first['id']}"), 404, "not_found")
    expect_error(other.delete(f"/v1/templates/{first['id']}"), 404, "not_found")
    assert [t["id"] for t in other.get("/v1/templates").json()["templates"]] == [theirs["id"]]
    # A deleted template frees its name.
    delete_template(api, first["id"])
    again = make_template(api, name=name)
    assert again["id"] != first["id"] and again["version"] == 1
    delete_template(api, again["id"])
    delete_template(other, theirs["id"])


def test_template_requests_are_validated(api: Client):
    r = expect_error(api.post("/v1/templates", {"name": tname(), "image": "no-such-image"}), 400, "image_not_found")
    assert "no-such-image" in r["error"]
    expect_error(api.post("/v1/templates", {"name": tname(), "class": "microvm"}), 400, "invalid_request")
    r = expect_error(api.post("/v1/templates", {"name": tname(), "class": "vm"}), 400, "invalid_request")
    assert "container" in r["error"], r
    expect_error(api.post("/v1/templates", {"name": "base"}), 400, "invalid_request")
    expect_error(api.post("/v1/templates", {"name": "Bad/Name"}), 400, "invalid_request")
    expect_error(api.post("/v1/templates", {"name": tname(), "warm": {"min": 3, "max": 2}}), 400, "invalid_request")
    expect_error(api.post("/v1/templates", {"name": tname(), "warm": {"min": 1, "max": 99}}), 400, "invalid_request")
    expect_error(
        api.post("/v1/templates", {"name": tname(), "default_ttl_seconds": 700, "max_ttl_seconds": 600}),
        400, "invalid_request",
    )
    expect_error(api.post("/v1/templates", {"name": tname(), "memory_mb": 1}), 400, "invalid_request")
    expect_error(api.post("/v1/templates", {"name": tname(), "bogus": 1}), 400, "invalid_request")
    t = make_template(api)
    expect_error(api.request("PATCH", f"/v1/templates/{t['id']}", json={"image": "nope"}), 400, "image_not_found")
    expect_error(api.request("PATCH", f"/v1/templates/{t['id']}", json={"name": "x"}), 400, "invalid_request")
    delete_template(api, t["id"])


def test_unknown_template_is_refused_before_anything_is_reserved(api: Client):
    before = {s["id"] for s in api.list_all()}
    expect_error(api.post("/v1/sandboxes", {"template": "no-such-template"}), 400, "unknown_template")
    expect_error(api.post("/v1/executions", {"template": "no-such-template", "command": "true"}), 400,
                 "unknown_template")
    assert {s["id"] for s in api.list_all()} == before


def test_template_limits_env_and_lifetimes_apply_to_its_sandboxes(api: Client):
    t = make_template(
        api, memory_mb=256, limits={"pids": 64}, env={"GREETING": "hi", "SHARED": "tpl"},
        default_ttl_seconds=120, max_ttl_seconds=300,
    )
    sb = api.create(template=t["name"], ttl_seconds=None)
    assert sb["template"] == t["name"] and sb["template_id"] == t["id"] and sb["template_version"] == 1
    assert sb["memory_mb"] == 256 and sb["limits"]["pids"] == 64 and sb["warm"] is False
    life = parse_time(sb["expires_at"]) - parse_time(sb["created_at"])
    assert abs(life - 120) < 2, sb
    # The workload's limit is on its own cgroup, `work` (see test_sandboxes).
    mem = [p / "work" / f for p in cgroup_dirs(sb["id"]) for f in ("memory.max", "memory.limit_in_bytes")
           if (p / "work" / f).exists()]
    assert mem, f"no memory limit file for {sb['id']}: {cgroup_dirs(sb['id'])}"
    assert int(mem[0].read_text()) == 256 << 20
    assert api.sh(sb["id"], "echo $GREETING") == "hi\n"
    # The request overrides field by field; env adds to the template's.
    sb2 = api.create(template=t["name"], memory_mb=512, env={"SHARED": "req"}, ttl_seconds=300)
    assert sb2["memory_mb"] == 512 and sb2["limits"]["pids"] == 64
    assert api.sh(sb2["id"], "echo $GREETING $SHARED") == "hi req\n"
    # The template's maximum lifetime caps creates.
    expect_error(api.post("/v1/sandboxes", {"template": t["name"], "ttl_seconds": 301}), 400, "invalid_request")
    # One-shot executions run templates too.
    r = api.post("/v1/executions", {"template": t["name"], "command": "echo $GREETING"})
    expect_status(r, 200)
    assert r.json()["stdout"] == "hi\n"
    # Deleting the template leaves its sandboxes running.
    delete_template(api, t["id"])
    assert api.sh(sb["id"], "echo still") == "still\n"
    api.destroy(sb["id"])
    api.destroy(sb2["id"])


# --------------------------------------------------------------------------
# Warm pools


def test_warm_pool_fills_is_claimed_fast_and_refills(daemon: Daemon, api: Client):
    t = make_template(api, env={"POOL": "yes"}, warm={"min": 2, "max": 3})
    tid, name = t["id"], t["name"]
    wait_ready(api, tid, 2)
    wait_for("the pool size metric", lambda: metric(api, f'hutch_warm_pool_size{{template="{name}",template_id="{tid}"}}') == 2,
             timeout=5)
    pool = pooled_ids(daemon, tid)
    assert len(pool) == 2, pool
    # Unclaimed warm sandboxes are nobody's yet: not listed, not readable.
    listed = {s["id"] for s in api.list_all()}
    assert not listed & set(pool)
    expect_error(api.get(f"/v1/sandboxes/{pool[0]}"), 404, "not_found")
    expect_error(api.exec_raw(pool[0], {"command": "true"}), 404, "not_found")

    claims = metric(api, "hutch_warm_claims_total")
    # The claimed sandbox's lifetime starts at the claim, not at its boot:
    # its `created_at` is the claim's time. (How fast a claim is, is
    # bench/warm_bench.py's figure.)
    # Times in Unix ms, the daemon's resolution (same host, same clock).
    booted = created_ms(daemon, pool[0])
    before = int(time.time() * 1000)
    assert booted < before, (booted, before)
    sb = api.create(template=name, ttl_seconds=60, metadata={"who": "claim"})
    after = int(time.time() * 1000) + 1
    assert sb["warm"] is True and sb["id"] == pool[0], (sb, pool)  # the oldest
    assert sb["metadata"] == {"who": "claim"} and sb["template_version"] == 1
    assert before <= round(parse_time(sb["created_at"]) * 1000) <= after, (before, sb, after)
    assert abs(parse_time(sb["expires_at"]) - parse_time(sb["created_at"]) - 60) < 0.01, sb
    assert api.sh(sb["id"], "echo $POOL") == "yes\n"
    assert sb["id"] in {s["id"] for s in api.list_all()}
    assert metric(api, "hutch_warm_claims_total") == claims + 1

    # The pool refills in the background.
    wait_ready(api, tid, 2)
    assert sb["id"] not in pooled_ids(daemon, tid)
    # A create that changes what runs starts cold and leaves the pool alone.
    cold = api.create(template=name, env={"X": "1"})
    assert cold["warm"] is False
    assert len(pooled_ids(daemon, tid)) == 2
    refills = metric(api, "hutch_warm_refill_seconds_count")
    assert refills is not None and refills >= 3
    delete_template(api, tid)
    for s in (sb, cold):
        api.destroy(s["id"])


def test_empty_pool_is_a_miss_and_starts_cold(api: Client):
    t = make_template(api, warm={"min": 1, "max": 1})
    wait_ready(api, t["id"], 1)
    misses = metric(api, "hutch_warm_misses_total")
    a = api.create(template=t["name"])
    b = api.create(template=t["name"])  # before the refill: the pool is empty
    assert a["warm"] is True
    if b["warm"] is False:
        assert metric(api, "hutch_warm_misses_total") == misses + 1
    delete_template(api, t["id"])
    api.destroy(a["id"])
    api.destroy(b["id"])


def test_update_never_lets_an_old_version_be_claimed(daemon: Daemon, api: Client):
    t = make_template(api, env={"V": "1"}, warm={"min": 3, "max": 3})
    tid = t["id"]
    wait_ready(api, tid, 3)
    old = set(pooled_ids(daemon, tid))
    assert patch(api, tid, {"env": {"V": "2"}})["version"] == 2
    # Claims right after the change: cold or of the new version, never the old.
    got = []
    for _ in range(4):
        sb = api.create(template=t["name"])
        got.append(sb)
        assert sb["id"] not in old, sb
        assert sb["template_version"] == 2, sb
        assert api.sh(sb["id"], "echo $V") == "2\n"
    # The old version's warm sandboxes are drained, the pool refilled with v2.
    for sid in old:
        wait_cleaned(daemon, sid, timeout=15)
    wait_ready(api, tid, 3)
    assert not set(pooled_ids(daemon, tid)) & old
    sb = api.create(template=t["name"])
    assert sb["warm"] is True and sb["template_version"] == 2
    assert api.sh(sb["id"], "echo $V") == "2\n"
    got.append(sb)
    # A change to the pool only keeps the version and drains the excess.
    assert patch(api, tid, {"warm": {"min": 1, "max": 1}})["version"] == 2
    wait_for("the pool to shrink to 1", lambda: len(pooled_ids(daemon, tid)) == 1, timeout=15)
    delete_template(api, tid)
    for s in got:
        api.destroy(s["id"])


def test_delete_drains_the_pool_and_keeps_claimed_sandboxes(daemon: Daemon, api: Client):
    t = make_template(api, warm={"min": 3, "max": 4})
    tid = t["id"]
    wait_ready(api, tid, 3)
    claimed = api.create(template=t["name"])
    assert claimed["warm"] is True
    pool = pooled_ids(daemon, tid)
    assert pool and claimed["id"] not in pool
    delete_template(api, tid)
    for sid in pool:
        wait_cleaned(daemon, sid, timeout=10)
        assert not cgroup_dirs(sid)
    assert pooled_ids(daemon, tid) == []
    # Two whole reconciler passes after the drain (the first may have begun
    # before it), each tending the pools: nothing refills a deleted template.
    wait_reconciler_ticks(api, 2)
    assert pooled_ids(daemon, tid) == []
    assert api.sh(claimed["id"], "echo alive") == "alive\n"
    assert f'template_id="{tid}"' not in api.get("/metrics").text
    api.destroy(claimed["id"])


def test_restart_keeps_warm_sandboxes(own_daemon: Daemon):
    d = own_daemon.start()
    c = d.client("admin")
    t = make_template(c, env={"R": "1"}, warm={"min": 2, "max": 2})
    wait_ready(c, t["id"], 2)
    before = pooled_ids(d, t["id"])
    d.stop()
    d.start()
    # Adopted, not replaced: the same sandboxes are ready after the restart.
    wait_ready(c, t["id"], 2)
    assert pooled_ids(d, t["id"]) == before
    sb = c.create(template=t["name"])
    assert sb["warm"] is True and sb["id"] == before[0]
    assert c.sh(sb["id"], "echo $R") == "1\n"
    # kill -9 as well: still adopted, nothing leaks (own_daemon checks the host).
    d.kill9()
    d.kill_strays()
    d.start()
    wait_ready(c, t["id"], 2)
    assert c.sh(sb["id"], "echo $R") == "1\n"
    delete_template(c, t["id"])
    c.destroy(sb["id"])


def test_the_cli_creates_and_updates_templates_with_every_setting(daemon: Daemon):
    c = daemon.new_client("cli-templates")
    env = {"HUTCH_URL": daemon.base, "HUTCH_API_KEY": c.key, "PATH": os.environ["PATH"]}

    def hutch(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(daemon.binary), "template", *args], env=env, capture_output=True, text=True,
                              timeout=30)

    name = f"cli-{uuid.uuid4().hex[:8]}"
    p = hutch("create", name, "--image", "base", "--class", "container", "--memory", "256M",
              "--network", "deny_all", "--env", "A=1", "--json")
    assert p.returncode == 0, p.stderr
    t = json.loads(p.stdout)
    assert (t["image"], t["class"], t["memory_mb"], t["env"]) == ("base", "container", 256, {"A": "1"}), t
    assert t["network"]["egress"] == "deny_all", t
    p = hutch("update", name, "--memory", "512M", "--warm-max", "1", "--allow", "pypi.org", "--json")
    assert p.returncode == 0, p.stderr
    u = json.loads(p.stdout)
    assert u["memory_mb"] == 512 and u["warm"] == {"min": 0, "max": 1}, u
    assert u["network"]["egress"] == "default" and u["network"]["allow"] == ["pypi.org"], u
    assert u["env"] == {"A": "1"} and u["version"] == t["version"] + 1, u
    got = c.get(f"/v1/templates/{t['id']}").json()
    assert got["memory_mb"] == 512 and got["network"]["allow"] == ["pypi.org"], got
    # Nothing to change, a bad flag value: refused, the template as it was.
    p = hutch("update", name)
    assert p.returncode != 0 and "nothing to change" in p.stderr, p.stderr
    p = hutch("update", name, "--network", "sideways")
    assert p.returncode != 0 and "sideways" in p.stderr, p.stderr
    assert c.get(f"/v1/templates/{t['id']}").json() == got
    assert hutch("delete", name).returncode == 0
