"""Template builds and startup/readiness: a Dockerfile fragment run over a
template's image into new layers, cached per step, checked (startup command
ready within the readiness timeout, at most 30 s) and activated as a new
version; refusals before anything runs; failures that leave the active
version serving; and startup commands with readiness checks on plain
templates (running only once ready, failed with a code otherwise)."""

from __future__ import annotations

import hashlib
import io
import tarfile
import uuid
from pathlib import Path

import pytest

from conftest import Client, Daemon, cgroup_dirs, expect_error, expect_status, wait_for


def tname(prefix: str = "b") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def make_template(c: Client, **body) -> dict:
    body.setdefault("name", tname())
    r = c.post("/v1/templates", body)
    expect_status(r, 201)
    return r.json()


def template(c: Client, tid: str) -> dict:
    r = c.get(f"/v1/templates/{tid}")
    expect_status(r, 200)
    return r.json()


def context(files: dict[str, str | bytes]) -> bytes:
    """A tar.gz build context holding `files` (path -> content)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path, data in files.items():
            raw = data.encode() if isinstance(data, str) else data
            info = tarfile.TarInfo(path)
            info.size = len(raw)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(raw))
    return buf.getvalue()


def post_build(c: Client, tid: str, files: dict[str, str | bytes]):
    return c.request(
        "POST", f"/v1/templates/{tid}/builds", data=context(files), headers={"Content-Type": "application/gzip"}
    )


def start_build(c: Client, tid: str, files: dict[str, str | bytes]) -> dict:
    r = post_build(c, tid, files)
    expect_status(r, 202)
    b = r.json()
    assert b["state"] in ("queued", "building") and b["template_id"] == tid, b
    return b


def wait_build(c: Client, tid: str, bid: str, timeout: float = 180) -> dict:
    def done():
        r = c.get(f"/v1/templates/{tid}/builds/{bid}")
        expect_status(r, 200)
        b = r.json()
        return b if b["state"] in ("succeeded", "failed") else None

    return wait_for(f"build {bid} to end", done, timeout=timeout, interval=0.2)


def build_log(c: Client, tid: str, bid: str) -> str:
    r = c.get(f"/v1/templates/{tid}/builds/{bid}/logs")
    expect_status(r, 200)
    assert r.headers["content-type"].startswith("text/plain"), r.headers
    return r.text


def build(c: Client, tid: str, files: dict[str, str | bytes], timeout: float = 180) -> tuple[dict, str]:
    b = start_build(c, tid, files)
    done = wait_build(c, tid, b["id"], timeout)
    return done, build_log(c, tid, b["id"])


APP_DOCKERFILE = """\
# a comment, then a continued RUN
RUN mkdir -p /opt/tool && \\
    echo built-by-run > /opt/tool/marker
COPY app.py data/ /workspace/app/
ENV GREETING="hello there" MODE=test
WORKDIR /workspace/app
RUN echo "$GREETING" > greeting.txt && echo step-output-here
CMD ["python3", "-m", "http.server", "8000"]
"""


@pytest.fixture(scope="module")
def built(api: Client):
    """A template built once (RUN/COPY/ENV/WORKDIR/CMD, ready on port 8000),
    shared by the tests that read what it made."""
    t = make_template(api, readiness={"port": 8000}, env={"FROM_TEMPLATE": "1"})
    files = {"Dockerfile": APP_DOCKERFILE, "app.py": "print('v1')\n", "data/table.csv": "a,b\n1,2\n"}
    done, log = build(api, t["id"], files)
    assert done["state"] == "succeeded", (done, log)
    yield t, files, done, log
    api.delete(f"/v1/templates/{t['id']}")


def test_a_dockerfile_with_from_is_refused_before_any_build(api: Client):
    t = make_template(api)
    for text, line, word in [
        ("RUN true\nFROM debian:bookworm\n", 2, "FROM"),
        ("ENTRYPOINT [\"/bin/sh\"]\n", 1, "ENTRYPOINT"),
        ("RUN true\n\nUSER nobody\n", 3, "USER"),
        ("ADD https://example.com/x /x\n", 1, "ADD"),
        ("WORKDIR /proc/self\n", 1, "WORKDIR"),
        ("USER root\nUSER daemon\n", 2, "USER"),
        ("COPY ../secret /workspace/\n", 1, "COPY"),
        ("COPY missing.txt /workspace/\n", 1, "missing.txt"),
    ]:
        body = expect_error(post_build(api, t["id"], {"Dockerfile": text}), 400, "build_instruction_refused")
        assert f"line {line}" in body["error"] and word in body["error"], (text, body)
    expect_error(post_build(api, t["id"], {"app.py": "x"}), 400, "sandbox_archive_invalid")
    r = api.request(
        "POST", f"/v1/templates/{t['id']}/builds", data=b"not gzip", headers={"Content-Type": "application/gzip"}
    )
    expect_error(r, 400, "sandbox_archive_invalid")
    r = api.get(f"/v1/templates/{t['id']}/builds")
    expect_status(r, 200)
    assert r.json()["builds"] == [], "a refused build is never recorded"
    assert template(api, t["id"])["version"] == 1


def test_a_failing_step_fails_the_build_and_the_active_version_keeps_serving(api: Client):
    t = make_template(api, env={"KEEP": "me"})
    dockerfile = "RUN echo first-step-ran\nRUN echo about-to-fail >&2; exit 3\nRUN echo never-reached\n"
    done, log = build(api, t["id"], {"Dockerfile": dockerfile})
    assert done["state"] == "failed", (done, log)
    assert "step 2/3" in done["error"] and "exit code 3" in done["error"], done
    assert done["version"] is None and done["finished_at"], done
    assert "Step 2/3: RUN echo about-to-fail" in log and "about-to-fail" in log and "exit code 3" in log, log
    assert "never-reached" not in log, log
    after = template(api, t["id"])
    assert (after["version"], after["image"]) == (1, "base"), after
    sb = api.create(template=t["name"])
    assert sb["template_version"] == 1
    assert api.sh(sb["id"], "echo $KEEP; test -e /opt/tool && echo leaked || echo clean") == "me\nclean\n"
    api.destroy(sb["id"])


@pytest.mark.slow
def test_a_build_whose_readiness_never_passes_fails(api: Client):
    # The template's own (test-sized) timeout applies when shorter than 30 s:
    # the error names the timeout the check was given.
    t = make_template(api, readiness={"port": 9, "timeout_seconds": 3})
    done, log = build(api, t["id"], {"Dockerfile": "RUN true\nCMD exec sleep 1000\n"})
    assert done["state"] == "failed", (done, log)
    assert "not ready after 3 s" in done["error"] and "port 9" in done["error"], done
    assert "Validating" in log and "not ready" in log, log
    assert template(api, t["id"])["version"] == 1

    # A longer timeout is capped at 30 s for a build.
    t2 = make_template(api, readiness={"command": "false", "timeout_seconds": 300})
    done, log = build(api, t2["id"], {"Dockerfile": "RUN true\n"})
    assert done["state"] == "failed" and "not ready after 30 s" in done["error"], (done, log)


def test_a_startup_command_that_exits_fails_the_build(api: Client):
    t = make_template(api)
    done, log = build(api, t["id"], {"Dockerfile": "CMD echo leaving-now; exit 5\n"})
    assert done["state"] == "failed" and "exit code 5" in done["error"], (done, log)
    assert "leaving-now" in log, log


def test_a_successful_build_makes_sandboxes_with_its_files_env_and_ready_cmd(api: Client, built):
    t, _files, done, log = built
    assert done["version"] == 2 and done["error"] is None, done
    for step in ["Step 1/6: RUN mkdir -p /opt/tool", "Step 2/6: COPY", "Step 6/6: CMD", "step-output-here", "ready"]:
        assert step in log, (step, log)
    now = template(api, t["id"])
    assert now["version"] == 2 and now["image"] == f"{t['id']}-v2", now
    assert now["startup"] == {"command": "python3 -m http.server 8000"}, now
    sb = api.create(template=t["name"])
    assert sb["template_version"] == 2
    sid = sb["id"]
    # Ready before `running`: the server answers at once.
    out = api.sh(
        sid,
        "cat /opt/tool/marker /workspace/app/app.py /workspace/app/table.csv /workspace/app/greeting.txt; "
        "echo \"$GREETING|$MODE|$FROM_TEMPLATE\"; "
        "python3 -c 'import urllib.request as u; print(u.urlopen(\"http://127.0.0.1:8000/app.py\").read().decode())'",
    )
    assert out == "built-by-run\nprint('v1')\na,b\n1,2\nhello there\nhello there|test|1\nprint('v1')\n\n", out
    procs = api.processes(sid)
    startup = [p for p in procs if p.get("tag") == "startup"]
    assert startup and startup[0]["cwd"] == "/workspace/app" and startup[0]["user"] == "user", procs
    # Files a RUN made as root stay root's; the sandbox user works in /workspace.
    assert api.sh(sid, "stat -c %U /opt/tool/marker; touch /workspace/mine && echo ok") == "root\nok\n"
    api.destroy(sid)


def test_a_rebuild_caches_unchanged_steps_and_new_creates_get_the_new_image(api: Client, built):
    t, files, _done, _log = built
    old = api.create(template=t["name"])
    files = {**files, "app.py": "print('v2')\n"}
    done, log = build(api, t["id"], files)
    assert done["state"] == "succeeded" and done["version"] == 3, (done, log)
    step1 = log.split("Step 2/6")[0]
    assert "---> cached" in step1 and "Step 1/6" in step1, log
    step2 = log.split("Step 2/6")[1].split("Step 3/6")[0]
    assert "---> cached" not in step2 and "---> layer" in step2, log
    assert template(api, t["id"])["version"] == 3
    new = api.create(template=t["name"])
    assert new["template_version"] == 3
    assert api.sh(new["id"], "cat /workspace/app/app.py") == "print('v2')\n"
    # A sandbox already running keeps its version.
    assert api.sh(old["id"], "cat /workspace/app/app.py") == "print('v1')\n"
    r = api.get(f"/v1/templates/{t['id']}/builds")
    expect_status(r, 200)
    assert [b["version"] for b in r.json()["builds"]][:2] == [3, 2]
    # An earlier build's image can be made active again (a new version).
    r = api.request("PATCH", f"/v1/templates/{t['id']}", json={"image": f"{t['id']}-v2"})
    expect_status(r, 200)
    assert r.json()["version"] == 4
    back = api.create(template=t["name"])
    assert api.sh(back["id"], "cat /workspace/app/app.py") == "print('v1')\n"
    r = api.request("PATCH", f"/v1/templates/{t['id']}", json={"image": f"{t['id']}-v99"})
    expect_error(r, 400, "invalid_request")
    for sid in (old["id"], new["id"], back["id"]):
        api.destroy(sid)


def test_a_step_cannot_write_past_the_templates_disk(api: Client):
    t = make_template(api, limits={"disk_mib": 16})
    done, log = build(api, t["id"], {"Dockerfile": "RUN head -c 40000000 /dev/zero > /opt/big\n"})
    assert done["state"] == "failed", (done, log)
    assert "No space left" in log, log


def test_captured_layers_keep_symlinks_as_links(api: Client):
    t = make_template(api)
    dockerfile = "RUN ln -s /etc/shadow /opt/evil && mkdir /opt/d && echo x > /opt/d/f && rm /etc/hostname\n"
    done, log = build(api, t["id"], {"Dockerfile": dockerfile})
    assert done["state"] == "succeeded", (done, log)
    sb = api.create(template=t["name"])
    out = api.sh(sb["id"], "readlink /opt/evil; cat /opt/d/f; test -e /etc/hostname && echo there || echo gone")
    assert out == "/etc/shadow\nx\ngone\n", out
    api.destroy(sb["id"])


def test_build_logs_follow_until_the_end_and_builds_are_per_owner(api: Client, daemon: Daemon):
    t = make_template(api)
    b = start_build(api, t["id"], {"Dockerfile": "RUN for i in 1 2 3; do echo tick-$i; sleep 0.3; done\n"})
    r = api.get(f"/v1/templates/{t['id']}/builds/{b['id']}/logs", params={"follow": "true"}, stream=True)
    expect_status(r, 200)
    text = b"".join(r.iter_content(None)).decode()
    assert "tick-3" in text and "Build succeeded" in text, text
    other = daemon.new_client("builds-other")
    expect_error(other.get(f"/v1/templates/{t['id']}/builds/{b['id']}"), 404, "not_found")
    expect_error(other.get(f"/v1/templates/{t['id']}/builds"), 404, "not_found")
    expect_error(api.get(f"/v1/templates/{t['id']}/builds/bld-0000000000000000"), 404, "not_found")


def test_no_scratch_layer_outlives_its_step(api: Client, daemon: Daemon):
    t = make_template(api)
    done, _ = build(api, t["id"], {"Dockerfile": "RUN echo one\nRUN exit 1\n"})
    assert done["state"] == "failed"
    scratch = str(daemon.state_dir / "images" / "scratch")
    mounts = [line for line in Path("/proc/mounts").read_text().splitlines() if scratch in line]
    assert mounts == [], mounts
    assert list(Path(scratch).iterdir()) == []


def test_cli_template_build_follows_and_fails_with_the_build(api: Client, daemon: Daemon, tmp_path: Path):
    t = make_template(api)
    (tmp_path / "Dockerfile").write_text("COPY hello.txt /workspace/\nRUN cat /workspace/hello.txt\n")
    (tmp_path / "hello.txt").write_text("hi from the cli\n")
    p = daemon.cli("template", "build", t["name"], str(tmp_path), "--url", daemon.base, timeout=120)
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert "hi from the cli" in p.stdout and "Build succeeded" in p.stdout, p.stdout
    (tmp_path / "Dockerfile").write_text("RUN exit 9\n")
    p = daemon.cli("template", "build", t["id"], str(tmp_path), "--url", daemon.base, timeout=120)
    assert p.returncode == 1 and "exit code 9" in p.stderr, (p.stdout, p.stderr)


# --------------------------------------------------------------------------
# Startup commands and readiness checks on plain templates


def test_a_sandbox_runs_only_once_its_startup_command_is_ready(api: Client):
    # Each probe of the readiness check leaves a line; the startup command
    # makes the check pass only after it has failed three times. A create
    # that answers `running` must have waited for the passing probe.
    t = make_template(
        api,
        startup={"command": "until [ \"$(cat /tmp/probes 2>/dev/null | wc -l)\" -ge 3 ]; do sleep 0.01; done; "
                            "touch /tmp/ready; exec sleep 1000"},
        readiness={"command": "echo probe >> /tmp/probes; test -f /tmp/ready"},
    )
    sb = api.create(template=t["name"])
    assert sb["state"] == "running", sb
    out = api.sh(sb["id"], "test -f /tmp/ready && echo ready; wc -l < /tmp/probes")
    ready, probes = out.split()
    assert ready == "ready" and int(probes) >= 4, out
    tags = [p.get("tag") for p in api.processes(sb["id"])]
    assert "startup" in tags, tags
    api.destroy(sb["id"])


def test_a_never_ready_template_fails_its_sandboxes_with_a_code(api: Client):
    t = make_template(api, startup={"command": "exec sleep 1000"}, readiness={"port": 9, "timeout_seconds": 2})
    r = api.post("/v1/sandboxes", {"template": t["name"]})
    expect_error(r, 503, "sandbox_readiness_timeout")
    t2 = make_template(api, startup={"command": "echo bye; exit 4"}, readiness={"command": "false"})
    r = api.post("/v1/sandboxes", {"template": t2["name"]})
    body = expect_error(r, 503, "sandbox_startup_failed")
    assert "exit code 4" in body["error"], body
    # Both are terminated, with their reason.
    codes = {
        s["template"]: s.get("last_error_code")
        for s in api.list_all()
        if s["template"] in (t["name"], t2["name"])
    }
    assert codes == {t["name"]: "sandbox_readiness_timeout", t2["name"]: "sandbox_startup_failed"}, codes
    # A sandbox that starts later (wait_seconds 0) ends the same way when polled.
    r = api.post("/v1/sandboxes", {"template": t["name"], "wait_seconds": 0})
    expect_status(r, 201)
    sid = r.json()["id"]
    final = wait_for("the sandbox to fail", lambda: (lambda s: s if s["state"] == "terminated" else None)(api.sandbox(sid)))
    assert final["last_error_code"] == "sandbox_readiness_timeout", final


def readiness_failures(d: Daemon, tid: str, version: int) -> int:
    """Sandboxes of a template version the daemon ended for a readiness check that never passed."""
    ((n,),) = d.db_rows(
        "SELECT count(*) FROM sandboxes WHERE template_id = ? AND template_version = ? "
        "AND state = 'terminated' AND last_error_code = 'sandbox_readiness_timeout'",
        (tid, version),
    )
    return int(n)


def test_startup_changes_raise_the_version_and_warm_pools_keep_only_ready_sandboxes(daemon: Daemon, api: Client):
    t = make_template(
        api,
        startup={"command": "sleep 0.5; echo up > /tmp/ready; exec sleep 1000"},
        readiness={"command": "test -f /tmp/ready"},
        warm={"min": 1, "max": 1},
    )
    wait_for("a ready warm sandbox", lambda: template(api, t["id"])["warm_ready"] == 1, timeout=30, interval=0.1)
    sb = api.create(template=t["name"])
    assert sb["warm"] is True, sb
    assert api.sh(sb["id"], "cat /tmp/ready") == "up\n"
    r = api.request("PATCH", f"/v1/templates/{t['id']}", json={"readiness": {"port": 8123, "timeout_seconds": 2}})
    expect_status(r, 200)
    assert r.json()["version"] == 2 and r.json()["readiness"] == {"port": 8123, "timeout_seconds": 2}
    r = api.request("PATCH", f"/v1/templates/{t['id']}", json={"startup": None})
    expect_status(r, 200)
    assert r.json()["version"] == 3 and r.json()["startup"] is None
    # Nothing listens on 8123: the pool's sandbox of version 3 is ended by
    # its readiness timeout, never handed out as ready.
    wait_for("a warm sandbox of version 3 to fail its readiness check",
             lambda: readiness_failures(daemon, t["id"], 3) >= 1, timeout=60, interval=0.2)
    assert template(api, t["id"])["warm_ready"] == 0
    api.destroy(sb["id"])
    api.delete(f"/v1/templates/{t['id']}")


def test_startup_and_readiness_are_validated(api: Client):
    for body in [
        {"readiness": {}},
        {"readiness": {"command": "true", "port": 80}},
        {"readiness": {"port": 0}},
        {"readiness": {"port": 80, "timeout_seconds": 301}},
        {"startup": {"command": ""}},
        {"startup": {"cmd": "x"}},
    ]:
        r = api.post("/v1/templates", {"name": tname(), **body})
        expect_error(r, 400, "invalid_request")


def build_sandbox_cgroups(d: Daemon) -> list[Path]:
    """The cgroups of the build sandboxes daemon `d` runs now (`bi-*`, or
    `bs-*` of earlier versions, whose agent socket is in its run dir: other
    daemons on the host have theirs)."""
    ids = [s.name[: -len(".sock")] for s in (d.run_dir / "sockets").glob("b[is]-*.sock")]
    return [p for i in ids for p in cgroup_dirs(i)]


def test_a_build_interrupted_by_kill_9_is_failed_and_cleaned_on_restart(own_daemon: Daemon):
    d = own_daemon
    d.start()
    api = d.client("admin")
    t = make_template(api)
    b = start_build(api, t["id"], {"Dockerfile": "RUN echo started; exec sleep 600\n"})
    # The step's own output line (the step's header holds the word too).
    wait_for("the step to run", lambda: "\nstarted\n" in build_log(api, t["id"], b["id"]), timeout=30, interval=0.1)
    running = build_sandbox_cgroups(d)
    assert running, "no build sandbox cgroup while a step runs"
    d.kill9()
    d.start()
    done = wait_build(api, t["id"], b["id"], timeout=10)
    assert done["state"] == "failed" and "interrupted" in done["error"], done
    assert template(api, t["id"])["version"] == 1
    left = [p for p in running if p.exists()]
    assert left == [], f"build sandboxes left after the restart: {left}"
    scratch = str(d.state_dir / "images" / "scratch")
    assert [m for m in Path("/proc/mounts").read_text().splitlines() if scratch in m] == []
    api.delete(f"/v1/templates/{t['id']}")


@pytest.mark.slow
def test_a_build_on_the_python_preset_stacks_its_layers_over_the_image(api: Client):
    """Builds start from the template's image: here the `python` preset (a
    Debian root file system of its own, built with mmdebstrap on first use),
    not the host-based `base`. A RUN step can write anywhere in it, /usr
    included, and reach the network to do so."""
    t = make_template(api, name=tname("py"), image="python")
    dockerfile = (
        "RUN python3 -c \"open('/usr/local/lib/marker', 'w').write('in-usr')\"\n"
        "ENV STAGE=built\n"
        "RUN test -f /etc/debian_version && ls /sys/class/net | grep -q eth0 && echo networked\n"
    )
    done, log = build(api, t["id"], {"Dockerfile": dockerfile}, timeout=600)
    assert done["state"] == "succeeded", log
    assert "networked" in log, log
    now = template(api, t["id"])
    assert now["image"] == f"{t['id']}-v2", now
    sb = api.create(template=t["name"])
    try:
        out = api.sh(sb["id"], "cat /usr/local/lib/marker; echo \" $STAGE\"; python3 -c 'print(42)'")
        assert out == "in-usr built\n42\n", out
        # The preset's own files are there, from its layers, not the host's.
        assert api.sh(sb["id"], "cat /etc/debian_version").strip().startswith("12"), "bookworm"
    finally:
        api.destroy(sb["id"])


# --------------------------------------------------------------------------
# Tenancy: builds, their cache, images and logs belong to one owner


def layer_ids(log: str) -> list[str]:
    """The layer ids a build's log names, in step order ("---> layer X" or
    "---> cached X")."""
    out = []
    for line in log.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "--->" and parts[1] in ("layer", "cached"):
            out.append(parts[2])
    return out


def test_a_run_step_is_never_reused_from_another_owners_cache(daemon: Daemon):
    """Two keys build the same RUN step (as `ssh-keygen` would, it writes a
    secret of its own): the second key's step runs, in its own sandbox, and
    its image holds its own secret, not the first key's."""
    a, b = daemon.new_client("cache-run-a"), daemon.new_client("cache-run-b")
    dockerfile = "RUN head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n' > /opt/private.key\n"
    keys, logs = {}, {}
    for who, c in (("a", a), ("b", b)):
        t = make_template(c)
        done, log = build(c, t["id"], {"Dockerfile": dockerfile})
        assert done["state"] == "succeeded", (who, done, log)
        sb = c.create(template=t["name"])
        keys[who] = c.sh(sb["id"], "cat /opt/private.key")
        logs[who] = log
        c.destroy(sb["id"])
    assert "---> cached" not in logs["b"], logs["b"]
    assert len(keys["a"]) == 64 and keys["a"] != keys["b"], keys
    assert set(layer_ids(logs["a"])).isdisjoint(layer_ids(logs["b"])), logs
    # The owner's own cache still works.
    t = make_template(a)
    done, log = build(a, t["id"], {"Dockerfile": dockerfile})
    assert done["state"] == "succeeded" and "---> cached" in log, log
    sb = a.create(template=t["name"])
    assert a.sh(sb["id"], "cat /opt/private.key") == keys["a"]
    a.destroy(sb["id"])


def owner_cache_dir(daemon: Daemon, owner: str):
    """Where the image store keeps an owner's build cache entries."""
    digest = hashlib.sha256(b"hutch-build-cache-owner\0" + owner.encode()).hexdigest()[:32]
    return daemon.state_dir / "images" / "cache" / digest


def test_revoking_a_key_forgets_its_build_cache(daemon: Daemon, api: Client):
    c = daemon.new_client("cache-revoked")
    t = make_template(c)
    done, log = build(c, t["id"], {"Dockerfile": "RUN echo cached-until-revoked > /opt/x\n"})
    assert done["state"] == "succeeded", log
    cache = owner_cache_dir(daemon, c.key_id)
    assert cache.is_dir() and any(cache.iterdir()), f"no cache entries in {cache}"
    expect_status(api.delete(f"/v1/keys/{c.key_id}"), 204)
    c.revoked = True
    assert not cache.exists(), list(cache.iterdir())


def test_a_copy_of_a_guessed_secret_is_not_answered_from_another_owners_cache(daemon: Daemon):
    """B copies a file holding A's secret: the build cache does not say
    `cached`, and the layer id it shows is not A's, so B learns nothing of
    what A built."""
    a, b = daemon.new_client("cache-copy-a"), daemon.new_client("cache-copy-b")
    secret = f"s3cret-{uuid.uuid4().hex}\n"
    files = {"Dockerfile": "COPY secret.txt /opt/secret.txt\n", "secret.txt": secret}
    ta = make_template(a)
    done_a, log_a = build(a, ta["id"], files)
    assert done_a["state"] == "succeeded", log_a
    tb = make_template(b)
    done_b, log_b = build(b, tb["id"], files)
    assert done_b["state"] == "succeeded", log_b
    assert "---> cached" not in log_b, log_b
    assert layer_ids(log_a) and layer_ids(log_b), (log_a, log_b)
    assert layer_ids(log_a) != layer_ids(log_b), (log_a, log_b)
    # A wrong guess and a right one look alike to B: both new layers.
    done_w, log_w = build(b, tb["id"], {**files, "secret.txt": "wrong guess\n"})
    assert done_w["state"] == "succeeded" and "---> cached" not in log_w, log_w


def test_another_owner_cannot_list_read_or_build_on_builds_and_images(daemon: Daemon):
    a, b = daemon.new_client("builds-own-a"), daemon.new_client("builds-own-b")
    t = make_template(a)
    done, log = build(a, t["id"], {"Dockerfile": "RUN echo private-output-of-a\n"})
    assert done["state"] == "succeeded", log
    image = f"{t['id']}-v2"
    base = f"/v1/templates/{t['id']}/builds"
    for path in (base, f"{base}/{done['id']}", f"{base}/{done['id']}/logs",
                 f"{base}/{done['id']}/logs?follow=true"):
        expect_error(b.get(path), 404, "not_found")
    expect_error(post_build(b, t["id"], {"Dockerfile": "RUN true\n"}), 404, "not_found")
    # B cannot name A's image, in a new template or an update of its own.
    r = b.post("/v1/templates", {"name": tname(), "image": image})
    assert r.status_code == 400 and r.json()["code"] in ("invalid_request", "image_not_found"), r.text
    mine = make_template(b)
    r = b.request("PATCH", f"/v1/templates/{mine['id']}", json={"image": image})
    assert r.status_code == 400 and r.json()["code"] in ("invalid_request", "image_not_found"), r.text
    # Nor see it listed; A does.
    listed = lambda c: {i["name"] for i in (lambda r: (expect_status(r, 200), r.json())[1])(c.get("/v1/images"))["images"]}
    assert image in listed(a)
    assert not any(n.startswith(t["id"]) for n in listed(b)), listed(b)
    assert not any(n.startswith("tpl-") for n in listed(b)), listed(b)
    # The admin sees every owner's images.
    assert image in listed(daemon.client("admin"))


def test_two_daemons_restarting_one_leaves_the_others_build_running(own_daemon: Daemon, tmp_root: Path):
    """Build sandboxes are swept only by the daemon that made them: a second
    daemon on the host (its own state dir) starting, or restarting after a
    kill -9, leaves the first one's running step alone."""
    d1 = own_daemon
    d1.start()
    api = d1.client("admin")
    t = make_template(api)
    b = start_build(api, t["id"], {"Dockerfile": "RUN echo started; exec sleep 600\n"})
    # The step's own output line (the step's header holds the word too).
    wait_for("the step to run", lambda: "\nstarted\n" in build_log(api, t["id"], b["id"]), timeout=30, interval=0.1)
    ours = build_sandbox_cgroups(d1)
    assert ours, "no build sandbox cgroup while a step runs"
    n = sum(1 for _ in tmp_root.glob("own2-*"))
    root = tmp_root / f"own2-{n}"
    root.mkdir(parents=True)
    d2 = Daemon(root, name="other")
    try:
        d2.start()
        d2.kill9()
        d2.start()
        d2.stop()
        d2.start()
        # d2 is up, its startup sweep done: d1's step still runs.
        gone = [p for p in ours if not p.exists()]
        assert gone == [], f"the other daemon's restart destroyed build sandboxes: {gone}"
        r = api.get(f"/v1/templates/{t['id']}/builds/{b['id']}")
        expect_status(r, 200)
        assert r.json()["state"] == "building", r.json()
        d2.stop()
    finally:
        d2.kill9()
        d2.kill_strays()
        d2.release_net()
    # d1 still sweeps its own: after its kill -9 and restart the build is
    # failed and its sandbox gone.
    d1.kill9()
    d1.start()
    done = wait_build(api, t["id"], b["id"], timeout=10)
    assert done["state"] == "failed" and "interrupted" in done["error"], done
    left = [p for p in ours if p.exists()]
    assert left == [], f"build sandboxes left after the restart: {left}"
    api.delete(f"/v1/templates/{t['id']}")


def test_a_store_of_an_earlier_version_is_brought_up_to_date_at_start(own_daemon: Daemon):
    """What older daemons wrote: step cache entries keyed without their
    owner (`images/cache/<key>`) are dropped at start, and a build's image
    that names no owner gets its template's owner (so its owner lists it
    and no one else does)."""
    import json

    d = own_daemon
    d.start()
    a, b = d.new_client("upgrade-a"), d.new_client("upgrade-b")
    t = make_template(a)
    done, log = build(a, t["id"], {"Dockerfile": "RUN echo old > /opt/old\n"})
    assert done["state"] == "succeeded", log
    image = f"{t['id']}-v2"
    d.stop()
    images = d.state_dir / "images"
    record = images / "images" / f"{image}.json"
    body = json.loads(record.read_text())
    assert body.get("owner"), body
    del body["owner"]
    record.write_text(json.dumps(body))
    layer = body["layers"][0]
    old_entry = images / "cache" / ("a" * 64)
    old_entry.write_text(layer)
    d.start()
    assert not old_entry.exists(), "an unowned cache entry survived the start"
    assert json.loads(record.read_text()).get("owner"), "the image did not get its owner back"
    names = lambda c: {i["name"] for i in c.get("/v1/images").json()["images"]}
    assert image in names(a) and image not in names(b)
    sb = a.create(template=t["name"])
    assert a.sh(sb["id"], "cat /opt/old") == "old\n"
    a.destroy(sb["id"])
