"""Sandbox lifecycle: create (idempotent), read, list, delete, extend, expiry."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from conftest import Client, Daemon, cgroup_dirs, expect_error, expect_status, leftovers, wait_cleaned, wait_for


def ts(s: str) -> datetime:
    return datetime.fromisoformat(s.replace("Z", "+00:00"))


def rfc3339(dt: datetime) -> str:
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


FULL_BODY = {
    "template": "base",
    "ttl_seconds": 600,
    "memory_mb": 1024,
    "limits": {"vcpus": 1, "disk_mib": 2048, "pids": 512},
    "env": {"GREETING": "hello from env"},
    "metadata": {"owner": "tests", "purpose": "e2e"},
    "wait_seconds": 10,
}


def test_create_answers_a_running_sandbox_with_enforced_limits(api: Client, daemon: Daemon):
    before = datetime.now(timezone.utc)
    r = api.post("/v1/sandboxes", FULL_BODY)
    expect_status(r, 201)
    sb = r.json()
    try:
        assert sb["id"].startswith("sb-"), sb
        assert sb["state"] == "running"
        assert sb["template"] == "base" and sb["class"] == "container", sb
        assert sb["memory_mb"] == 1024
        assert sb["limits"] == {"vcpus": 1.0, "disk_mib": 2048, "pids": 512, "applied": "enforced"}
        assert sb["metadata"] == FULL_BODY["metadata"]
        created, expires = ts(sb["created_at"]), ts(sb["expires_at"])
        assert before - timedelta(seconds=2) <= created <= datetime.now(timezone.utc) + timedelta(seconds=2)
        assert abs((expires - created).total_seconds() - 600) < 1.5, sb
        # The sandbox environment reaches commands.
        assert api.sh(sb["id"], "echo $GREETING") == "hello from env\n"
        # It exists on the host: a cgroup of its own.
        assert cgroup_dirs(sb["id"]), f"no hutch/{sb['id']} cgroup on the host"
        # GET answers the same sandbox.
        assert api.sandbox(sb["id"]) == sb
    finally:
        api.destroy(sb["id"])


@pytest.mark.parametrize("storage", ["disk", "memory"])
def test_create_limits_are_applied_to_the_cgroup(api: Client, storage: str):
    sb = api.create(memory_mb=256, limits={"pids": 64, "vcpus": 0.5, "disk_mib": 64}, storage=storage)
    try:
        sid = sb["id"]

        def limit(*candidates: str) -> int:
            found = [Path(p) for p in candidates if Path(p).exists()]
            assert found, f"none of {candidates}"
            return int(found[0].read_text())

        # The workload's limits are on its own cgroup, `work`; the sandbox's
        # adds the agent's headroom: 64 MiB, for a memory layer the layer
        # (which it may fill for the API; a disk layer's pages are page
        # cache), and a process per command and two.
        root = "/sys/fs/cgroup"
        mem = ("memory/hutch/{}/memory.limit_in_bytes", "unified/hutch/{}/memory.max", "hutch/{}/memory.max")
        pids = ("pids/hutch/{}/pids.max", "unified/hutch/{}/pids.max", "hutch/{}/pids.max")
        assert limit(*(f"{root}/{m.format(sid + '/work')}" for m in mem)) == 256 << 20
        layer = 64 if storage == "memory" else 0
        assert limit(*(f"{root}/{m.format(sid)}" for m in mem)) == (256 + 64 + layer) << 20
        assert limit(*(f"{root}/{p.format(sid + '/work')}" for p in pids)) == 64
        assert limit(*(f"{root}/{p.format(sid)}" for p in pids)) == 64 + 2 * 64 + 8
        # The writable layer is capped by disk_mib: 100 MiB do not fit in 64.
        res = api.exec(sid, "head -c 100M /dev/zero > /workspace/big; echo rc=$?", timeout_seconds=60)
        assert "rc=0" not in res["stdout"], f"wrote 100 MiB into a 64 MiB disk: {res}"
    finally:
        api.destroy(sb["id"])


def test_create_with_the_same_idempotency_key_and_body_replays_the_sandbox(api: Client):
    key = f"create-{uuid.uuid4()}"
    body = {"ttl_seconds": 300, "metadata": {"k": "v"}}
    r1 = api.post("/v1/sandboxes", body, headers={"Idempotency-Key": key})
    expect_status(r1, 201)
    try:
        r2 = api.post("/v1/sandboxes", body, headers={"Idempotency-Key": key})
        expect_status(r2, 200)
        assert r2.json()["id"] == r1.json()["id"]
        r3 = api.post("/v1/sandboxes", {**body, "metadata": {"k": "other"}}, headers={"Idempotency-Key": key})
        expect_error(r3, 409, "idempotency_conflict")
        # Only one sandbox was made for the key.
        ids = [s["id"] for s in api.list_all() if s["metadata"] == {"k": "v"} and s["state"] != "terminated"]
        assert ids == [r1.json()["id"]], ids
    finally:
        api.destroy(r1.json()["id"])


def test_create_refuses_an_unknown_template(api: Client):
    expect_error(api.post("/v1/sandboxes", {"template": "no-such-template"}), 400, "unknown_template")


@pytest.mark.parametrize(
    "body",
    [
        {"templat": "base"},
        {"limits": {"cpus": 2}},
        {"memory_mb": 32},
        {"memory_mb": 10**9},
        {"limits": {"vcpus": 0}},
        {"limits": {"pids": 1}},
        {"limits": {"disk_mib": 1}},
        {"ttl_seconds": 0},
        {"ttl_seconds": 24 * 3600 + 1},
        {"env": {"A=B": "x"}},
        {"metadata": {f"k{i}": "v" for i in range(65)}},
        {"ttl_seconds": "ten"},
    ],
    ids=lambda b: ",".join(b) if isinstance(b, dict) else str(b),
)
def test_create_refuses_invalid_bodies(api: Client, body: dict):
    expect_error(api.post("/v1/sandboxes", body), 400, "invalid_request")


def test_create_refuses_malformed_json(api: Client):
    r = api.request("POST", "/v1/sandboxes", data="{not json", headers={"Content-Type": "application/json"})
    expect_error(r, 400, "invalid_request")


def test_get_and_delete_of_unknown_ids_are_404(api: Client):
    for sid in ("sb-0000000000000000", "nonsense", "sb-"):
        expect_error(api.get(f"/v1/sandboxes/{sid}"), 404, "not_found")
        expect_error(api.delete(f"/v1/sandboxes/{sid}"), 404, "not_found")


def test_delete_is_idempotent_and_frees_the_host(api: Client, daemon: Daemon):
    sb = api.create()
    api.background(sb["id"], "sleep 300")
    first = api.destroy(sb["id"])
    assert first["state"] == "terminated", first
    again = api.destroy(sb["id"])
    assert again["state"] == "terminated"
    assert api.sandbox(sb["id"])["state"] == "terminated"
    wait_cleaned(daemon, sb["id"])
    # A terminated sandbox refuses commands.
    expect_error(api.exec_raw(sb["id"], {"command": "true"}), 409, "sandbox_session_not_running")


def test_live_lists_leave_the_terminated_out_and_the_cli_shows_them_by_default(daemon: Daemon):
    c = daemon.new_client("live-lister")
    made = [c.create()["id"] for _ in range(3)]
    try:
        c.destroy(made[1])
        every = [s["id"] for s in c.get("/v1/sandboxes").json()["sandboxes"]]
        assert every == made[::-1], every
        r = c.get("/v1/sandboxes", params={"live": "true", "limit": 1})
        expect_status(r, 200)
        assert [s["id"] for s in r.json()["sandboxes"]] == [made[2]]
        r = c.get("/v1/sandboxes", params={"live": "true", "limit": 1, "cursor": r.json()["next_cursor"]})
        assert [s["id"] for s in r.json()["sandboxes"]] == [made[0]], r.json()
        expect_error(c.get("/v1/sandboxes", params={"live": "maybe"}), 400, "invalid_request")
        # The CLI: live ones by default (every page), --all adds the ended.
        env = {"HUTCH_URL": daemon.base, "HUTCH_API_KEY": c.key, "PATH": os.environ["PATH"]}
        def cli_ids(*flags: str) -> list[str]:
            p = subprocess.run([str(daemon.binary), "sandbox", "list", "--json", *flags], env=env,
                               capture_output=True, text=True, timeout=30)
            assert p.returncode == 0, p.stderr
            return [s["id"] for s in json.loads(p.stdout)["sandboxes"]]
        assert cli_ids() == [made[2], made[0]]
        assert cli_ids("--all") == made[::-1]
        assert cli_ids("--all", "--limit", "1") == [made[2]]
    finally:
        for sid in made:
            c.destroy(sid)


def test_list_is_newest_first_and_pages_with_a_cursor(daemon: Daemon):
    c = daemon.new_client("pager")
    made = [c.create(metadata={"n": str(i)})["id"] for i in range(5)]
    try:
        r = c.get("/v1/sandboxes")
        expect_status(r, 200)
        assert [s["id"] for s in r.json()["sandboxes"]] == made[::-1]
        assert "next_cursor" not in r.json() or r.json()["next_cursor"] is None
        seen, cursor = [], None
        for _ in range(10):
            params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
            r = c.get("/v1/sandboxes", params=params)
            expect_status(r, 200)
            page = r.json()
            assert len(page["sandboxes"]) <= 2
            seen += [s["id"] for s in page["sandboxes"]]
            cursor = page.get("next_cursor")
            if not cursor:
                break
        assert seen == made[::-1]
        expect_error(c.get("/v1/sandboxes", params={"limit": 0}), 400, "invalid_request")
        expect_error(c.get("/v1/sandboxes", params={"cursor": "garbage"}), 400, "invalid_request")
        expect_error(c.get("/v1/sandboxes", params={"bogus": 1}), 400, "invalid_request")
    finally:
        for sid in made:
            c.destroy(sid)


def test_extend_by_and_until(api: Client, sandbox: dict):
    sid = sandbox["id"]
    exp0 = ts(sandbox["expires_at"])
    r = api.post(f"/v1/sandboxes/{sid}/extend", {"by": 120})
    expect_status(r, 200)
    exp1 = ts(r.json()["expires_at"])
    assert abs((exp1 - exp0).total_seconds() - 120) < 0.01, (exp0, exp1)
    target = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(hours=2)
    r = api.post(f"/v1/sandboxes/{sid}/extend", {"until": rfc3339(target)})
    expect_status(r, 200)
    assert ts(r.json()["expires_at"]) == target
    assert api.sandbox(sid)["expires_at"] == r.json()["expires_at"]


def test_extend_past_24_hours_after_creation_is_refused_and_changes_nothing(api: Client, sandbox: dict):
    sid = sandbox["id"]
    created = ts(sandbox["created_at"])
    before = api.sandbox(sid)["expires_at"]
    body = expect_error(api.post(f"/v1/sandboxes/{sid}/extend", {"by": 48 * 3600}), 400, "invalid_request")
    assert "latest" in body["error"], body
    far = rfc3339(datetime.now(timezone.utc) + timedelta(days=30))
    expect_error(api.post(f"/v1/sandboxes/{sid}/extend", {"until": far}), 400, "invalid_request")
    assert api.sandbox(sid)["expires_at"] == before
    # Up to the cap itself is fine.
    r = api.post(f"/v1/sandboxes/{sid}/extend", {"until": rfc3339(created + timedelta(hours=24))})
    expect_status(r, 200)
    assert ts(r.json()["expires_at"]) == created + timedelta(hours=24), r.json()


@pytest.mark.parametrize(
    "body",
    [{}, {"by": 10, "until": "2099-01-01T00:00:00Z"}, {"until": "tomorrow"}, {"until": "2000-01-01T00:00:00Z"},
     {"by": -5}, {"for": 10}],
    ids=["neither", "both", "not-rfc3339", "past", "negative", "unknown-field"],
)
def test_extend_refuses_invalid_bodies(api: Client, sandbox: dict, body: dict):
    r = api.post(f"/v1/sandboxes/{sandbox['id']}/extend", body)
    expect_error(r, 400, "invalid_request")


def test_extend_of_an_unknown_sandbox_is_404(api: Client):
    expect_error(api.post("/v1/sandboxes/sb-0000000000000000/extend", {"by": 10}), 404, "not_found")


def test_an_expired_sandbox_is_terminated_and_leaves_the_host(api: Client, daemon: Daemon):
    sb = api.create(ttl_seconds=2)
    sid = sb["id"]
    api.background(sid, "sleep 300")
    assert cgroup_dirs(sid)
    expires = ts(sb["expires_at"])
    final = wait_for(
        "the expired sandbox to be terminated",
        lambda: (lambda s: s if s["state"] == "terminated" else None)(api.sandbox(sid)),
        timeout=10,
        interval=0.2,
    )
    done_at = datetime.now(timezone.utc)
    assert (done_at - expires).total_seconds() < 5, f"terminated {done_at - expires} after expiry"
    assert final.get("last_error_code") == "sandbox_expired", final
    wait_cleaned(daemon, sid, timeout=5)
    assert not leftovers(daemon.run_dir, sid)
