"""Snapshots: POST /v1/sandboxes/{id}/snapshots captures a sandbox's files at
one instant (frozen only while its layer is captured); /v1/snapshots lists,
shows and deletes them; POST /v1/sandboxes with "snapshot" starts a sandbox
with those files. Snapshots are owned, counted toward the key's quota, and a
listed snapshot is always whole, also after a daemon killed mid-capture."""

from __future__ import annotations

import os
import signal
import threading

import requests

from conftest import Client, Daemon, expect_error, expect_status, wait_for
from conftest import GVISOR_STATX, on_class


def snapshot_dirs(d: Daemon) -> set[str]:
    p = d.state_dir / "storage" / "fs" / "snapshots"
    return {e.name for e in p.iterdir()} if p.is_dir() else set()


def take(api: Client, sid: str, expect: int = 201, **body) -> dict:
    r = api.post(f"/v1/sandboxes/{sid}/snapshots", body)
    expect_status(r, expect)
    return r.json()


@on_class("gvisor", reason=GVISOR_STATX)
def test_a_snapshot_keeps_files_at_one_instant_and_starts_sandboxes(api: Client, daemon: Daemon):
    src = api.create()
    sid = src["id"]
    try:
        api.sh(sid, "mkdir -p /workspace/proj && echo v1 > /workspace/proj/a && echo gone > /workspace/b")
        api.sh(sid, "echo changed > /etc/motd-hutch", user="root")
        api.sh(sid, "rm /workspace/b")
        snap = take(api, sid, name="v1")
        assert snap["id"].startswith("snap-") and snap["name"] == "v1", snap
        assert snap["sandbox_id"] == sid and snap["memory"] is False and snap["size_bytes"] > 0, snap
        assert snap["owner"] == api.sandbox(sid)["owner"]
        assert snap["id"] in snapshot_dirs(daemon)
        # The source runs on, unfrozen, and its later writes are its own.
        assert api.sandbox(sid)["state"] == "running"
        api.sh(sid, "echo v2 > /workspace/proj/a && echo later > /workspace/c")
        assert api.get(f"/v1/snapshots/{snap['id']}").json() == snap
        assert snap["id"] in [s["id"] for s in api.get("/v1/snapshots").json()["snapshots"]]
        for ref in ("v1", snap["id"]):
            sb = api.create(snapshot=ref)
            try:
                assert sb["snapshot"] == snap["id"] and sb["storage"] == "disk", sb
                assert sb["template"] == src["template"]
                assert api.sh(sb["id"], "cat /workspace/proj/a") == "v1\n"
                assert api.exec(sb["id"], "test -e /workspace/b")["exit_code"] != 0
                assert api.exec(sb["id"], "test -e /workspace/c")["exit_code"] != 0
                assert api.sh(sb["id"], "cat /etc/motd-hutch") == "changed\n"
                assert api.sh(sb["id"], "stat -c %U:%G /workspace/proj/a") == "user:user\n"
                # Its own copy: writes stay in it.
                api.sh(sb["id"], "echo mine > /workspace/proj/a")
            finally:
                api.destroy(sb["id"])
        assert api.sh(sid, "cat /workspace/proj/a") == "v2\n"
    finally:
        api.destroy(sid)
    # A snapshot outlives its sandbox, and sandboxes outlive it.
    sb = api.create(snapshot=snap["id"])
    expect_status(api.delete(f"/v1/snapshots/{snap['id']}"), 204)
    assert snap["id"] not in snapshot_dirs(daemon)
    expect_error(api.get(f"/v1/snapshots/{snap['id']}"), 404, "not_found")
    expect_error(api.delete(f"/v1/snapshots/{snap['id']}"), 404, "not_found")
    assert api.sh(sb["id"], "cat /workspace/proj/a") == "v1\n"
    api.destroy(sb["id"])


def test_a_suspended_sandbox_is_snapshotted_and_stays_suspended(api: Client):
    sb = api.create()
    try:
        api.sh(sb["id"], "echo x > /workspace/x")
        expect_status(api.post(f"/v1/sandboxes/{sb['id']}/suspend"), 200)
        snap = take(api, sb["id"])
        assert snap["name"] is None
        assert api.sandbox(sb["id"])["state"] == "suspended"
        expect_error(api.exec_raw(sb["id"], {"command": "true"}), 409, "sandbox_session_not_running")
        expect_status(api.post(f"/v1/sandboxes/{sb['id']}/resume"), 200)
        expect_status(api.delete(f"/v1/snapshots/{snap['id']}"), 204)
    finally:
        api.destroy(sb["id"])


def test_bad_snapshot_requests_are_refused_and_leave_nothing(api: Client, daemon: Daemon):
    before = snapshot_dirs(daemon)
    for bad in ("snap-zz", "snap-0123456789abcdef", "nope"):
        expect_error(api.get(f"/v1/snapshots/{bad}"), 404, "not_found")
        expect_error(api.post("/v1/sandboxes", {"snapshot": bad}), 404, "not_found")
    expect_error(api.post("/v1/sandboxes/sb-0123456789abcdef/snapshots", {}), 404, "not_found")
    sb = api.create()
    mem = api.create(storage="memory")
    try:
        for name in ("", "Caps", "snap-x", "-x", "a/b", "x" * 65):
            expect_error(api.post(f"/v1/sandboxes/{sb['id']}/snapshots", {"name": name}), 400, "invalid_request")
        expect_error(api.post(f"/v1/sandboxes/{sb['id']}/snapshots", {"nom": "x"}), 400, "invalid_request")
        snap = take(api, sb["id"], name="dup")
        expect_error(api.post(f"/v1/sandboxes/{sb['id']}/snapshots", {"name": "dup"}), 409, "snapshot_name_taken")
        expect_error(api.post(f"/v1/sandboxes/{mem['id']}/snapshots", {}), 409, "snapshot_unsupported")
        expect_error(api.post("/v1/sandboxes", {"snapshot": "dup", "template": "base"}), 400, "invalid_request")
        expect_error(api.post("/v1/sandboxes", {"snapshot": "dup", "storage": "memory"}), 400, "invalid_request")
        expect_status(api.delete(f"/v1/snapshots/{snap['id']}"), 204)
    finally:
        api.destroy(sb["id"])
        api.destroy(mem["id"])
    expect_error(api.post(f"/v1/sandboxes/{sb['id']}/snapshots", {}), 409, "sandbox_session_not_running")
    assert snapshot_dirs(daemon) == before


def test_another_key_can_neither_see_restore_nor_delete_a_snapshot(api: Client, daemon: Daemon):
    other = daemon.new_client("snapshot-other")
    sb = api.create()
    try:
        snap = take(api, sb["id"], name="mine")
        expect_error(other.get(f"/v1/snapshots/{snap['id']}"), 404, "not_found")
        assert other.get("/v1/snapshots").json()["snapshots"] == []
        for ref in (snap["id"], "mine"):
            expect_error(other.post("/v1/sandboxes", {"snapshot": ref}), 404, "not_found")
        expect_error(other.delete(f"/v1/snapshots/{snap['id']}"), 404, "not_found")
        expect_error(other.post(f"/v1/sandboxes/{sb['id']}/snapshots", {}), 404, "not_found")
        # The other key's own name does not collide with it.
        osb = other.create()
        try:
            o = take(other, osb["id"], name="mine")
            assert o["id"] != snap["id"]
            # The admin key sees both through ?owner=*, and its own list
            # holds only its own.
            everyone = {s["id"] for s in api.get("/v1/snapshots", params={"owner": "*"}).json()["snapshots"]}
            assert {snap["id"], o["id"]} <= everyone
            assert o["id"] not in {s["id"] for s in api.get("/v1/snapshots").json()["snapshots"]}
            expect_error(other.get("/v1/snapshots", params={"owner": "*"}), 403, "forbidden")
            expect_status(other.delete(f"/v1/snapshots/{o['id']}"), 204)
        finally:
            other.destroy(osb["id"])
        expect_status(api.get(f"/v1/snapshots/{snap['id']}"), 200)
        expect_status(api.delete(f"/v1/snapshots/{snap['id']}"), 204)
    finally:
        api.destroy(sb["id"])


def test_snapshots_count_toward_the_keys_quota(api: Client, daemon: Daemon):
    limited = daemon.new_client("snapshot-quota", "--max-snapshots", "1")
    sb = limited.create()
    try:
        first = take(limited, sb["id"])
        usage = limited.get("/v1/usage").json()
        assert usage["snapshots"] == 1 and usage["quotas"]["max_snapshots"] == 1, usage
        before = snapshot_dirs(daemon)
        body = expect_error(limited.post(f"/v1/sandboxes/{sb['id']}/snapshots", {}), 429, "quota_exceeded")
        assert "snapshots" in body["error"], body
        assert snapshot_dirs(daemon) == before
        expect_status(limited.delete(f"/v1/snapshots/{first['id']}"), 204)
        second = take(limited, sb["id"])
        expect_status(limited.delete(f"/v1/snapshots/{second['id']}"), 204)
    finally:
        limited.destroy(sb["id"])


def test_a_daemon_killed_while_snapshotting_lists_only_whole_snapshots(own_daemon: Daemon):
    d = own_daemon
    d.start()
    api = d.client()
    sb = api.create()
    api.sh(sb["id"], "for i in $(seq 200); do echo $i > /workspace/f$i; done")
    stop = threading.Event()
    worker = api.clone()

    def snapshot_forever():
        while not stop.is_set():
            try:
                worker.post(f"/v1/sandboxes/{sb['id']}/snapshots", {}, timeout=10)
            except requests.RequestException:
                return

    t = threading.Thread(target=snapshot_forever, daemon=True)
    t.start()
    try:
        wait_for("a few snapshots", lambda: len(snapshot_dirs(d)) >= 3, timeout=60)
        os.kill(d.pid, signal.SIGKILL)
        d.proc.wait(timeout=15)
    finally:
        stop.set()
        t.join(timeout=30)
    d.kill_strays()
    d.start()
    listed = {s["id"] for s in api.get("/v1/snapshots").json()["snapshots"]}
    assert listed, "no snapshot survived"
    # Every listed snapshot has its files, and no files are left without a row.
    assert snapshot_dirs(d) == listed, (snapshot_dirs(d), listed)
    snap = sorted(listed)[0]
    nb = api.create(snapshot=snap)
    assert api.sh(nb["id"], "cat /workspace/f200") == "200\n"
    api.destroy(nb["id"])
    for s in listed:
        expect_status(api.delete(f"/v1/snapshots/{s}"), 204)
    assert snapshot_dirs(d) == set()
    api.destroy(sb["id"])


def fork_dirs(d: Daemon) -> set[str]:
    return {n for n in snapshot_dirs(d) if n.startswith("fork-")}


@on_class("gvisor", reason=GVISOR_STATX)
def test_fork_starts_n_sandboxes_with_the_parents_files_at_one_instant(api: Client, daemon: Daemon):
    parent = api.create()
    pid = parent["id"]
    try:
        api.sh(pid, "echo base > /workspace/state && echo 1 > /workspace/n")
        r = api.post(f"/v1/sandboxes/{pid}/fork", {"count": 3})
        expect_status(r, 201)
        kids = r.json()["sandboxes"]
        try:
            assert len(kids) == 3 and all(k["state"] == "running" for k in kids), kids
            ids = {k["id"] for k in kids}
            assert len(ids) == 3 and pid not in ids
            api.sh(pid, "echo after > /workspace/state")
            names = set()
            for i, k in enumerate(kids):
                assert k["template"] == parent["template"] and k["storage"] == "disk", k
                assert api.sh(k["id"], "cat /workspace/state") == "base\n"
                assert api.sh(k["id"], "stat -c %U /workspace/state") == "user\n"
                api.sh(k["id"], f"echo kid{i} > /workspace/state")
                names.add(tuple(api.sandbox(k["id"])["network"]["addresses"]))
            # Each has its own network lease (hutch's host name is `sandbox` for all).
            assert len(names) == 3, names
            assert [api.sh(k["id"], "cat /workspace/state") for k in kids] == ["kid0\n", "kid1\n", "kid2\n"]
            assert api.sh(pid, "cat /workspace/state") == "after\n"
            assert api.sandbox(pid)["state"] == "running"
            # The fork point stays while a child lives: their diffs start there.
            assert len(fork_dirs(daemon)) == 1
            d = api.get(f"/v1/sandboxes/{kids[0]['id']}/diff")
            expect_status(d, 200)
            assert [(c["path"], c["kind"]) for c in d.json()["changes"]] == [("/workspace/state", "modified")]
        finally:
            for k in kids:
                api.destroy(k["id"])
        assert fork_dirs(daemon) == set(), "the fork point outlived its children"
    finally:
        api.destroy(pid)


def test_bad_forks_are_refused_and_leave_nothing(api: Client, daemon: Daemon):
    other = daemon.new_client("fork-other")
    limited = daemon.new_client("fork-limited", "--max-sandboxes", "3")
    sb = api.create()
    mem = api.create(storage="memory")
    lsb = limited.create()
    try:
        for count in (0, 21, -1):
            expect_error(api.post(f"/v1/sandboxes/{sb['id']}/fork", {"count": count}), 400, "invalid_request")
        expect_error(other.post(f"/v1/sandboxes/{sb['id']}/fork", {"count": 1}), 404, "not_found")
        expect_error(api.post(f"/v1/sandboxes/{mem['id']}/fork", {}), 409, "snapshot_unsupported")
        # Past the key's quota: all or nothing.
        expect_error(limited.post(f"/v1/sandboxes/{lsb['id']}/fork", {"count": 3}), 429, "quota_exceeded")
        live = [s for s in limited.list_all() if s["state"] != "terminated"]
        assert [s["id"] for s in live] == [lsb["id"]], live
        r = limited.post(f"/v1/sandboxes/{lsb['id']}/fork", {"count": 2})
        expect_status(r, 201)
        for k in r.json()["sandboxes"]:
            limited.destroy(k["id"])
        assert fork_dirs(daemon) == set()
    finally:
        api.destroy(sb["id"])
        api.destroy(mem["id"])
        limited.destroy(lsb["id"])
    expect_error(api.post(f"/v1/sandboxes/{sb['id']}/fork", {}), 409, "sandbox_session_not_running")


def test_diff_lists_what_changed_since_the_start_or_a_snapshot(api: Client, daemon: Daemon):
    import hashlib
    sb = api.create()
    sid = sb["id"]
    other = daemon.new_client("diff-other")
    try:
        api.sh(sid, "mkdir -p /workspace/p && printf hello > /workspace/p/a && ln -s a /workspace/p/l")
        api.sh(sid, "echo x > /etc/hutch-added && rm -f /etc/hostname && echo y >> /etc/passwd", user="root")
        changes = {c["path"]: c for c in api.get(f"/v1/sandboxes/{sid}/diff").json()["changes"]}
        assert changes["/workspace/p/a"]["kind"] == "added", changes
        assert changes["/workspace/p/a"]["size"] == 5
        assert changes["/workspace/p/a"]["sha256"] == hashlib.sha256(b"hello").hexdigest()
        assert changes["/workspace/p/l"]["sha256"] == hashlib.sha256(b"a").hexdigest()
        assert changes["/etc/hutch-added"]["kind"] == "added"
        assert changes["/etc/passwd"]["kind"] == "modified"
        snap = take(api, sid, name="diff-base")
        api.sh(sid, "printf bye > /workspace/p/a && rm /workspace/p/l && echo n > /workspace/new")
        since = [(c["path"], c["kind"]) for c in
                 api.get(f"/v1/sandboxes/{sid}/diff", params={"against": "diff-base"}).json()["changes"]]
        assert since == [("/workspace/new", "added"), ("/workspace/p/a", "modified"), ("/workspace/p/l", "deleted")]
        # The same as an archive to apply elsewhere: the files now, the deletions listed.
        import io
        import tarfile
        r = api.get(f"/v1/sandboxes/{sid}/diff", params={"against": "diff-base", "format": "tar"})
        expect_status(r, 200)
        assert r.headers["content-type"] == "application/x-tar"
        with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
            members = {m.name: m for m in tar.getmembers()}
            assert set(members) == {"workspace/new", "workspace/p/a", ".hutch-diff/deleted"}, members
            assert tar.extractfile("workspace/p/a").read() == b"bye"
            assert members["workspace/p/a"].uid == 1000
            assert tar.extractfile(".hutch-diff/deleted").read() == b"/workspace/p/l\0"
        expect_error(api.get(f"/v1/sandboxes/{sid}/diff", params={"format": "zip"}), 400, "invalid_request")
        # A sandbox started from the snapshot compares with it.
        child = api.create(snapshot=snap["id"])
        try:
            assert api.get(f"/v1/sandboxes/{child['id']}/diff").json()["changes"] == []
            api.sh(child["id"], "rm /workspace/p/a")
            got = [(c["path"], c["kind"]) for c in api.get(f"/v1/sandboxes/{child['id']}/diff").json()["changes"]]
            assert got == [("/workspace/p/a", "deleted")], got
        finally:
            api.destroy(child["id"])
        expect_error(other.get(f"/v1/sandboxes/{sid}/diff"), 404, "not_found")
        expect_error(api.get(f"/v1/sandboxes/{sid}/diff", params={"against": "nope"}), 404, "not_found")
        o = other.create()
        try:
            osnap = take(other, o["id"])
            expect_error(api.get(f"/v1/sandboxes/{sid}/diff", params={"against": osnap["id"]}), 404, "not_found")
        finally:
            other.destroy(o["id"])
        expect_status(api.delete(f"/v1/snapshots/{snap['id']}"), 204)
    finally:
        api.destroy(sid)
    expect_error(api.get(f"/v1/sandboxes/{sid}/diff"), 409, "sandbox_session_not_running")


def test_a_large_diff_archive_streams_whole(api: Client):
    """A change of 300 MiB comes out whole as a tar, read as it streams (the
    daemon does not build the archive in memory, nor refuse it for size)."""
    import tarfile

    sb = api.create(limits={"disk_mib": 1024})
    sid = sb["id"]
    try:
        size = 300 << 20
        api.sh(sid, f"head -c {size} /dev/urandom > /workspace/big && echo x > /workspace/small")
        r = api.get(f"/v1/sandboxes/{sid}/diff", params={"format": "tar"}, stream=True)
        expect_status(r, 200)
        seen = {}
        with tarfile.open(fileobj=r.raw, mode="r|") as tar:
            for m in tar:
                f = tar.extractfile(m) if m.isfile() else None
                n = 0
                while f is not None and (chunk := f.read(1 << 20)):
                    n += len(chunk)
                seen[m.name] = n
        assert seen.get("workspace/big") == size and seen.get("workspace/small") == 2, seen
        assert ".hutch-diff/deleted" in seen, seen
    finally:
        api.destroy(sid)


def test_snapshots_and_fork_points_survive_a_restart(own_daemon: Daemon):
    d = own_daemon
    d.start()
    api = d.client()
    parent = api.create()
    api.sh(parent["id"], "echo kept > /workspace/k")
    snap = take(api, parent["id"], name="across")
    kids = api.post(f"/v1/sandboxes/{parent['id']}/fork", {"count": 1}).json()["sandboxes"]
    api.sh(kids[0]["id"], "echo kid > /workspace/k")
    d.stop()
    d.start()
    assert api.get(f"/v1/snapshots/{snap['id']}").json()["name"] == "across"
    assert snap["id"] in snapshot_dirs(d) and len(fork_dirs(d)) == 1
    # The child still compares with its fork point.
    got = [(c["path"], c["kind"]) for c in api.get(f"/v1/sandboxes/{kids[0]['id']}/diff").json()["changes"]]
    assert got == [("/workspace/k", "modified")], got
    sb = api.create(snapshot="across")
    assert api.sh(sb["id"], "cat /workspace/k") == "kept\n"
    for s in (sb, kids[0], parent):
        api.destroy(s["id"])
    assert fork_dirs(d) == set()
    expect_status(api.delete(f"/v1/snapshots/{snap['id']}"), 204)
    assert snapshot_dirs(d) == set()


def test_the_cli_takes_lists_forks_and_deletes_snapshots(api: Client, daemon: Daemon):
    sb = api.create()
    try:
        api.sh(sb["id"], "echo cli > /workspace/c")

        def cli(*args: str) -> str:
            p = daemon.cli("snapshot", *args, "--url", daemon.base)
            assert p.returncode == 0, p.stderr
            return p.stdout

        snap = cli("create", sb["id"], "--name", "from-cli").strip()
        assert snap.startswith("snap-")
        assert "from-cli" in cli("list")
        p = daemon.cli("sandbox", "create", "--snapshot", "from-cli", "--quiet", "--url", daemon.base)
        assert p.returncode == 0, p.stderr
        made = p.stdout.strip()
        assert api.sh(made, "cat /workspace/c") == "cli\n"
        api.destroy(made)
        kids = cli("fork", sb["id"], "--count", "2").split()
        assert len(kids) == 2 and all(k.startswith("sb-") for k in kids)
        for k in kids:
            api.destroy(k)
        cli("rm", snap)
        expect_error(api.get(f"/v1/snapshots/{snap}"), 404, "not_found")
    finally:
        api.destroy(sb["id"])
