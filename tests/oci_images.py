"""OCI images built in memory (layers, configs, manifests) and Debian's
`docker-registry` on a loopback port, shared by the image tests
(tests/api/test_images.py) and the E2B template tests
(tests/e2b/test_templates.py)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
import requests


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, predicate, timeout=10.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
        time.sleep(interval)


OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZ = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


class Layer:
    """A layer tar built in memory, every entry owned by the image's root."""

    def __init__(self):
        self.buf = io.BytesIO()
        self.tar = tarfile.open(fileobj=self.buf, mode="w", format=tarfile.PAX_FORMAT)

    def _info(self, name: str, kind, mode: int) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(name)
        ti.type, ti.mode, ti.uid, ti.gid, ti.mtime = kind, mode, 0, 0, 1_700_000_000
        return ti

    def file(self, name: str, data: bytes, mode: int = 0o644) -> "Layer":
        ti = self._info(name, tarfile.REGTYPE, mode)
        ti.size = len(data)
        self.tar.addfile(ti, io.BytesIO(data))
        return self

    def dir(self, name: str, mode: int = 0o755) -> "Layer":
        self.tar.addfile(self._info(name, tarfile.DIRTYPE, mode))
        return self

    def symlink(self, name: str, target: str) -> "Layer":
        ti = self._info(name, tarfile.SYMTYPE, 0o777)
        ti.linkname = target
        self.tar.addfile(ti)
        return self

    def bytes(self) -> bytes:
        self.tar.close()
        return self.buf.getvalue()


def shell_layer() -> Layer:
    """The host's dash as /bin/sh, cat, and the loader and libc they need."""
    ld = os.path.realpath("/lib64/ld-linux-x86-64.so.2")
    libc = os.path.realpath("/lib/x86_64-linux-gnu/libc.so.6")
    return (
        Layer()
        .dir("usr").dir("usr/bin").dir("usr/lib64").dir("usr/lib").dir("usr/lib/x86_64-linux-gnu")
        .symlink("bin", "usr/bin").symlink("lib", "usr/lib").symlink("lib64", "usr/lib64")
        .file("usr/bin/sh", Path("/bin/dash").read_bytes(), 0o755)
        .file("usr/bin/cat", Path("/usr/bin/cat").read_bytes(), 0o755)
        .file("usr/lib64/ld-linux-x86-64.so.2", Path(ld).read_bytes(), 0o755)
        .file("usr/lib/x86_64-linux-gnu/libc.so.6", Path(libc).read_bytes(), 0o755)
    )


def config_json(layers: list[bytes], env: list[str]) -> bytes:
    return json.dumps({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": env, "Cmd": ["/bin/sh"], "WorkingDir": "/workspace"},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{sha(l)}" for l in layers]},
    }).encode()


def oci_image(layers: list[bytes], env: list[str], compress: bool = True) -> tuple[dict[str, bytes], bytes, bytes]:
    """Blobs by digest, the manifest and the config of an OCI image."""
    config = config_json(layers, env)
    blobs = {f"sha256:{sha(config)}": config}
    descs = []
    for l in layers:
        blob = gzip.compress(l, mtime=0) if compress else l
        blobs[f"sha256:{sha(blob)}"] = blob
        descs.append({"mediaType": OCI_LAYER_GZ if compress else OCI_LAYER, "digest": f"sha256:{sha(blob)}",
                      "size": len(blob)})
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": f"sha256:{sha(config)}", "size": len(config)},
        "layers": descs,
    }).encode()
    blobs[f"sha256:{sha(manifest)}"] = manifest
    return blobs, manifest, config


class Registry:
    """Debian's docker-registry on a free loopback port, storage in a temp dir."""

    def __init__(self, root: Path):
        self.port = free_port()
        self.dir = root / f"registry-{self.port}"
        self.dir.mkdir(parents=True)
        cfg = self.dir / "config.yml"
        cfg.write_text(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
            f"    rootdirectory: {self.dir / 'data'}\n  delete:\n    enabled: true\n"
            f"http:\n  addr: 127.0.0.1:{self.port}\n"
        )
        binary = shutil.which("docker-registry") or "/usr/bin/docker-registry"
        if not Path(binary).exists():
            pytest.fail("docker-registry is not installed (apt-get install docker-registry)", pytrace=False)
        self.log = open(self.dir / "registry.log", "wb")
        self.proc = subprocess.Popen([binary, "serve", str(cfg)], stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=self.log, start_new_session=True)
        self.base = f"http://127.0.0.1:{self.port}"
        wait_for("the registry to answer", self._up, timeout=20, interval=0.1)

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"docker-registry exited: {(self.dir / 'registry.log').read_text()[-2000:]}")
        try:
            return requests.get(self.base + "/v2/", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def push_blob(self, repo: str, digest: str, data: bytes) -> None:
        r = requests.post(f"{self.base}/v2/{repo}/blobs/uploads/", timeout=30)
        assert r.status_code == 202, r.text
        loc = r.headers["Location"]
        if loc.startswith("/"):
            loc = self.base + loc
        r = requests.put(loc, params={"digest": digest}, data=data,
                         headers={"Content-Type": "application/octet-stream"}, timeout=60)
        assert r.status_code == 201, r.text

    def push_manifest(self, repo: str, ref: str, body: bytes, media: str) -> None:
        r = requests.put(f"{self.base}/v2/{repo}/manifests/{ref}", data=body, headers={"Content-Type": media},
                         timeout=30)
        assert r.status_code == 201, r.text

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
