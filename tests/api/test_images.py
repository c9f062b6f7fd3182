"""Images: `docker save` and OCI-layout imports, pulls from a registry (Debian's
`docker-registry` started here on loopback, and a small lying registry for
digest and token checks), the `python` preset built with mmdebstrap, and
sandboxes created on each through the daemon's API with a template.

Every image is built by the tests themselves: a layer holding the host's dash
as /bin/sh, cat, and the C library they need, plus layers of whiteouts."""

from __future__ import annotations

import gzip
import http.server
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import uuid
from pathlib import Path

import pytest
import requests

from conftest import Client, Daemon, expect_error, expect_status, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from oci_images import (  # noqa: E402
    OCI_INDEX, OCI_MANIFEST, Layer, Registry, config_json, oci_image, sha, shell_layer,
)


def uname(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# --------------------------------------------------------------------------
# Building layers and archives


def two_layers(marker: str = "") -> list[bytes]:
    """A shell with data, then a layer that hides some of it; a `marker`
    file makes layers no other test has imported."""
    lower = (
        shell_layer()
        .file("marker", marker.encode())
        .dir("data").file("data/gone", b"lower\n").file("data/kept", b"kept\n")
        .dir("opq").file("opq/old", b"old\n")
        .bytes()
    )
    upper = (
        Layer().file("data/.wh.gone", b"").file("opq/.wh..wh..opq", b"").file("opq/new", b"new\n")
        .file("marker", marker.encode()).bytes()
    )
    return [lower, upper]


def tar_of(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime = len(data), 0o644, 1_700_000_000
            t.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def docker_save(layers: list[bytes], env: list[str], tag: str) -> bytes:
    """The classic `docker save` layout: <id>/layer.tar and <hex>.json."""
    config = config_json(layers, env)
    members = {f"{sha(config)}.json": config}
    names = []
    for i, l in enumerate(layers):
        names.append(f"{i:064x}/layer.tar")
        members[names[-1]] = l
    manifest = [{"Config": f"{sha(config)}.json", "RepoTags": [tag], "Layers": names}]
    return tar_of({"manifest.json": json.dumps(manifest).encode(), **members})


def index_of(manifest: bytes) -> bytes:
    """An index naming an arm64 decoy and the linux/amd64 manifest."""
    return json.dumps({
        "schemaVersion": 2, "mediaType": OCI_INDEX,
        "manifests": [
            {"mediaType": OCI_MANIFEST, "digest": "sha256:" + "1" * 64, "size": 10,
             "platform": {"architecture": "arm64", "os": "linux"}},
            {"mediaType": OCI_MANIFEST, "digest": f"sha256:{sha(manifest)}", "size": len(manifest),
             "platform": {"architecture": "amd64", "os": "linux"}},
        ],
    }).encode()


def oci_layout(layers: list[bytes], env: list[str], tag: str) -> bytes:
    blobs, manifest, _ = oci_image(layers, env)
    index = index_of(manifest)
    blobs[f"sha256:{sha(index)}"] = index
    top = json.dumps({
        "schemaVersion": 2,
        "manifests": [{"mediaType": OCI_INDEX, "digest": f"sha256:{sha(index)}", "size": len(index),
                       "annotations": {"org.opencontainers.image.ref.name": tag}}],
    }).encode()
    members = {"oci-layout": b'{"imageLayoutVersion": "1.0.0"}', "index.json": top}
    members.update({f"blobs/sha256/{d.split(':')[1]}": b for d, b in blobs.items()})
    return tar_of(members)


# --------------------------------------------------------------------------
# Running on an image


def image_cli(daemon: Daemon, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`hutch image ARGS` through the daemon's API, with its admin key."""
    return daemon.cli("image", *args, "--url", daemon.base, timeout=timeout)


def import_archive(daemon: Daemon, data: bytes, *args: str) -> subprocess.CompletedProcess:
    path = daemon.root / f"{uuid.uuid4().hex}.tar"
    path.write_bytes(data)
    try:
        return image_cli(daemon, "import", str(path), *args)
    finally:
        path.unlink()


def sandbox_on(api: Client, image: str, env: dict | None = None, wait: int = 30) -> tuple[dict, dict]:
    """A template on `image` and a running sandbox of it."""
    r = api.post("/v1/templates", {"name": uname("img"), "image": image, "env": env or {}})
    expect_status(r, 201)
    tpl = r.json()
    assert tpl["image"] == image, tpl
    sb = api.create(template=tpl["name"], wait_seconds=wait)
    return tpl, sb


def check_layers_apply(api: Client, sb: dict) -> None:
    out = api.sh(sb["id"], "for p in /data/gone /data/kept /opq/old /opq/new; do "
                           "if [ -e $p ]; then echo $p yes; else echo $p no; fi; done; cat /data/kept")
    assert out.split("\n")[:5] == ["/data/gone no", "/data/kept yes", "/opq/old no", "/opq/new yes", "kept"], out


def image_names(api: Client) -> dict[str, dict]:
    r = api.get("/v1/images")
    expect_status(r, 200)
    return {i["name"]: i for i in r.json()["images"]}


# --------------------------------------------------------------------------
# Imports


def test_docker_save_import_runs_a_sandbox_with_the_images_env(daemon: Daemon, api: Client):
    name = uname("dsave")
    p = import_archive(daemon, docker_save(two_layers(), ["FROM_IMAGE=yes", "OVERRIDE=image"], "x/y:1"),
                       "--name", name)
    assert p.returncode == 0, p.stderr
    assert f"{name} (3 layers" in p.stdout, p.stdout
    info = image_names(api)[name]
    assert info["layers"] == 3 and info["size_bytes"] > 100_000 and info["source"].startswith("import:"), info
    tpl, sb = sandbox_on(api, name, env={"OVERRIDE": "template"})
    check_layers_apply(api, sb)
    # The image's env is applied; the template's wins where both set a name.
    assert api.sh(sb["id"], "echo $FROM_IMAGE $OVERRIDE") == "yes template\n"
    # The agent's assumptions hold: user 1000 in /workspace, root available.
    assert api.sh(sb["id"], "echo $HOME; pwd; cat /etc/passwd").split("\n")[:2] == ["/home/user", "/workspace"]
    assert api.sh(sb["id"], "echo hi > /workspace/f && cat /workspace/f") == "hi\n"
    out = api.sh(sb["id"], "cat /etc/passwd")
    assert "user:x:1000:1000:user:/home/user:/bin/sh" in out and out.startswith("root:"), out
    api.destroy(sb["id"])
    expect_status(api.delete(f"/v1/templates/{tpl['id']}"), 204)


def test_oci_layout_import_with_gzip_layers_and_an_index(daemon: Daemon, api: Client):
    # The archive itself compressed too, as `docker save | gzip` makes them.
    p = import_archive(daemon, gzip.compress(oci_layout(two_layers(), ["A=1"], "oci-test"), mtime=0))
    assert p.returncode == 0, p.stderr
    # The ref name annotation names the image.
    assert "oci-test (3 layers" in p.stdout, p.stdout
    tpl, sb = sandbox_on(api, "oci-test")
    check_layers_apply(api, sb)
    assert api.sh(sb["id"], "echo $A") == "1\n"
    api.destroy(sb["id"])
    expect_status(api.delete(f"/v1/templates/{tpl['id']}"), 204)
    p = image_cli(daemon, "rm", "oci-test")
    assert p.returncode == 0, p.stderr
    assert "oci-test" not in image_names(api)


def test_imports_with_a_wrong_digest_or_a_hostile_layer_are_refused_whole(daemon: Daemon, api: Client):
    before = image_names(api)
    # An OCI blob whose content does not match its name.
    layers = two_layers(uuid.uuid4().hex)
    good = oci_layout(layers, [], "tampered")
    buf = io.BytesIO(good)
    members = {}
    with tarfile.open(fileobj=buf) as t:
        for m in t.getmembers():
            members[m.name] = t.extractfile(m).read()
    victim = next(n for n, b in members.items() if n.startswith("blobs/") and b[:2] == b"\x1f\x8b")
    # Same size, same content once decompressed: only the gzip header's
    # timestamp differs, so only the blob digest can tell.
    blob = bytearray(members[victim])
    blob[4] ^= 0xFF
    members[victim] = bytes(blob)
    p = import_archive(daemon, tar_of(members))
    assert p.returncode != 0
    assert "digest mismatch" in p.stderr and "image_layer_refused" in p.stderr, p.stderr
    # A layer that writes through its own symlink to /etc.
    probe = f"hutch-probe-{uuid.uuid4().hex[:8]}"
    hostile = Layer().symlink("x", "/etc").file(f"x/{probe}", b"owned").bytes()
    p = import_archive(daemon, docker_save([hostile], [], "hostile:1"))
    assert p.returncode != 0 and "image_layer_refused" in p.stderr and "symlink" in p.stderr, p.stderr
    assert not Path("/etc", probe).exists()
    # Not an image archive at all.
    p = import_archive(daemon, tar_of({"hello.txt": b"hi"}))
    assert p.returncode != 0 and "image_invalid" in p.stderr, p.stderr
    assert image_names(api) == before
    assert not any((daemon.state_dir / "images" / "tmp").iterdir())


def api_import(c: Client, data: bytes, **params: str) -> requests.Response:
    """`POST /v1/images/import` with `data` streamed as a chunked body."""
    def chunks():
        for i in range(0, len(data), 64 << 10):
            yield data[i:i + (64 << 10)]
    return c.request("POST", "/v1/images/import", params=params, data=chunks(), timeout=120,
                     headers={"Content-Type": "application/x-tar"})


def image_tmp(daemon: Daemon) -> list[Path]:
    return list((daemon.state_dir / "images" / "tmp").iterdir())


def test_import_through_the_api_then_delete(daemon: Daemon, api: Client):
    name = uname("apiimp")
    # A gzip-compressed `docker save`, streamed in chunks (no Content-Length).
    archive = gzip.compress(docker_save(two_layers(uuid.uuid4().hex), ["VIA=api"], "x/api:1"), mtime=0)
    r = api_import(api, archive, name=name, filename="app.tar.gz")
    expect_status(r, 201)
    info = r.json()
    assert info["name"] == name and info["layers"] == 3 and info["source"] == "import:app.tar.gz", info
    assert info["size_bytes"] > 100_000, info
    assert image_names(api)[name]["source"] == "import:app.tar.gz"
    # Without a name: the archive's tag names it.
    r = api_import(api, docker_save(two_layers(), [], "x/api-tagged:2"))
    expect_status(r, 201)
    assert r.json()["name"] == "x-api-tagged-2", r.json()
    tpl, sb = sandbox_on(api, name)
    try:
        check_layers_apply(api, sb)
        assert api.sh(sb["id"], "echo $VIA") == "api\n"
        # A template stands on it: removing it would break the template.
        e = expect_error(api.delete(f"/v1/images/{name}"), 409, "conflict")
        assert tpl["name"] in e["error"] or "template" in e["error"], e
    finally:
        api.destroy(sb["id"])
        expect_status(api.delete(f"/v1/templates/{tpl['id']}"), 204)
    expect_status(api.delete(f"/v1/images/{name}"), 204)
    expect_status(api.delete("/v1/images/x-api-tagged-2"), 204)
    names = image_names(api)
    assert name not in names and "x-api-tagged-2" not in names
    expect_error(api.delete(f"/v1/images/{name}"), 400, "image_not_found")
    expect_error(api.delete("/v1/images/base"), 400, "image_not_found")
    assert not image_tmp(daemon)


def test_bad_archives_through_the_api_leave_nothing(daemon: Daemon, api: Client):
    before = image_names(api)
    # Not an image archive at all.
    expect_error(api_import(api, tar_of({"hello.txt": b"hi"}), name=uname("bad")), 400, "image_invalid")
    # Not even a tar, gzip that breaks off.
    expect_error(api_import(api, b"\x1f\x8b" + os.urandom(4096), name=uname("bad")), 400, "image_invalid")
    # A layer that writes through its own symlink to /etc.
    probe = f"hutch-probe-{uuid.uuid4().hex[:8]}"
    hostile = Layer().symlink("x", "/etc").file(f"x/{probe}", b"owned").bytes()
    e = expect_error(api_import(api, docker_save([hostile], [], "hostile:1"), name=uname("bad")), 400,
                     "image_layer_refused")
    assert "symlink" in e["error"], e
    assert not Path("/etc", probe).exists()
    # Names that are not an image's, refused before the body is read.
    for bad in ("base", "tpl-mine", "UPPER", "a/b", "-x"):
        expect_error(api_import(api, docker_save(two_layers(), [], "ok:1"), name=bad), 400, "image_invalid")
    # `check` answers what an import would get, reading no archive.
    check = lambda **q: api.request("POST", "/v1/images/import", params={"check": "true", **q})  # noqa: E731
    expect_status(check(size="1000", name=uname("ok")), 204)
    expect_error(check(size=str(17 << 30)), 413, "payload_too_large")
    expect_error(check(name="base"), 400, "image_invalid")
    # The CLI says the same, with the code.
    p = import_archive(daemon, tar_of({"hello.txt": b"hi"}), "--name", uname("bad"))
    assert p.returncode != 0 and "image_invalid" in p.stderr, p.stderr
    assert image_names(api) == before
    assert not image_tmp(daemon)


def test_only_an_admin_key_changes_the_shared_images(daemon: Daemon, api: Client, registry: "Registry"):
    other = daemon.new_client("img-tenant")
    before = image_names(api)
    archive = docker_save(two_layers(), [], "tenant/img:1")
    e = expect_error(api_import(other, archive, name=uname("tenant")), 403, "forbidden")
    assert "admin" in e["error"], e
    expect_error(other.post("/v1/images/pull", {"reference": f"127.0.0.1:{registry.port}/x:1"}), 403, "forbidden")
    some = next(iter(before), "python")
    expect_error(other.delete(f"/v1/images/{some}"), 403, "forbidden")
    expect_error(other.post("/v1/images/gc"), 403, "forbidden")
    expect_error(other.request("POST", "/v1/images/import", params={"check": "true"}), 403, "forbidden")
    # The CLI with that key is refused the same way, through the API.
    path = daemon.root / f"{uuid.uuid4().hex}.tar"
    path.write_bytes(archive)
    try:
        env = {"HUTCH_URL": daemon.base, "HUTCH_API_KEY": other.key, "PATH": os.environ["PATH"]}
        p = subprocess.run([str(daemon.binary), "image", "import", str(path)], env=env, capture_output=True,
                           text=True, timeout=60)
    finally:
        path.unlink()
    assert p.returncode != 0 and "forbidden" in p.stderr, p.stderr
    # It still lists what it may name.
    expect_status(other.get("/v1/images"), 200)
    assert image_names(api) == before
    assert not image_tmp(daemon)


def test_templates_name_only_existing_images(api: Client):
    expect_error(api.post("/v1/templates", {"name": uname("t"), "image": "nothing-here"}), 400, "image_not_found")
    # Presets are accepted before they are built (they build on first use).
    r = api.post("/v1/templates", {"name": uname("t"), "image": "node"})
    expect_status(r, 201)
    expect_status(api.delete(f"/v1/templates/{r.json()['id']}"), 204)


# --------------------------------------------------------------------------
# Pulls


@pytest.fixture
def registry(tmp_root: Path):
    reg = Registry(tmp_root)
    try:
        yield reg
    finally:
        reg.stop()


def test_pull_from_a_local_registry_then_run(daemon: Daemon, api: Client, registry: Registry):
    # Layers no earlier test imported, so that the pull downloads them.
    blobs, manifest, _ = oci_image(two_layers(uuid.uuid4().hex), ["PULLED=1"])
    repo = "test/app"
    for d, b in blobs.items():
        if b != manifest:
            registry.push_blob(repo, d, b)
    registry.push_manifest(repo, "1", manifest, OCI_MANIFEST)
    # A multi-platform tag: the index names the manifest by digest.
    registry.push_manifest(repo, f"sha256:{sha(manifest)}", manifest, OCI_MANIFEST)
    index = json.loads(index_of(manifest))
    index["manifests"] = index["manifests"][1:]
    registry.push_manifest(repo, "multi", json.dumps(index).encode(), OCI_INDEX)

    ref = f"127.0.0.1:{registry.port}/{repo}:1"
    p = image_cli(daemon, "pull", ref, timeout=120)
    assert p.returncode == 0, p.stderr
    local = f"127.0.0.1-{registry.port}-test-app-1"
    assert f"{local} (3 layers" in p.stdout, p.stdout
    p = image_cli(daemon, "pull", f"127.0.0.1:{registry.port}/{repo}:multi", "--name", "pulled-multi", timeout=120)
    assert p.returncode == 0, p.stderr
    images = image_names(api)
    assert images[local]["source"] == f"pull:{ref}", images[local]
    tpl, sb = sandbox_on(api, "pulled-multi")
    check_layers_apply(api, sb)
    assert api.sh(sb["id"], "echo $PULLED") == "1\n"
    api.destroy(sb["id"])
    expect_status(api.delete(f"/v1/templates/{tpl['id']}"), 204)
    p = image_cli(daemon, "pull", f"127.0.0.1:{registry.port}/{repo}:nope", timeout=60)
    assert p.returncode != 0 and "registry_error" in p.stderr, p.stderr


def test_pull_through_the_api(daemon: Daemon, api: Client, registry: Registry):
    blobs, manifest, _ = oci_image(two_layers(uuid.uuid4().hex), ["PULLED_API=1"])
    repo = "test/viaapi"
    for d, b in blobs.items():
        if b != manifest:
            registry.push_blob(repo, d, b)
    registry.push_manifest(repo, "1", manifest, OCI_MANIFEST)
    name = uname("pulled")
    r = api.post("/v1/images/pull", {"reference": f"127.0.0.1:{registry.port}/{repo}:1", "name": name},
                 timeout=120)
    expect_status(r, 201)
    info = r.json()
    assert info["name"] == name and info["layers"] == 3, info
    assert info["source"] == f"pull:127.0.0.1:{registry.port}/{repo}:1", info
    assert name in image_names(api)
    e = expect_error(api.post("/v1/images/pull", {"reference": f"127.0.0.1:{registry.port}/{repo}:nope"},
                              timeout=60), 502, "registry_error")
    assert "nope" in e["error"] or "manifest" in e["error"], e
    expect_error(api.post("/v1/images/pull", {"reference": "Not A Ref"}), 400, "invalid_request")
    expect_error(api.post("/v1/images/pull", {"reference": "x", "bogus": 1}), 400, "invalid_request")
    p = image_cli(daemon, "rm", name)
    assert p.returncode == 0 and f"removed {name}" in p.stdout, p.stderr
    assert name not in image_names(api)
    p = image_cli(daemon, "gc")
    assert p.returncode == 0 and "layers" in p.stdout, p.stderr
    assert not image_tmp(daemon)


class LyingRegistry:
    """A registry that asks for a Bearer token and serves what it is told to,
    including blobs that do not match their digest."""

    def __init__(self, blobs: dict[str, bytes], manifests: dict[str, bytes]):
        self.blobs, self.manifests = blobs, manifests
        self.token_requests: list[str] = []
        self.blob_gets = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, body: bytes, headers: dict | None = None):
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path.startswith("/token"):
                    outer.token_requests.append(self.path)
                    return self._send(200, b'{"token": "t0ken"}')
                if self.headers.get("Authorization") != "Bearer t0ken":
                    realm = f"http://127.0.0.1:{outer.port}/token"
                    return self._send(401, b"{}", {
                        "WWW-Authenticate": f'Bearer realm="{realm}",service="lying",scope="repository:x:pull"'})
                parts = self.path.split("/")
                if len(parts) == 5 and parts[3] == "manifests" and parts[4] in outer.manifests:
                    return self._send(200, outer.manifests[parts[4]], {"Content-Type": OCI_MANIFEST})
                if len(parts) == 5 and parts[3] == "blobs" and parts[4] in outer.blobs:
                    outer.blob_gets += 1
                    return self._send(200, outer.blobs[parts[4]])
                return self._send(404, b"{}")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def test_pulls_use_bearer_tokens_and_refuse_digest_mismatches(daemon: Daemon, api: Client):
    layers = two_layers(uuid.uuid4().hex)
    blobs, manifest, _ = oci_image(layers, [])
    reg = LyingRegistry(dict(blobs), {"good": manifest})
    try:
        ref = f"127.0.0.1:{reg.port}/x:good"
        p = image_cli(daemon, "pull", ref, "--name", "lying-good", timeout=120)
        assert p.returncode == 0, p.stderr
        assert reg.token_requests and "service=lying" in reg.token_requests[0], reg.token_requests
        assert reg.blob_gets == 3, f"config and both layers downloaded: {reg.blob_gets}"
        # Now the registry swaps a layer's content under the same digest.
        evil = Layer().file("evil", b"not what the digest says").bytes()
        victim = json.loads(manifest)["layers"][1]["digest"]
        reg.blobs[victim] = gzip.compress(evil, mtime=0)
        # A distinct config so the layer is not already in the store.
        blobs2, manifest2, config2 = oci_image([layers[0], evil], ["X=1"])
        fake = json.loads(manifest2)
        fake["layers"][1]["digest"] = victim
        reg.blobs.update({d: b for d, b in blobs2.items() if b == config2})
        reg.manifests["evil"] = json.dumps(fake).encode()
        p = image_cli(daemon, "pull", f"127.0.0.1:{reg.port}/x:evil", "--name", "lying-evil", timeout=120)
        assert p.returncode != 0 and "digest mismatch" in p.stderr, p.stderr
        # A manifest asked for by digest must match it.
        reg.manifests[f"sha256:{sha(manifest)}"] = manifest + b" "
        p = image_cli(daemon, "pull", f"127.0.0.1:{reg.port}/x@sha256:{sha(manifest)}", "--name", "lying-d",
                       timeout=120)
        assert p.returncode != 0 and "digest mismatch" in p.stderr, p.stderr
        # Plain HTTP is for loopback only, unless --insecure.
        p = image_cli(daemon, "pull", "registry.invalid/x:1", timeout=60)
        assert p.returncode != 0 and "https://registry.invalid" in p.stderr, p.stderr
    finally:
        reg.stop()
    names = image_names(api)
    assert "lying-good" in names and "lying-evil" not in names and "lying-d" not in names
    assert not any((daemon.state_dir / "images" / "tmp").iterdir())


# --------------------------------------------------------------------------
# The python preset (mmdebstrap)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_python_preset_is_built_on_first_use_and_runs_python(api: Client):
    r = api.post("/v1/templates", {"name": uname("py"), "image": "python"})
    expect_status(r, 201)
    tpl = r.json()
    r = api.post("/v1/sandboxes", {"template": tpl["name"], "wait_seconds": 60, "ttl_seconds": 900})
    expect_status(r, 201)
    sb = r.json()
    sb = wait_for("the python preset to build and its sandbox to run",
                  lambda: (lambda s: s if s["state"] != "starting" else None)(api.sandbox(sb["id"])),
                  timeout=600, interval=1)
    assert sb["state"] == "running", sb
    res = api.exec(sb["id"], "python3 -c 'print(42)'")
    assert (res["exit_code"], res["stdout"]) == (0, "42\n"), res
    image = image_names(api)["python"]
    assert image["source"] == "debian:bookworm+python3"
    api.destroy(sb["id"])
    # Built once: a second sandbox runs the same image, not a new build.
    sb2 = api.create(template=tpl["name"])
    assert api.sh(sb2["id"], "python3 -c 'import sys; print(sys.version_info[0])'") == "3\n"
    assert image_names(api)["python"] == image, "the preset was built again"
    api.destroy(sb2["id"])
    expect_status(api.delete(f"/v1/templates/{tpl['id']}"), 204)


def test_image_builds_through_the_api(daemon: Daemon, api: Client):
    other = daemon.new_client("img-builder")
    expect_error(other.post("/v1/images/build", {"kind": "python"}), 403, "forbidden")
    # Refused whole before anything runs, as plain error answers.
    expect_error(api.post("/v1/images/build", {"kind": "cobol"}), 400, "invalid_request")
    expect_error(api.post("/v1/images/build", {"kind": "python", "packages": ["git"]}), 400, "invalid_request")
    expect_error(api.post("/v1/images/build", {"kind": "debian", "packages": ["git;reboot"]}), 400, "image_invalid")
    expect_error(api.post("/v1/images/build", {"kind": "debian", "suite": "../x"}), 400, "image_invalid")
    expect_error(api.post("/v1/images/build", {"kind": "debian", "name": "base"}), 400, "image_invalid")
    expect_error(api.post("/v1/images/build", {"kind": "python", "force": True}), 400, "invalid_request")
    # A preset through the API: built if the store lacks it, else answered
    # at once; either way the NDJSON answer ends with the image.
    r = api.request("POST", "/v1/images/build", json={"kind": "python"}, stream=True, timeout=900)
    expect_status(r, 200)
    assert r.headers["content-type"] == "application/x-ndjson"
    events = [json.loads(line) for line in r.iter_lines() if line]
    assert events and events[-1]["type"] == "done", events[-3:]
    assert all(e["type"] in ("log", "skipped") for e in events[:-1]), events
    assert events[-1]["image"]["name"] == "python" and events[-1]["image"]["layers"] >= 1, events[-1]
    assert image_names(api)["python"]["source"] == "debian:bookworm+python3"
    # The CLI goes through the same route, from any machine with the URL.
    p = image_cli(daemon, "build", "python", timeout=900)
    assert p.returncode == 0 and p.stdout.startswith("python ("), (p.stdout, p.stderr)
    env = {"HUTCH_URL": daemon.base, "HUTCH_API_KEY": other.key, "PATH": os.environ["PATH"]}
    p = subprocess.run([str(daemon.binary), "image", "build", "python"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode != 0 and "forbidden" in p.stderr, p.stderr


# --------------------------------------------------------------------------
# Who sees which image


def test_images_list_only_what_the_caller_may_name(daemon: Daemon, api: Client):
    """Operator-imported images are shared and every key sees them; a
    template build's image `tpl-<id>-v<n>` is its owner's: another key
    neither sees it listed nor names it; the admin sees all. A name under
    the reserved `tpl-` prefix cannot be imported."""
    shared = uname("shared")
    p = import_archive(daemon, docker_save(two_layers(shared), ["S=1"], "s:1"), "--name", shared)
    assert p.returncode == 0, p.stderr
    a, b = daemon.new_client("images-a"), daemon.new_client("images-b")
    r = a.post("/v1/templates", {"name": uname("mine")})
    expect_status(r, 201)
    t = r.json()
    ctx = io.BytesIO()
    with tarfile.open(fileobj=ctx, mode="w:gz") as tar:
        data = b"RUN echo built > /opt/built\n"
        ti = tarfile.TarInfo("Dockerfile")
        ti.size = len(data)
        tar.addfile(ti, io.BytesIO(data))
    r = a.request("POST", f"/v1/templates/{t['id']}/builds", data=ctx.getvalue(),
                  headers={"Content-Type": "application/gzip"})
    expect_status(r, 202)
    bid = r.json()["id"]

    def finished():
        got = a.get(f"/v1/templates/{t['id']}/builds/{bid}").json()
        return got if got["state"] in ("succeeded", "failed") else None

    assert wait_for("the build", finished, timeout=180, interval=0.2)["state"] == "succeeded"
    built = f"{t['id']}-v2"
    seen_a, seen_b, seen_admin = image_names(a), image_names(b), image_names(api)
    assert shared in seen_a and shared in seen_b and shared in seen_admin
    assert built in seen_a and built in seen_admin, (seen_a, seen_admin)
    assert built not in seen_b and not any(n.startswith("tpl-") for n in seen_b), sorted(seen_b)
    assert seen_a[built]["layers"] == 1, seen_a[built]
    # B names the image: refused as if it did not exist.
    r = b.post("/v1/templates", {"name": uname("steal"), "image": built})
    assert r.status_code == 400, r.text
    # The operator cannot import under a template image's name either.
    p = import_archive(daemon, docker_save(two_layers(uname("x")), [], "t:1"), "--name", f"{t['id']}-v9")
    assert p.returncode != 0 and "tpl-" in p.stderr, (p.stdout, p.stderr)
    expect_status(a.delete(f"/v1/templates/{t['id']}"), 204)
