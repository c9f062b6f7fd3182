"""Volumes: /v1/volumes makes, lists, shows, grows and deletes them; POST
/v1/sandboxes with "volumes" mounts them. A volume is owned by its key,
limited to its size (writes past it fail), read-write by one sandbox at a
time or read-only by many, mounted only under /workspace, /home/user, /mnt
or /data, and outlives its sandboxes and the daemon."""

from __future__ import annotations

import contextlib

from conftest import Client, Daemon, expect_error, expect_status, wait_for

MiB = 1 << 20


def volume_dirs(d: Daemon) -> set[str]:
    p = d.state_dir / "storage" / "fs" / "volumes"
    return {e.name for e in p.iterdir()} if p.is_dir() else set()


def make(api: Client, name: str, size_mib: int | None = 64, expect: int = 201) -> dict:
    body = {"name": name} if size_mib is None else {"name": name, "size_mib": size_mib}
    r = api.post("/v1/volumes", body)
    expect_status(r, expect)
    return r.json()


@contextlib.contextmanager
def volume(api: Client, name: str, size_mib: int = 64):
    v = make(api, name, size_mib)
    try:
        yield v
    finally:
        expect_status(api.delete(f"/v1/volumes/{v['id']}"), (204, 404))


def mount(name: str, path: str, read_only: bool = False) -> dict:
    return {"name": name, "path": path, "read_only": read_only}


def test_every_route_of_a_volume(api: Client, daemon: Daemon):
    v = make(api, "routes", 32)
    assert v["id"].startswith("vol-") and v["name"] == "routes" and v["size_mib"] == 32, v
    assert v["mounted_by"] == [] and v["used_bytes"] >= 0 and v["created_at"], v
    assert v["id"] in volume_dirs(daemon)
    try:
        for ref in (v["id"], "routes"):
            got = api.get(f"/v1/volumes/{ref}").json()
            assert got["id"] == v["id"] and got["size_mib"] == 32, got
        assert v["id"] in [x["id"] for x in api.get("/v1/volumes").json()["volumes"]]
        # Names are unique per owner.
        expect_error(api.post("/v1/volumes", {"name": "routes"}), 409, "volume_name_taken")
        # It grows; it never shrinks; the same size changes nothing.
        r = api.request("PATCH", f"/v1/volumes/{v['id']}", json={"size_mib": 48})
        expect_status(r, 200)
        assert r.json()["size_mib"] == 48
        expect_error(api.request("PATCH", "/v1/volumes/routes", json={"size_mib": 16}), 400, "volume_shrink_refused")
        expect_status(api.request("PATCH", "/v1/volumes/routes", json={"size_mib": 48}), 200)
        expect_error(api.request("PATCH", "/v1/volumes/routes", json={}), 400, "invalid_request")
        assert api.get("/v1/volumes/routes").json()["size_mib"] == 48
        # Without a size: 1 GiB.
        d = make(api, "default-size", None)
        assert d["size_mib"] == 1024, d
        expect_status(api.delete("/v1/volumes/default-size"), 204)
    finally:
        expect_status(api.delete(f"/v1/volumes/{v['id']}"), 204)
    assert v["id"] not in volume_dirs(daemon)
    for method, path in (("GET", v["id"]), ("DELETE", v["id"]), ("GET", "routes"), ("PATCH", "routes")):
        expect_error(api.request(method, f"/v1/volumes/{path}", json={"size_mib": 64}), 404, "volume_not_found")


def test_bad_volume_requests_are_refused_and_leave_nothing(api: Client, daemon: Daemon):
    before = volume_dirs(daemon)
    for body in (
        {"name": ""},
        {"name": "Upper"},
        {"name": "vol-0123456789abcdef"},
        {"name": "a/b"},
        {"name": "ok", "size_mib": 0},
        {"name": "ok", "size_mib": (1 << 20) + 1},
        {"name": "ok", "size_mib": -1},
        {"name": "ok", "extra": 1},
        {"size_mib": 1},
    ):
        r = api.post("/v1/volumes", body)
        assert r.status_code in (400, 422), (body, r.status_code, r.text)
        assert r.json()["code"] == "invalid_request", (body, r.text)
    assert volume_dirs(daemon) == before
    assert "ok" not in [x["name"] for x in api.get("/v1/volumes").json()["volumes"]]


def test_a_volume_is_mounted_writable_by_the_user_and_outlives_its_sandbox(api: Client):
    with volume(api, "keep") as v:
        sb = api.create(volumes=[mount("keep", "/data")])
        try:
            assert sb["volumes"] == [mount("keep", "/data")], sb
            assert api.sandbox(sb["id"])["volumes"] == [mount("keep", "/data")]
            assert api.sh(sb["id"], "stat -c %U /data") == "user\n"
            api.sh(sb["id"], "echo hello > /data/a && mkdir -p /data/d && echo x > /data/d/b")
            got = api.get("/v1/volumes/keep").json()
            assert got["mounted_by"] == [{"sandbox_id": sb["id"], "path": "/data", "read_only": False}], got
            # Not part of the sandbox's own files: its diff does not list
            # them, and its fork's children mount nothing.
            changes = [c["path"] for c in api.get(f"/v1/sandboxes/{sb['id']}/diff").json()["changes"]]
            assert not any(p.startswith("/data/") for p in changes), changes
            r = api.post(f"/v1/sandboxes/{sb['id']}/fork", {"count": 1})
            expect_status(r, 201)
            kid = r.json()["sandboxes"][0]["id"]
            try:
                assert api.exec(kid, "test -e /data/a")["exit_code"] != 0
                assert [h["sandbox_id"] for h in api.get("/v1/volumes/keep").json()["mounted_by"]] == [sb["id"]]
            finally:
                api.destroy(kid)
        finally:
            api.destroy(sb["id"])
        # Its end released the claim.
        assert api.get(f"/v1/volumes/{v['id']}").json()["mounted_by"] == []
        sb = api.create(volumes=[mount(v["id"], "/home/user/vol/")])
        try:
            assert api.sh(sb["id"], "cat /home/user/vol/a /home/user/vol/d/b") == "hello\nx\n"
            wait_for("the volume's usage to show", lambda: api.get("/v1/volumes/keep").json()["used_bytes"] > 0)
        finally:
            api.destroy(sb["id"])


def test_writes_past_a_volumes_size_fail_and_growing_it_makes_room(api: Client):
    with volume(api, "small", 16):
        sb = api.create(volumes=[mount("small", "/mnt/small")])
        sid = sb["id"]
        try:
            r = api.exec(sid, "dd if=/dev/zero of=/mnt/small/fill bs=1M count=40 conv=fsync 2>&1; echo rc=$?")
            assert "rc=0" not in r["stdout"], r
            assert "Disk quota exceeded" in r["stdout"] or "No space left" in r["stdout"], r
            assert int(api.sh(sid, "stat -c %s /mnt/small/fill")) <= 16 * MiB
            # The sandbox's own disk is not the volume's: it still writes.
            api.sh(sid, "head -c 1048576 /dev/zero > /workspace/own")
            # Grown while mounted: the room is there at once.
            api.sh(sid, "rm -f /mnt/small/fill && sync")
            expect_status(api.request("PATCH", "/v1/volumes/small", json={"size_mib": 64}), 200)
            r = api.exec(sid, "dd if=/dev/zero of=/mnt/small/fill bs=1M count=40 conv=fsync 2>&1; echo rc=$?")
            assert "rc=0" in r["stdout"], r
        finally:
            api.destroy(sid)


def test_read_write_is_exclusive_and_read_only_is_shared(api: Client, daemon: Daemon):
    with volume(api, "shared"):
        writer = api.create(volumes=[mount("shared", "/data")])
        try:
            api.sh(writer["id"], "echo w > /data/f")
            n = len(api.list_all())
            # A second writer, or a reader beside the writer: refused, nothing made.
            for ro in (False, True):
                body = expect_error(
                    api.post("/v1/sandboxes", {"volumes": [mount("shared", "/data", ro)]}), 409, "volume_in_use"
                )
                assert writer["id"] in body["error"], body
            assert len(api.list_all()) == n
            # Delete while mounted: refused.
            expect_error(api.delete("/v1/volumes/shared"), 409, "volume_in_use")
        finally:
            api.destroy(writer["id"])
        readers = [api.create(volumes=[mount("shared", "/mnt/s", True)]) for _ in range(2)]
        try:
            for r in readers:
                assert api.sh(r["id"], "cat /mnt/s/f") == "w\n"
                out = api.exec(r["id"], "touch /mnt/s/g 2>&1; echo rc=$?")["stdout"]
                assert "Read-only file system" in out and "rc=0" not in out, out
            holders = api.get("/v1/volumes/shared").json()["mounted_by"]
            assert sorted(h["sandbox_id"] for h in holders) == sorted(r["id"] for r in readers), holders
            assert all(h["read_only"] for h in holders)
            expect_error(api.post("/v1/sandboxes", {"volumes": [mount("shared", "/data")]}), 409, "volume_in_use")
            expect_error(api.delete("/v1/volumes/shared"), 409, "volume_in_use")
        finally:
            for r in readers:
                api.destroy(r["id"])
        # A paused sandbox keeps its claim, and mounts again on resume.
        sb = api.create(volumes=[mount("shared", "/data")])
        try:
            expect_status(api.post(f"/v1/sandboxes/{sb['id']}/suspend", {"mode": "disk"}), 200)
            expect_error(api.delete("/v1/volumes/shared"), 409, "volume_in_use")
            expect_error(api.post("/v1/sandboxes", {"volumes": [mount("shared", "/data")]}), 409, "volume_in_use")
            expect_status(api.post(f"/v1/sandboxes/{sb['id']}/resume"), 200)
            assert api.sh(sb["id"], "cat /data/f") == "w\n"
        finally:
            api.destroy(sb["id"])


def test_mount_paths_are_kept_to_their_places(api: Client):
    with volume(api, "paths"):
        n = len(api.list_all())
        for path in ("/etc", "/usr/lib/x", "/", "data", "/data/../etc", "/home/other", "/tmp/x", "/proc/1", "/datax"):
            expect_error(api.post("/v1/sandboxes", {"volumes": [mount("paths", path)]}), 400, "volume_path_invalid")
        with volume(api, "paths2"):
            expect_error(
                api.post("/v1/sandboxes", {"volumes": [mount("paths", "/data"), mount("paths2", "/data/x")]}),
                400,
                "volume_path_invalid",
            )
        expect_error(
            api.post("/v1/sandboxes", {"volumes": [mount("paths", "/data"), mount("paths", "/mnt")]}),
            400,
            "invalid_request",
        )
        assert len(api.list_all()) == n
        # Normalized: repeated slashes and `.` go. A memory layer mounts
        # volumes too.
        sb = api.create(storage="memory", volumes=[mount("paths", "//workspace/./v/")])
        try:
            assert api.get("/v1/volumes/paths").json()["mounted_by"][0]["path"] == "/workspace/v"
            api.sh(sb["id"], "touch /workspace/v/ok")
        finally:
            api.destroy(sb["id"])


def test_another_key_can_neither_see_mount_resize_nor_delete_a_volume(daemon: Daemon):
    owner = daemon.new_client("volume-owner")
    other = daemon.new_client("volume-other")
    v = make(owner, "mine")
    try:
        assert other.get("/v1/volumes").json()["volumes"] == []
        for ref in (v["id"], "mine"):
            expect_error(other.get(f"/v1/volumes/{ref}"), 404, "volume_not_found")
            expect_error(other.request("PATCH", f"/v1/volumes/{ref}", json={"size_mib": 128}), 404, "volume_not_found")
            expect_error(other.delete(f"/v1/volumes/{ref}"), 404, "volume_not_found")
            n = len(other.list_all())
            expect_error(other.post("/v1/sandboxes", {"volumes": [mount(ref, "/data")]}), 404, "volume_not_found")
            assert len(other.list_all()) == n
        # Its own volume of the same name is its own.
        mine = make(other, "mine")
        assert mine["id"] != v["id"]
        expect_status(other.delete("/v1/volumes/mine"), 204)
        assert owner.get("/v1/volumes/mine").json()["size_mib"] == 64
        # Unknown ones look the same.
        expect_error(owner.get("/v1/volumes/vol-0123456789abcdef"), 404, "volume_not_found")
        expect_error(
            owner.post("/v1/sandboxes", {"volumes": [mount("nope", "/data")]}), 404, "volume_not_found"
        )
    finally:
        expect_status(owner.delete(f"/v1/volumes/{v['id']}"), 204)


def test_volumes_count_toward_the_keys_disk_quota(daemon: Daemon):
    limited = daemon.new_client("volume-quota", "--max-disk-mib", "1024")
    v = make(limited, "half", 600)
    try:
        usage = limited.get("/v1/usage").json()
        assert usage["volumes"] == 1 and usage["volume_mib"] == 600 and usage["disk_mib"] >= 600, usage
        expect_error(limited.post("/v1/volumes", {"name": "more", "size_mib": 600}), 429, "quota_exceeded")
        expect_error(limited.request("PATCH", "/v1/volumes/half", json={"size_mib": 1100}), 429, "quota_exceeded")
        assert "more" not in [x["name"] for x in limited.get("/v1/volumes").json()["volumes"]]
        assert limited.get("/v1/volumes/half").json()["size_mib"] == 600
    finally:
        expect_status(limited.delete(f"/v1/volumes/{v['id']}"), 204)


def test_volumes_and_their_claims_survive_a_restart(own_daemon: Daemon):
    d = own_daemon
    d.start()
    api = d.client()
    v = make(api, "durable", 32)
    sb = api.create(volumes=[mount("durable", "/data")])
    api.sh(sb["id"], "echo across > /data/a")
    d.stop()
    d.start()
    got = api.get("/v1/volumes/durable").json()
    assert got["id"] == v["id"] and got["size_mib"] == 32, got
    assert [h["sandbox_id"] for h in got["mounted_by"]] == [sb["id"]], got
    assert api.sh(sb["id"], "cat /data/a") == "across\n"
    expect_error(api.post("/v1/sandboxes", {"volumes": [mount("durable", "/data")]}), 409, "volume_in_use")
    api.destroy(sb["id"])
    # A daemon killed with a sandbox holding it: the recovery ends the
    # sandbox's claim with it.
    sb = api.create(volumes=[mount("durable", "/data")])
    d.kill9()
    d.start()
    state = api.sandbox(sb["id"])["state"]
    if state in ("running", "paused", "suspended"):
        api.destroy(sb["id"])
    wait_for("the claim to go", lambda: api.get("/v1/volumes/durable").json()["mounted_by"] == [])
    sb = api.create(volumes=[mount("durable", "/data", True)])
    assert api.sh(sb["id"], "cat /data/a") == "across\n"
    api.destroy(sb["id"])
    expect_status(api.delete("/v1/volumes/durable"), 204)
    assert volume_dirs(d) == set()


def test_the_cli_makes_mounts_resizes_and_deletes_volumes(api: Client, daemon: Daemon):
    def cli(*args: str) -> str:
        p = daemon.cli(*args, "--url", daemon.base)
        assert p.returncode == 0, p.stderr
        return p.stdout

    vid = cli("volume", "create", "from-cli", "--size", "64M").strip()
    try:
        assert vid.startswith("vol-")
        assert "from-cli" in cli("volume", "list")
        made = cli("sandbox", "create", "--volume", "from-cli:/data:ro", "--quiet").strip()
        try:
            assert "/data (read-only)" in cli("volume", "show", "from-cli")
            assert "Read-only" in api.exec(made, "touch /data/x 2>&1")["stdout"]
        finally:
            api.destroy(made)
        cli("volume", "resize", "from-cli", "128M")
        assert api.get(f"/v1/volumes/{vid}").json()["size_mib"] == 128
        p = daemon.cli("volume", "resize", "from-cli", "64M", "--url", daemon.base)
        assert p.returncode != 0 and "shrink" in p.stderr, p.stderr
        cli("volume", "rm", "from-cli")
        expect_error(api.get(f"/v1/volumes/{vid}"), 404, "volume_not_found")
    finally:
        api.delete(f"/v1/volumes/{vid}")


def test_a_symlink_in_the_image_cannot_redirect_a_mount(api: Client):
    src = api.create()
    try:
        api.sh(src["id"], "ln -s /etc /workspace/link && mkdir /workspace/real")
        snap = api.post(f"/v1/sandboxes/{src['id']}/snapshots", {})
        expect_status(snap, 201)
        snap = snap.json()
    finally:
        api.destroy(src["id"])
    try:
        with volume(api, "nofollow"):
            for path in ("/workspace/link", "/workspace/link/sub"):
                r = api.post("/v1/sandboxes", {"snapshot": snap["id"], "volumes": [mount("nofollow", path)],
                                               "wait_seconds": 30})
                expect_error(r, 503, "sandbox_start_failed")
                # Its failed start released the claim.
                assert api.get("/v1/volumes/nofollow").json()["mounted_by"] == []
            sb = api.create(snapshot=snap["id"], volumes=[mount("nofollow", "/workspace/real/v")])
            try:
                assert api.sh(sb["id"], "readlink /workspace/link; ls /workspace/real/v | wc -l") == "/etc\n0\n"
                assert api.exec(sb["id"], "test -e /etc/passwd")["exit_code"] == 0
            finally:
                api.destroy(sb["id"])
    finally:
        expect_status(api.delete(f"/v1/snapshots/{snap['id']}"), 204)
