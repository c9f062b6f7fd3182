"""Snapshot export: GET /v1/snapshots/{id}/export (and `hutch snapshot export
ID FILE`) streams an image archive, an OCI layout and a `docker save`
manifest over the same blobs, holding the snapshot's image's layers and the
snapshot's files as the top layer; `hutch image import` reads it back, with
deletions (whiteouts) and replaced directories (opaque) kept. Only the
snapshot's owner (or an admin) may export it; a snapshot of a sandbox on
`base` is refused with 409 snapshot_not_exportable."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
import uuid
from pathlib import Path

from conftest import Client, Daemon, expect_error, expect_status
from test_images import Layer, docker_save, import_archive, sandbox_on, shell_layer, uname


def with_tools(layer: Layer) -> Layer:
    """rm and mkdir (and the libraries mkdir needs) from the host."""
    lib = "usr/lib/x86_64-linux-gnu"
    for so in ("libselinux.so.1", "libpcre2-8.so.0"):
        layer.file(f"{lib}/{so}", Path(os.path.realpath(f"/lib/x86_64-linux-gnu/{so}")).read_bytes(), 0o755)
    return (
        layer.file("usr/bin/rm", Path("/usr/bin/rm").read_bytes(), 0o755)
        .file("usr/bin/mkdir", Path("/usr/bin/mkdir").read_bytes(), 0o755)
    )


def tool_image(daemon: Daemon) -> str:
    """A store image with a shell, rm, mkdir and some data to delete."""
    marker = uuid.uuid4().hex
    layer = (
        with_tools(shell_layer())
        .file("marker", marker.encode())
        .dir("data").file("data/gone", b"lower\n").file("data/kept", b"kept\n")
        .dir("olddir").file("olddir/a", b"a\n").file("olddir/b", b"b\n")
        .bytes()
    )
    name = uname("exp")
    p = import_archive(daemon, docker_save([layer], ["FROM_IMAGE=yes"], "x/exp:1"), "--name", name)
    assert p.returncode == 0, p.stderr
    return name


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def check_archive(data: bytes) -> dict:
    """Checks the archive is one consistent OCI layout and docker-save
    manifest: every digest and size, both manifests naming the same blobs.
    Returns the config and the layer tars."""
    members = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        for m in t.getmembers():
            if m.isfile():
                members[m.name] = t.extractfile(m).read()
    assert json.loads(members["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    for name, blob in members.items():
        if name.startswith("blobs/sha256/"):
            assert sha(blob) == name.rsplit("/", 1)[1], f"{name}: digest"
    index = json.loads(members["index.json"])
    [entry] = index["manifests"]
    manifest_bytes = members["blobs/sha256/" + entry["digest"].split(":")[1]]
    assert entry["size"] == len(manifest_bytes)
    manifest = json.loads(manifest_bytes)
    assert manifest["schemaVersion"] == 2 and manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    config_bytes = members["blobs/sha256/" + manifest["config"]["digest"].split(":")[1]]
    assert manifest["config"]["size"] == len(config_bytes)
    config = json.loads(config_bytes)
    layers = []
    for desc in manifest["layers"]:
        blob = members["blobs/sha256/" + desc["digest"].split(":")[1]]
        assert desc["size"] == len(blob) and desc["mediaType"] == "application/vnd.oci.image.layer.v1.tar"
        layers.append(blob)
    # Uncompressed: each layer's digest is its diff_id.
    assert config["rootfs"]["diff_ids"] == [d["digest"] for d in manifest["layers"]]
    assert len(config["history"]) == len(layers)
    [docker] = json.loads(members["manifest.json"])
    assert docker["Config"] == "blobs/sha256/" + manifest["config"]["digest"].split(":")[1]
    assert docker["Layers"] == ["blobs/sha256/" + d["digest"].split(":")[1] for d in manifest["layers"]]
    assert docker["RepoTags"] == [entry["annotations"]["org.opencontainers.image.ref.name"]]
    return {"config": config, "layers": layers}


def layer_names(layer: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(layer)) as t:
        return {m.name: m for m in t.getmembers()}


def test_an_exported_snapshot_is_a_consistent_archive_that_imports_and_runs(daemon: Daemon, api: Client, tmp_path):
    image = tool_image(daemon)
    tpl, sb = sandbox_on(api, image, env={"FROM_SANDBOX": "yes"})
    back = uname("back")
    tpl2 = None
    try:
        sid = sb["id"]
        api.sh(sid, "echo mine > /workspace/keep")
        api.sh(sid, "rm /data/gone && rm -r /olddir && mkdir /olddir && echo new > /olddir/new", user="root")
        snap = api.post(f"/v1/sandboxes/{sid}/snapshots", {"name": uname("s")}).json()
        r = api.get(f"/v1/snapshots/{snap['name']}/export")
        expect_status(r, 200)
        assert r.headers["content-type"] == "application/x-tar"
        assert r.headers["content-disposition"] == f'attachment; filename="{snap["id"]}.tar"'
        assert int(r.headers["content-length"]) == len(r.content)
        got = check_archive(r.content)
        cfg = got["config"]
        assert cfg["os"] == "linux" and cfg["created"], cfg
        assert "FROM_IMAGE=yes" in cfg["config"]["Env"] and "FROM_SANDBOX=yes" in cfg["config"]["Env"], cfg
        assert cfg["config"]["WorkingDir"] == "/workspace" and cfg["config"]["User"] == "1000:1000"
        assert cfg["config"]["Labels"]["dev.hutch.snapshot"] == snap["id"]
        # The image's layer and its generated top layer, then the snapshot's.
        assert len(got["layers"]) == 3
        top = layer_names(got["layers"][-1])
        assert "workspace/keep" in top and "data/.wh.gone" in top, sorted(top)
        assert "olddir/.wh..wh..opq" in top and "olddir/new" in top, sorted(top)
        assert top["workspace/keep"].uid == 1000, "image ids, not the sandbox's host range"
        # Another OCI implementation applies the layers the same way.
        layout = tmp_path / "layout"
        layout.mkdir()
        subprocess.run(["tar", "-x", "-C", str(layout)], input=r.content, check=True, timeout=60)
        bundle = tmp_path / "bundle"
        p = subprocess.run(["umoci", "unpack", "--image", f"{layout}:{snap['id']}:latest", str(bundle)],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        rootfs = bundle / "rootfs"
        assert (rootfs / "workspace/keep").read_text() == "mine\n"
        assert sorted(os.listdir(rootfs / "data")) == ["kept"]
        assert sorted(os.listdir(rootfs / "olddir")) == ["new"]
        assert (rootfs / "workspace/keep").stat().st_uid == 1000
        # The same snapshot exports to the same bytes (what lets the daemon
        # measure first and stream second).
        assert api.get(f"/v1/snapshots/{snap['id']}/export").content == r.content

        # `hutch snapshot export` writes the same archive; our import reads it.
        out = tmp_path / "snap.tar"
        p = daemon.cli("snapshot", "export", snap["id"], str(out), "--url", daemon.base)
        assert p.returncode == 0, p.stderr
        assert out.read_bytes() == r.content
        p = daemon.cli("image", "import", str(out), "--name", back, "--url", daemon.base, timeout=120)
        assert p.returncode == 0, p.stderr
        tpl2, sb2 = sandbox_on(api, back)
        s2 = sb2["id"]
        assert api.sh(s2, "cat /workspace/keep /data/kept /olddir/new") == "mine\nkept\nnew\n"
        listing = api.sh(s2, "for p in /data/gone /olddir/a /olddir/b; do test -e $p && echo $p; done; echo end")
        assert listing == "end\n", "deleted files stay deleted"
        assert api.sh(s2, "echo $FROM_IMAGE $FROM_SANDBOX") == "yes yes\n"
        api.destroy(s2)
    finally:
        api.destroy(sb["id"])
        for t in (tpl, tpl2):
            if t:
                expect_status(api.delete(f"/v1/templates/{t['id']}"), 204)
        daemon.cli("image", "rm", back, "--url", daemon.base)
        daemon.cli("image", "rm", image, "--url", daemon.base)


def test_export_refuses_base_and_unknown_and_other_keys_snapshots(daemon: Daemon, api: Client):
    other = daemon.new_client("export-other")
    sb = api.create()
    try:
        snap = api.post(f"/v1/sandboxes/{sb['id']}/snapshots", {"name": "on-base"}).json()
        # A sandbox on `base`: the host's files are no image layers.
        e = expect_error(api.get(f"/v1/snapshots/{snap['id']}/export"), 409, "snapshot_not_exportable")
        assert "base" in e["error"], e
        p = daemon.cli("snapshot", "export", snap["id"], "-", "--url", daemon.base)
        assert p.returncode != 0 and "snapshot_not_exportable" in p.stderr + p.stdout, (p.stdout, p.stderr)
        # Another key's snapshot is as unknown as one that does not exist.
        for ref in (snap["id"], "on-base"):
            expect_error(other.get(f"/v1/snapshots/{ref}/export"), 404, "not_found")
        for ref in ("snap-0123456789abcdef", "no-such-name", "snap-x"):
            expect_error(api.get(f"/v1/snapshots/{ref}/export"), 404, "not_found")
        expect_status(api.delete(f"/v1/snapshots/{snap['id']}"), 204)
    finally:
        api.destroy(sb["id"])


def test_another_key_cannot_export_a_store_image_snapshot(daemon: Daemon, api: Client):
    image = tool_image(daemon)
    owner = daemon.new_client("export-owner")
    other = daemon.new_client("export-stranger")
    tpl = None
    try:
        tpl, sb = sandbox_on(owner, image)
        try:
            snap = owner.post(f"/v1/sandboxes/{sb['id']}/snapshots", {"name": "mine"}).json()
            expect_error(other.get(f"/v1/snapshots/{snap['id']}/export"), 404, "not_found")
            expect_error(other.get("/v1/snapshots/mine/export"), 404, "not_found")
            # Its owner and an admin key may.
            for c in (owner, api):
                expect_status(c.get(f"/v1/snapshots/{snap['id']}/export"), 200)
        finally:
            owner.destroy(sb["id"])
    finally:
        if tpl:
            expect_status(owner.delete(f"/v1/templates/{tpl['id']}"), 204)
        daemon.cli("image", "rm", image, "--url", daemon.base)
