"""Disk-backed writable layers: every sandbox's files live in a layer of the
daemon's storage (a btrfs subvolume under <state>/storage) limited to its
`disk_mib`, which no longer counts toward its memory; `"storage": "memory"`
keeps the old tmpfs layer. Layers go with their sandboxes, and a daemon
sweeps only its own storage."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import Client, Daemon, expect_error, expect_status, wait_for

MiB = 1 << 20


def layers_dir(d: Daemon) -> Path:
    return d.state_dir / "storage" / "fs" / "sandboxes"


def layer_names(d: Daemon) -> set[str]:
    p = layers_dir(d)
    return {e.name for e in p.iterdir()} if p.is_dir() else set()


def mounted_fstype(path: Path) -> str | None:
    found = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" ")
        if fields[4] == str(path):
            found = fields[fields.index("-") + 1]
    return found


def test_the_daemon_mounts_its_btrfs_storage_and_doctor_reports_it(daemon: Daemon):
    fs = daemon.state_dir / "storage" / "fs"
    assert mounted_fstype(fs) == "btrfs", "the storage image is not mounted"
    assert (daemon.state_dir / "storage" / "btrfs.img").is_file()
    assert (daemon.state_dir / "storage").stat().st_mode & 0o777 == 0o700
    p = daemon.cli("doctor", "--json")
    report = json.loads(p.stdout)
    storage = next(f for f in report["findings"] if f["name"] == "storage")
    assert storage["ok"], storage
    assert "btrfs on" in storage["detail"] and str(fs) in storage["detail"], storage
    assert "GiB used" in storage["detail"] and "quotas" in storage["detail"], storage


def test_a_sandbox_gets_a_disk_layer_by_default_and_loses_it_when_deleted(api: Client, daemon: Daemon):
    sb = api.create()
    sid = sb["id"]
    try:
        assert sb["storage"] == "disk", sb
        assert sid in layer_names(daemon)
        api.sh(sid, "echo hello > /workspace/f")
        api.sh(sid, "echo etc > /etc/changed", user="root")
        # The layer holds the sandbox's writes with the image's ids (1000 is
        # the sandbox's user), not the host range the sandbox runs in.
        upper = layers_dir(daemon) / sid / "upper"
        st = (upper / "workspace" / "f").stat()
        assert (st.st_uid, st.st_gid) == (1000, 1000), st
        assert (upper / "etc" / "changed").stat().st_uid == 0
        # A user's view is as before.
        assert api.sh(sid, "stat -c %U:%G /workspace/f") == "user:user\n"
        assert api.sh(sid, "stat -c %U /etc/changed") == "root\n"
    finally:
        api.destroy(sid)
    assert sid not in layer_names(daemon), "the sandbox's layer outlived it"


def test_a_256_mib_sandbox_writes_more_than_a_gib(api: Client, daemon: Daemon):
    sb = api.create(memory_mb=256, limits={"disk_mib": 2048})
    sid = sb["id"]
    try:
        r = api.exec(sid, "dd if=/dev/zero of=/workspace/big bs=1M count=1280 conv=fsync status=none; echo $?",
                     timeout_seconds=240)
        assert r["stdout"] == "0\n" and not r.get("oom_killed"), r
        assert api.sh(sid, "stat -c %s /workspace/big") == f"{1280 * MiB}\n"
        assert api.sh(sid, "echo alive") == "alive\n"
    finally:
        api.destroy(sid)


def test_writes_past_disk_mib_fail_with_a_full_disk(api: Client):
    sb = api.create(limits={"disk_mib": 64})
    sid = sb["id"]
    try:
        r = api.exec(sid, "dd if=/dev/zero of=/workspace/fill bs=1M count=100 conv=fsync 2>&1; echo rc=$?")
        assert "rc=0" not in r["stdout"], r
        assert "Disk quota exceeded" in r["stdout"] or "No space left" in r["stdout"], r
        size = int(api.sh(sid, "stat -c %s /workspace/fill"))
        assert size <= 64 * MiB, size
        # The file API says the same, with its stable code.
        r = api.request("PUT", f"/v1/sandboxes/{sid}/files", params={"path": "more.bin"}, data=os.urandom(80 * MiB))
        expect_error(r, 409, "sandbox_disk_full")
        # Space freed is space again.
        api.sh(sid, "rm -f /workspace/fill more.bin && sync")
        r = wait_for("the freed space to count", lambda: api.exec(
            sid, "dd if=/dev/zero of=/workspace/again bs=1M count=32 conv=fsync status=none && echo ok")["stdout"]
            == "ok\n", timeout=30, interval=0.5)
        assert r
    finally:
        api.destroy(sid)


def test_a_memory_layer_is_a_tmpfs_that_counts_toward_memory(api: Client, daemon: Daemon):
    sb = api.create(storage="memory", limits={"disk_mib": 64})
    sid = sb["id"]
    try:
        assert sb["storage"] == "memory", sb
        assert api.sandbox(sid)["storage"] == "memory"
        assert sid not in layer_names(daemon)
        api.sh(sid, "echo hi > /workspace/f")
        assert api.sh(sid, "cat /workspace/f") == "hi\n"
        r = api.exec(sid, "dd if=/dev/zero of=/workspace/fill bs=1M count=100 2>&1; echo rc=$?")
        assert "No space left on device" in r["stdout"] and "rc=0" not in r["stdout"], r
    finally:
        api.destroy(sid)
    # Its files are its memory: 300 MiB do not fit in 128 MiB, where a disk
    # layer takes them.
    small = {"memory_mb": 128, "limits": {"disk_mib": 1024}}
    sb = api.create(storage="memory", **small)
    try:
        r = api.exec(sb["id"], "dd if=/dev/zero of=/workspace/fill bs=1M count=300 status=none")
        assert r["exit_code"] != 0, r
    finally:
        api.destroy(sb["id"])
    sb = api.create(**small)
    try:
        r = api.exec(sb["id"], "dd if=/dev/zero of=/workspace/fill bs=1M count=300 conv=fsync status=none")
        assert r["exit_code"] == 0, r
    finally:
        api.destroy(sb["id"])


def test_storage_is_checked_and_a_templates_choice_applies(api: Client, daemon: Daemon):
    expect_error(api.post("/v1/sandboxes", {"storage": "floppy"}), 400, "invalid_request")
    r = api.post("/v1/templates", {"name": "in-memory", "image": "base", "storage": "memory"})
    expect_status(r, 201)
    tpl = r.json()
    try:
        assert tpl["storage"] == "memory", tpl
        sb = api.create(template="in-memory")
        assert sb["storage"] == "memory", sb
        api.destroy(sb["id"])
        sb = api.create(template="in-memory", storage="disk")
        assert sb["storage"] == "disk", sb
        assert sb["id"] in layer_names(daemon)
        api.destroy(sb["id"])
    finally:
        expect_status(api.delete(f"/v1/templates/{tpl['id']}"), (204, 404))


def test_a_restart_keeps_live_layers_and_sweeps_only_dead_ones(own_daemon: Daemon):
    d = own_daemon
    d.start()
    api = d.client()
    kept = api.create()
    gone = api.create()
    api.sh(kept["id"], "echo still-here > /workspace/kept")
    api.destroy(gone["id"])
    d.stop()
    # What a daemon killed mid-teardown, or a create cut short, could leave:
    # a layer no live sandbox has, and one of a sandbox that ended.
    (layers_dir(d) / "sb-stray").mkdir()
    subprocess.run(["cp", "-a", str(layers_dir(d) / kept["id"] / "upper"), str(layers_dir(d) / gone["id"])],
                   check=True)
    d.start()
    names = layer_names(d)
    assert kept["id"] in names, names
    assert "sb-stray" not in names and gone["id"] not in names, names
    assert api.sh(kept["id"], "cat /workspace/kept") == "still-here\n"
    api.destroy(kept["id"])
    assert layer_names(d) == set()


def test_a_clean_stop_with_no_sandbox_unmounts_the_storage_and_storage_size_sets_it(own_daemon: Daemon):
    d = own_daemon
    d.extra_env["HUTCH_STORAGE_SIZE"] = "2G"
    d.start()
    fs = d.state_dir / "storage" / "fs"
    image = d.state_dir / "storage" / "btrfs.img"
    assert image.stat().st_size == 2 << 30
    # The image is sparse: it takes host disk as layers fill it.
    assert image.stat().st_blocks * 512 < 1 << 30
    api = d.client()
    # One sandbox may not ask for more disk than the storage has.
    r = api.post("/v1/sandboxes", {"limits": {"disk_mib": 4096}})
    expect_error(r, 429, "sandbox_capacity_unavailable")
    sb = api.create(limits={"disk_mib": 512})
    api.sh(sb["id"], "echo x > /workspace/x")
    api.destroy(sb["id"])
    d.stop()
    assert mounted_fstype(fs) is None, "the storage stayed mounted after a clean stop with no sandbox"
    p = d.cli("doctor", "--json")
    storage = next(f for f in json.loads(p.stdout)["findings"] if f["name"] == "storage")
    assert storage["ok"] and "not mounted" in storage["detail"] and "2.0 GiB" in storage["detail"], storage
    # Started again, it mounts the same image (grown, never shrunk).
    d.extra_env["HUTCH_STORAGE_SIZE"] = "3G"
    d.start()
    assert mounted_fstype(fs) == "btrfs"
    assert image.stat().st_size == 3 << 30
    sb = api.create()
    assert api.sh(sb["id"], "echo ok") == "ok\n"
    api.destroy(sb["id"])


@pytest.mark.parametrize("bad", ["0", "12x", "100"])
def test_a_bad_storage_size_is_refused_at_start(tmp_root: Path, bad: str):
    root = tmp_root / f"bad-size-{bad}"
    root.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HUTCH_")}
    from conftest import DEBUG_BIN
    p = subprocess.run(
        [str(DEBUG_BIN), "serve", "--listen", "127.0.0.1:1", "--state-dir", str(root / "state"), "--storage-size", bad],
        env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode != 0, p
    assert "storage" in (p.stderr + p.stdout).lower(), p
