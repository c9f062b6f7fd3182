"""Templates from the unmodified SDK's `Template` builder: `Template.build`
(request, files-hash uploads to signed URLs, the steps), sandboxes from the
result (files, env, workdir, users, start and ready commands),
`build_in_background` with status polling and logs, `from_template`,
`from_image` from a registry the daemon may pull from, aliases and tags, a failed build's report, and another key seeing none of
it (template, builds, files cache). One template is built per module and
shared: builds are slow on small machines."""

import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import requests
from e2b import Sandbox, Template
from e2b.exceptions import BuildException

from conftest import E2bDaemon, wait_for
from conftest import GVISOR_STATX, on_class

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from oci_images import OCI_MANIFEST, Registry, oci_image, shell_layer  # noqa: E402

NAME = "sdk-app"


@pytest.fixture(scope="module")
def context_dir():
    d = Path(tempfile.mkdtemp(prefix="he2b-ctx-"))
    (d / "app.txt").write_text("hello from the build\n")
    (d / "pkg" / "sub").mkdir(parents=True)
    (d / "pkg" / "a.txt").write_text("a\n")
    (d / "pkg" / "sub" / "b.txt").write_text("b\n")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def built(daemon, context_dir):
    logs = []
    template = (
        Template(file_context_path=str(context_dir))
        .from_base_image()
        .copy("app.txt", "/home/user/app.txt")
        .copy("pkg", "/opt/pkg/", mode=0o750)
        .run_cmd("echo built-as-$(whoami) > /home/user/who.txt")
        .run_cmd("mkdir -p /opt/rootonly && touch /opt/rootonly/x", user="root")
        .set_envs({"GREETING": "hi there", "MODE": "test"})
        .set_workdir("/opt/pkg")
        .set_start_cmd("pwd > /tmp/started; whoami >> /tmp/started; sleep infinity", "test -s /tmp/started")
    )
    info = Template.build(template, f"{NAME}:v1", on_build_logs=logs.append)
    return info, [str(getattr(l, "message", l)) for l in logs]


def api(daemon, method, path, key=None, **kw):
    headers = {"X-API-KEY": key or daemon["key"]}
    return requests.request(method, daemon["base"] + path, headers=headers, timeout=30, **kw)


@on_class("gvisor", reason=GVISOR_STATX)
def test_a_built_template_starts_sandboxes_with_its_files_env_and_start_command(built):
    info, logs = built
    assert info.template_id.startswith("tpl-") and info.name == f"{NAME}:v1"
    assert any("Uploaded 'app.txt'" in l for l in logs), logs
    assert any("RUN" in l and "whoami" in l for l in logs), logs
    for ref in (NAME, f"{NAME}:v1", info.template_id):
        sb = Sandbox.create(ref, timeout=120)
        try:
            assert sb.files.read("/home/user/app.txt") == "hello from the build\n"
            assert sb.files.read("/opt/pkg/sub/b.txt") == "b\n"
            assert sb.files.read("/home/user/who.txt") == "built-as-user\n"
            out = sb.commands.run("stat -c '%U %a' /opt/pkg/a.txt /opt/rootonly/x").stdout.split("\n")
            assert out[0] == "user 750" and out[1].startswith("root "), out
            assert sb.commands.run('echo "$GREETING/$MODE"').stdout == "hi there/test\n"
            # The start command ran in the workdir, as `user`, before the
            # sandbox was ready (its ready command passed).
            assert sb.files.read("/tmp/started") == "/opt/pkg\nuser\n"
            assert "sleep infinity" in sb.commands.run("ps -eo args").stdout
            # The sandbox user can still write its home.
            sb.commands.run("touch /home/user/mine")
        finally:
            sb.kill()


def test_build_in_background_reports_status_and_logs_and_builds_on_a_template(built, context_dir):
    template = (
        Template(file_context_path=str(context_dir))
        .from_template(NAME)
        .set_user("root")
        .run_cmd("echo layered-$(whoami) > /layer.txt")
        .set_start_cmd("whoami > /tmp/start-user; sleep infinity", "test -s /tmp/start-user")
    )
    info = Template.build_in_background(template, "sdk-child")
    first = Template.get_build_status(info)
    assert first.status.value in ("waiting", "building", "ready"), first
    entries, offset = [], 0

    def finished():
        nonlocal offset
        s = Template.get_build_status(info, logs_offset=offset)
        offset += len(s.log_entries)
        entries.extend(e.message for e in s.log_entries)
        return s if s.status.value in ("ready", "error") else None

    status = wait_for("the background build", finished, timeout=300, interval=0.5)
    assert status.status.value == "ready", (status, entries)
    assert status.reason is None
    assert any("layered" in e for e in entries), entries
    assert any(e.startswith("Build succeeded") for e in entries), entries
    sb = Sandbox.create("sdk-child", timeout=120)
    try:
        # The parent template's files, and this build's layer over them.
        assert sb.files.read("/home/user/app.txt") == "hello from the build\n"
        assert sb.files.read("/layer.txt") == "layered-root\n"
        assert sb.files.read("/tmp/start-user") == "root\n"
    finally:
        sb.kill()


def test_a_failed_build_reports_its_failure_and_log(daemon):
    logs = []
    template = Template().from_base_image().run_cmd("echo about-to-fail; exit 3")
    with pytest.raises(BuildException) as e:
        Template.build(template, "sdk-fails", on_build_logs=logs.append)
    assert "failed" in str(e.value), e.value
    messages = [str(getattr(l, "message", l)) for l in logs]
    assert any("about-to-fail" in m for m in messages), messages
    # The template stays, unbuilt: a create from it is refused.
    with pytest.raises(Exception) as e:
        Sandbox.create("sdk-fails", timeout=30)
    assert "no successful build" in str(e.value), e.value
    # The status names the SDK's step that failed (its first after the image).
    info = Template.build_in_background(template, "sdk-fails")

    def failed():
        s = Template.get_build_status(info)
        return s if s.status.value == "error" else None

    s = wait_for("the build to fail", failed, timeout=120, interval=0.2)
    assert s.reason.step == "1" and "exit code 3" in s.reason.message, s.reason


def test_bad_steps_are_refused_in_e2b_shape(daemon):
    with pytest.raises(BuildException) as e:
        Template.build(Template().from_base_image().set_user("nobody"), "sdk-bad")
    assert "nobody" in str(e.value)
    with pytest.raises(BuildException) as e:
        Template.build(Template().from_image("no-such-image:1").run_cmd("true"), "sdk-bad")
    assert "no-such-image" in str(e.value)
    # Another key's template or a missing one is unknown; E2B's `base` is hutch's.
    with pytest.raises(BuildException) as e:
        Template.build(Template().from_template("sdk-nothing").run_cmd("true"), "sdk-bad")
    assert "not found" in str(e.value), e.value
    Template.build(Template().from_template("base").run_cmd("true"), "sdk-on-base")
    r = api(daemon, "POST", "/v3/templates", json={"name": "Bad Name"})
    assert r.status_code == 400 and set(r.json()) == {"code", "message"}, r.text


def test_aliases_and_tags(built, daemon):
    info, _ = built
    assert Template.exists(NAME) is True
    assert Template.exists("sdk-nothing") is False
    r = api(daemon, "GET", f"/templates/aliases/{NAME}")
    assert r.status_code == 200 and r.json()["templateID"] == info.template_id, r.text
    r = api(daemon, "GET", "/templates/aliases/sdk-nothing")
    assert r.status_code == 404 and r.json()["code"] == 404, r.text
    tags = {t.tag: t for t in Template.get_tags(NAME)}
    assert set(tags) == {"v1"}, tags
    assigned = Template.assign_tags(f"{NAME}:v1", ["prod", "stable"])
    assert assigned.build_id == tags["v1"].build_id and sorted(assigned.tags) == ["prod", "stable"]
    assert {t.tag for t in Template.get_tags(info.template_id)} == {"v1", "prod", "stable"}
    sb = Sandbox.create(f"{NAME}:prod", timeout=60)
    sb.kill()
    Template.remove_tags(NAME, ["prod", "stable"])
    assert {t.tag for t in Template.get_tags(NAME)} == {"v1"}
    with pytest.raises(Exception) as e:
        Sandbox.create(f"{NAME}:prod", timeout=30)
    assert "not found" in str(e.value).lower(), e.value


def test_another_key_sees_no_template_build_or_cached_files(built, daemon, context_dir):
    info, _ = built
    other = daemon["daemon"].make_key("other-templates")
    opts = {"api_key": other, "api_url": daemon["base"], "sandbox_url": daemon["base"]}
    assert Template.exists(NAME, **opts) is False
    for ref in (NAME, info.template_id, f"{NAME}:v1"):
        with pytest.raises(Exception) as e:
            Sandbox.create(ref, timeout=30, **opts)
        assert "not found" in str(e.value).lower(), (ref, e.value)
    with pytest.raises(Exception):
        Template.get_tags(NAME, **opts)
    r = api(daemon, "GET", f"/templates/{info.template_id}/builds/{info.build_id}/status", key=other)
    assert r.status_code == 404, r.text
    # The same files, asked for by the other key: uploaded again, never
    # taken from the first key's cache.
    logs = []
    mine = Template(file_context_path=str(context_dir)).from_base_image().copy("app.txt", "/home/user/app.txt")
    theirs = Template.build(mine, "sdk-app", on_build_logs=logs.append, **opts)
    messages = [str(getattr(l, "message", l)) for l in logs]
    assert any("Uploaded 'app.txt'" in m for m in messages), messages
    assert theirs.template_id != info.template_id
    # A hash the first key uploaded is absent for the other key's template.
    h = uuid.uuid4().hex * 2
    r = api(daemon, "GET", f"/templates/{info.template_id}/files/{h}")
    assert r.status_code == 201 and r.json()["present"] is False, r.text
    assert requests.put(r.json()["url"], data=b"first key's files", timeout=30).status_code == 200
    r = api(daemon, "GET", f"/templates/{info.template_id}/files/{h}")
    assert r.status_code == 201 and r.json() == {"present": True}, r.text
    r = api(daemon, "GET", f"/templates/{theirs.template_id}/files/{h}", key=other)
    assert r.status_code == 201 and r.json()["present"] is False and r.json()["url"], r.text
    r = api(daemon, "GET", f"/templates/{info.template_id}/files/{h}", key=other)
    assert r.status_code == 404, r.text


def test_upload_urls_are_signed_and_bounded(built, daemon):
    info, _ = built
    h = "ab" * 32
    r = api(daemon, "GET", f"/templates/{info.template_id}/files/{h}")
    url = r.json()["url"]
    assert "signature=" in url and "expires=" in url, url
    assert requests.put(url.replace("signature=", "signature=x"), data=b"x", timeout=30).status_code == 401
    assert requests.put(url.replace(h, "cd" * 32), data=b"x", timeout=30).status_code == 401
    expired = url.split("expires=")[0] + "expires=1&signature=" + url.split("signature=")[1]
    assert requests.put(expired, data=b"x", timeout=30).status_code == 401
    big = requests.put(url, data=b"\0" * ((32 << 20) + 1), timeout=60)
    assert big.status_code == 413 and big.json()["code"] == 413, big.text
    assert api(daemon, "GET", f"/templates/{info.template_id}/files/{h}").json()["present"] is False
    assert requests.put(url, data=b"small", timeout=30).status_code == 200
    assert api(daemon, "GET", f"/templates/{info.template_id}/files/{h}").json() == {"present": True}


def test_from_image_pulls_from_a_registry_the_daemon_allows(tmp_path):
    reg = Registry(tmp_path)
    d = None
    try:
        layer = shell_layer().dir("etc").file("etc/from-registry", b"pulled\n").bytes()
        blobs, manifest, _ = oci_image([layer], ["FROM_REGISTRY=1"])
        for digest, blob in blobs.items():
            if blob != manifest:
                reg.push_blob("e2b/img", digest, blob)
        reg.push_manifest("e2b/img", "1", manifest, OCI_MANIFEST)
        ref = f"127.0.0.1:{reg.port}/e2b/img:1"
        d = E2bDaemon(extra_env={"HUTCH_E2B_REGISTRIES": f"127.0.0.1:{reg.port}"})
        opts = d.opts()
        logs = []
        # An image with sh and cat only: the steps run in sh.
        template = Template().from_image(ref).run_cmd("cat /etc/from-registry > /home/user/copy; echo $FROM_REGISTRY >> /home/user/copy")
        Template.build(template, "pulled", on_build_logs=logs.append, **opts)
        messages = [str(getattr(l, "message", l)) for l in logs]
        assert any(m.startswith(f"Pulling {ref}") for m in messages), messages
        sb = Sandbox.create("pulled", timeout=60, **opts)
        try:
            assert sb.files.read("/home/user/copy") == "pulled\n1\n"
        finally:
            sb.kill()
        # The pulled image is the key's own: another key does not see it.
        other = d.make_key("other")
        r = requests.get(d.base + "/v1/images", headers={"Authorization": f"Bearer {other}"}, timeout=10)
        assert r.status_code == 200 and not [i for i in r.json()["images"] if "e2b-img" in i["name"]], r.text
        r = requests.get(d.base + "/v1/images", headers={"Authorization": f"Bearer {d.key}"}, timeout=10)
        assert [i for i in r.json()["images"] if "e2b-img" in i["name"]], r.text
    finally:
        try:
            if d is not None:
                d.kill_all()
                d.stop()
        finally:
            reg.stop()


def test_steps_are_cached_unless_skip_cache(daemon):
    def build(template, **kw):
        logs = []
        Template.build(template, "sdk-cache", on_build_logs=logs.append, **kw)
        return [str(getattr(l, "message", l)) for l in logs]

    plain = lambda: Template().from_base_image().run_cmd("echo one > /home/user/one").run_cmd("echo two")
    build(plain())
    again = build(plain())
    assert sum("---> cached" in m for m in again) >= 2, again
    forced = build(plain(), skip_cache=True)
    assert not any("---> cached" in m for m in forced), forced
    # `skip_cache()` before a step: that step and the ones after it run.
    partly = build(Template().from_base_image().run_cmd("echo one > /home/user/one").skip_cache().run_cmd("echo two"))
    runs = [m for m in partly if m.startswith("---> ")]
    assert any("cached" in m for m in runs) and "cached" not in runs[-2], runs
