"""Pause to disk: POST /v1/sandboxes/{id}/suspend {"mode": "disk"} ends the
sandbox's processes and releases its memory but keeps its files (state
`paused`); resume starts a fresh agent on the same layer and runs the
template's startup command again. A paused sandbox survives a daemon
restart and a host reboot (simulated: the daemon stopped, every process of
the sandbox gone, the storage unmounted)."""

from __future__ import annotations

from conftest import Client, Daemon, expect_error, expect_status, leftovers, wait_for


def layers(d: Daemon) -> set[str]:
    p = d.state_dir / "storage" / "fs" / "sandboxes"
    return {e.name for e in p.iterdir()} if p.is_dir() else set()


def pause(api: Client, sid: str) -> dict:
    r = api.post(f"/v1/sandboxes/{sid}/suspend", {"mode": "disk"})
    expect_status(r, 200)
    return r.json()


def test_pause_to_disk_keeps_files_and_ends_processes(api: Client, daemon: Daemon):
    r = api.post("/v1/templates", {"name": "boots", "startup": {"command": "echo boot >> /workspace/boots; exec sleep 100000"},
                                   "readiness": {"command": "test -s /workspace/boots"}})
    expect_status(r, 201)
    tpl = r.json()
    sb = api.create(template="boots")
    sid = sb["id"]
    try:
        api.sh(sid, "echo kept > /workspace/k")
        api.background(sid, "sleep 600")
        assert "sleep 600" in str(api.processes(sid))
        paused = pause(api, sid)
        assert paused["state"] == "paused", paused
        assert api.sandbox(sid)["state"] == "paused"
        # Nothing of it runs on the host; its files stay.
        wait_for("the paused sandbox's processes to end", lambda: not leftovers(daemon.run_dir, sid), timeout=10)
        assert sid in layers(daemon)
        expect_error(api.exec_raw(sid, {"command": "true"}), 409, "sandbox_session_not_running")
        # Pausing again answers as it is; a memory suspend is refused.
        assert pause(api, sid)["state"] == "paused"
        expect_error(api.post(f"/v1/sandboxes/{sid}/suspend", {}), 409, "sandbox_session_not_running")
        r = api.post(f"/v1/sandboxes/{sid}/resume")
        expect_status(r, 200)
        assert r.json()["state"] == "running", r.json()
        assert api.sh(sid, "cat /workspace/k") == "kept\n"
        # A fresh agent: the sleep is gone, the startup command ran again.
        assert "sleep 600" not in str(api.processes(sid)), api.processes(sid)
        assert api.sh(sid, "cat /workspace/boots") == "boot\nboot\n"
        # Paused again, it can be deleted: files and all.
        pause(api, sid)
    finally:
        api.destroy(sid)
        expect_status(api.delete(f"/v1/templates/{tpl['id']}"), (204, 404))
    assert sid not in layers(daemon)


def test_bad_pauses_are_refused(api: Client, daemon: Daemon):
    mem = api.create(storage="memory")
    other = daemon.new_client("pause-other")
    sb = api.create()
    try:
        expect_error(api.post(f"/v1/sandboxes/{mem['id']}/suspend", {"mode": "disk"}), 409, "snapshot_unsupported")
        expect_error(api.post(f"/v1/sandboxes/{sb['id']}/suspend", {"mode": "nap"}), 400, "invalid_request")
        expect_error(other.post(f"/v1/sandboxes/{sb['id']}/suspend", {"mode": "disk"}), 404, "not_found")
        # The memory mode is today's freeze.
        r = api.post(f"/v1/sandboxes/{sb['id']}/suspend", {"mode": "memory"})
        expect_status(r, 200)
        assert r.json()["state"] == "suspended"
        # From suspended, a disk pause ends the frozen processes.
        assert pause(api, sb["id"])["state"] == "paused"
        expect_status(api.post(f"/v1/sandboxes/{sb['id']}/resume"), 200)
        assert api.sh(sb["id"], "echo ok") == "ok\n"
    finally:
        api.destroy(mem["id"])
        api.destroy(sb["id"])


def test_a_paused_sandbox_survives_a_restart_and_a_reboot(own_daemon: Daemon):
    d = own_daemon
    d.start()
    api = d.client()
    sb = api.create()
    sid = sb["id"]
    api.sh(sid, "mkdir -p /workspace/w && seq 1000 > /workspace/w/n")
    pause(api, sid)
    d.stop()
    # The reboot: no process of it is left (pausing ended them), and what
    # hutch mounted is gone.
    assert not leftovers(d.run_dir, sid)
    d.release_storage()
    assert not (d.state_dir / "storage" / "fs" / "sandboxes").exists()
    d.start()
    assert api.sandbox(sid)["state"] == "paused"
    assert sid in layers(d)
    expect_status(api.post(f"/v1/sandboxes/{sid}/resume"), 200)
    assert api.sh(sid, "tail -1 /workspace/w/n") == "1000\n"
    api.destroy(sid)
    assert sid not in layers(d)


def test_on_expire_pause_keeps_the_files_then_paused_ttl_ends_it(api: Client, daemon: Daemon):
    sb = api.create(ttl_seconds=4, on_expire="pause", paused_ttl_seconds=600)
    sid = sb["id"]
    try:
        assert (sb["on_expire"], sb["paused_ttl_seconds"]) == ("pause", 600), sb
        api.sh(sid, "echo kept > /workspace/k")
        # At its expiry it is paused, not ended: its files stay, it is kept
        # for paused_ttl_seconds from then.
        wait_for("the expired sandbox to be paused", lambda: api.sandbox(sid)["state"] == "paused", timeout=30)
        assert sid in layers(daemon)
        r = api.post(f"/v1/sandboxes/{sid}/resume")
        expect_status(r, 200)
        assert api.sh(sid, "cat /workspace/k") == "kept\n"
        # A resume gives it its lifetime again, and with it the same end.
        wait_for("the resumed sandbox to be paused again", lambda: api.sandbox(sid)["state"] == "paused", timeout=30)
        # Kept no longer than paused_ttl_seconds: a short one ends it.
        short = api.create(ttl_seconds=2, on_expire="pause", paused_ttl_seconds=2)
        wait_for("the short-kept sandbox to end",
                 lambda: api.sandbox(short["id"])["state"] == "terminated", timeout=40)
        assert short["id"] not in layers(daemon)
    finally:
        api.destroy(sid)
    assert sid not in layers(daemon)


def test_on_expire_comes_from_the_template_and_is_checked(api: Client):
    r = api.post("/v1/templates", {"name": "keeps", "on_expire": "pause", "paused_ttl_seconds": 3600})
    expect_status(r, 201)
    tpl = r.json()
    try:
        assert (tpl["on_expire"], tpl["paused_ttl_seconds"]) == ("pause", 3600), tpl
        sb = api.create(template="keeps")
        assert (sb["on_expire"], sb["paused_ttl_seconds"]) == ("pause", 3600), sb
        api.destroy(sb["id"])
        # A create's own choice wins over the template's.
        sb = api.create(template="keeps", on_expire="delete")
        assert sb["on_expire"] == "delete", sb
        api.destroy(sb["id"])
        # Pausing keeps files on disk: a memory layer cannot.
        expect_error(api.post("/v1/sandboxes", {"template": "keeps", "storage": "memory"}), 400, "invalid_request")
        expect_error(api.post("/v1/sandboxes", {"on_expire": "pause", "storage": "memory"}), 400, "invalid_request")
        expect_error(api.post("/v1/sandboxes", {"on_expire": "nap"}), 400, "invalid_request")
        for bad in (0, 30 * 86400 + 1):
            expect_error(api.post("/v1/sandboxes", {"paused_ttl_seconds": bad}), 400, "invalid_request")
        expect_error(api.post("/v1/templates", {"name": "mem-keeps", "on_expire": "pause", "storage": "memory"}),
                     400, "invalid_request")
        # An update changes it for sandboxes made from then on.
        r = api.request("PATCH", f"/v1/templates/{tpl['id']}", json={"on_expire": "delete", "paused_ttl_seconds": 60})
        expect_status(r, 200)
        assert (r.json()["on_expire"], r.json()["paused_ttl_seconds"], r.json()["version"]) == ("delete", 60, 1)
        sb = api.create(template="keeps")
        assert (sb["on_expire"], sb["paused_ttl_seconds"]) == ("delete", 60), sb
        api.destroy(sb["id"])
        # Nothing was left by the refusals.
        assert all(t["name"] != "mem-keeps" for t in api.get("/v1/templates").json()["templates"])
    finally:
        expect_status(api.delete(f"/v1/templates/{tpl['id']}"), (204, 404))
