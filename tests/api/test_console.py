"""The web console at `/console`, driven in a real headless browser:
Chromium from Debian (`chromium`), through Playwright from PyPI pointed at
that browser (`executable_path`; Playwright's own browsers are never
downloaded). Every wait is on a condition (Playwright's `expect`), with a
bound.

Also the console's answers' headers (CSP, no framing, no caching), and the
per-sandbox metrics route its chart reads."""

from __future__ import annotations

import io
import re
import shutil
import tarfile
from pathlib import Path

import pytest
import requests
from playwright.sync_api import Browser, Page, expect, sync_playwright

from conftest import Client, Daemon, expect_error, expect_status, wait_for

# Milliseconds any one browser wait may take (a sandbox's create included).
PATIENCE_MS = 30_000


def system_chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    pytest.fail("Debian's chromium is required (apt-get install chromium; scripts/test.sh installs it)", pytrace=False)


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        # As root Chromium runs only without its own sandbox; a small
        # /dev/shm (containers) must not crash it.
        b = p.chromium.launch(executable_path=system_chromium(), args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            yield b
        finally:
            b.close()


class Watched:
    """A page whose console errors, page errors and request URLs are kept."""

    def __init__(self, browser: Browser, base: str):
        self.context = browser.new_context(accept_downloads=True)
        self.context.set_default_timeout(PATIENCE_MS)
        self.page: Page = self.context.new_page()
        self.errors: list[str] = []
        self.urls: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.page.on("request", lambda r: self.urls.append(r.url))
        self.failed: list[str] = []
        self.page.on("response", lambda r: r.status >= 400 and self.failed.append(f"{r.status} {r.url}"))
        self.page.on("websocket", lambda ws: self.urls.append(ws.url))
        self.page.goto(base + "/console")

    def sign_in(self, key: str) -> None:
        self.page.fill("#api-key", key)
        self.page.click("#sign-in button[type=submit]")

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def watched(browser: Browser, daemon: Daemon):
    w = Watched(browser, daemon.base)
    yield w
    w.close()


def test_the_console_signs_in_runs_a_terminal_moves_files_and_deletes_a_sandbox(
    watched: Watched, daemon: Daemon
):
    user = daemon.new_client("console-user")
    page = watched.page
    watched.sign_in(user.key)
    expect(page.locator("#who")).to_have_text(f"key {user.key_id}")
    assert page.evaluate("sessionStorage.getItem('hutch.key')") == user.key
    assert page.evaluate("localStorage.length") == 0

    # Create from a template: the console shows the new sandbox.
    page.select_option("#create-template", "base")
    page.click("#create-sandbox button[type=submit]")
    expect(page).to_have_url(re.compile(r"#/sandbox/sb-"))
    sid = page.url.rsplit("/", 1)[1]
    try:
        assert user.sandbox(sid)["state"] == "running"
        expect(page.locator("#sandbox td.state")).to_have_text("running")
        expect(page.locator("#sandbox td.time-left")).to_have_text(re.compile(r"^\d+m \d\ds$"))

        # Extend, suspend and resume through the buttons.
        before = user.sandbox(sid)["expires_at"]
        page.click('#sandbox button[data-action="+10m"]')
        wait_for("the extension", lambda: user.sandbox(sid)["expires_at"] > before, timeout=10)
        page.click('#sandbox button[data-action="suspend"]')
        expect(page.locator("#sandbox td.state")).to_have_text("suspended")
        expect(page.locator("#open-terminal")).to_be_disabled()
        page.click('#sandbox button[data-action="resume"]')
        expect(page.locator("#sandbox td.state")).to_have_text("running")

        # Share: a grant for an end user, shown once; it runs commands here.
        page.click("#share")
        expect(page.locator("#notice")).to_contain_text("hg_")
        token = re.search(r"hg_[A-Za-z0-9_-]+", page.locator("#notice").inner_text()).group(0)
        r = requests.post(f"{daemon.base}/v1/sandboxes/{sid}/exec", json={"command": "echo shared"},
                          headers={"Authorization": f"Bearer {token}"}, timeout=30)
        expect_status(r, 200)
        assert r.json()["stdout"] == "shared\n", r.json()

        # The terminal: a command typed in it (at once: what is typed
        # before the socket opens waits for it), its output on screen, in
        # 24-bit colour (which xterm.js sets as style attributes).
        page.click("#open-terminal")
        page.locator("#terminal .xterm").click()
        page.keyboard.type("printf '\\033[38;2;255;100;0mconsole-%s\\033[0m\\n' $((6 * 7))\n")
        expect(page.locator("#terminal .xterm-rows")).to_contain_text("console-42")

        # Upload: the file lands in the sandbox with its bytes.
        page.set_input_files(
            "#upload", files=[{"name": "hello.txt", "mimeType": "text/plain", "buffer": b"hi from the browser\n"}]
        )
        expect(page.locator('#files tr[data-path="hello.txt"]')).to_be_visible()
        got = user.get(f"/v1/sandboxes/{sid}/files", params={"path": "/workspace/hello.txt"})
        expect_status(got, 200)
        assert got.content == b"hi from the browser\n"

        # Download: bytes that are not text come back whole; a file name
        # that looks like markup is shown as text.
        blob = bytes(range(256)) * 64
        put = user.request("PUT", f"/v1/sandboxes/{sid}/files", params={"path": "/workspace/data.bin"}, data=blob)
        expect_status(put, 204)
        odd = '<img src=x onerror="document.title=1">.txt'
        put = user.request("PUT", f"/v1/sandboxes/{sid}/files", params={"path": f"/workspace/{odd}"}, data=b"x")
        expect_status(put, 204)
        page.click("#files button[type=submit]")
        with page.expect_download() as dl:
            page.click('#files button[data-download="data.bin"]')
        assert Path(dl.value.path()).read_bytes() == blob
        expect(page.locator("#files tbody")).to_contain_text(odd)
        assert page.locator("#files img").count() == 0

        # The chart has samples (the daemon takes one as a sandbox starts).
        expect(page.locator("#sample-count")).to_have_text(re.compile(r"^[1-9]\d* samples$"))

        # Delete: the sandbox ends.
        page.click('#sandbox button[data-action="delete"]')
        expect(page.locator("#sandbox td.state")).to_have_text(re.compile("terminat"))
        wait_for("the sandbox to end", lambda: user.sandbox(sid)["state"] == "terminated", timeout=30)
        expect(page.locator("#sandbox td.state")).to_have_text("terminated")
        # No call failed on the way (the console shows such errors here).
        expect(page.locator("#notice")).to_be_hidden()
    finally:
        user.delete(f"/v1/sandboxes/{sid}")

    # Nothing refused by the page's policy, nothing thrown; the key was in
    # no URL (the terminal's WebSocket included).
    assert watched.errors == [], (watched.errors, watched.failed)
    assert any(u.startswith("ws://") and f"/v1/sandboxes/{sid}/pty?" in u for u in watched.urls), watched.urls
    assert not [u for u in watched.urls if user.key in u]


def test_the_console_follows_a_build_log_as_text_and_lists_snapshots(watched: Watched, daemon: Daemon):
    user = daemon.new_client("console-builds")
    page = watched.page
    r = user.post("/v1/templates", {"name": "console-tpl"})
    expect_status(r, 201)
    tid = r.json()["id"]
    r = user.request(
        "POST",
        f"/v1/templates/{tid}/builds",
        data=build_context("RUN echo '<b>built</b>-'$((6 * 7))\n"),
        headers={"Content-Type": "application/gzip"},
    )
    expect_status(r, 202)
    sb = user.create()
    try:
        snap = user.post(f"/v1/sandboxes/{sb['id']}/snapshots", {"name": "console-snap"})
        expect_status(snap, 201)
        watched.sign_in(user.key)
        expect(page.locator("#create-template option", has_text="console-tpl")).to_have_count(1)

        page.click('#nav a[href="#/templates"]')
        page.click('#templates tr:has-text("console-tpl") button')
        page.click("#builds tbody button")
        log = page.locator("#build-log")
        # Followed until the build ends; its text shown as text.
        expect(log).to_contain_text("<b>built</b>-42")
        expect(log).to_contain_text("(end of log)", timeout=180_000)
        assert log.locator("b").count() == 0

        page.click('#nav a[href="#/snapshots"]')
        expect(page.locator("#snapshots tbody")).to_contain_text(snap.json()["id"])
        expect(page.locator("#snapshots tbody")).to_contain_text("console-snap")
    finally:
        user.delete(f"/v1/sandboxes/{sb['id']}")
        user.cleanup_templates()
    assert watched.errors == [], (watched.errors, watched.failed)


def test_the_console_makes_grows_and_deletes_volumes(watched: Watched, daemon: Daemon):
    user = daemon.new_client("console-volumes")
    page = watched.page
    watched.sign_in(user.key)
    page.click('#nav a[href="#/volumes"]')
    page.fill("#volume-name", "console-vol")
    page.fill("#volume-size", "64")
    page.click("#create-volume button[type=submit]")
    row = page.locator('#volumes tr:has-text("console-vol")')
    expect(row).to_contain_text("64.0 MiB")
    vols = user.get("/v1/volumes").json()["volumes"]
    assert [v["name"] for v in vols] == ["console-vol"], vols
    vid = vols[0]["id"]
    sb = user.create(volumes=[{"name": "console-vol", "path": "/data"}])
    try:
        # The list is read again while shown: the mount appears.
        expect(row).to_contain_text(sb["id"])
        expect(row).to_contain_text("at /data")
        row.locator('button[data-action="grow"]').click()
        expect(row).to_contain_text("128.0 MiB")
        assert user.get(f"/v1/volumes/{vid}").json()["size_mib"] == 128
    finally:
        expect_status(user.delete(f"/v1/sandboxes/{sb['id']}"), (200, 204))
    wait_for("the volume to be released", lambda: user.get(f"/v1/volumes/{vid}").json()["mounted_by"] == [])
    expect(row).not_to_contain_text(sb["id"])
    row.locator('button[data-action="delete"]').click()
    expect(page.locator("#volumes tbody")).to_contain_text("No volumes.")
    expect_error(user.get(f"/v1/volumes/{vid}"), 404, "volume_not_found")
    assert watched.errors == [], (watched.errors, watched.failed)


def build_context(dockerfile: str) -> bytes:
    """A tar.gz build context holding only `dockerfile`."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        raw = dockerfile.encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(raw)
        tar.addfile(info, io.BytesIO(raw))
    return buf.getvalue()


def test_a_wrong_key_is_refused_with_a_message(watched: Watched):
    page = watched.page
    watched.sign_in("hutch_" + "0" * 64)
    expect(page.locator("#sign-in-error")).to_have_text("This API key was refused.")
    assert page.evaluate("sessionStorage.getItem('hutch.key')") is None
    expect(page.locator("#nav")).to_be_hidden()


def test_the_console_signs_out_when_its_key_is_revoked(watched: Watched, daemon: Daemon, api: Client):
    user = daemon.new_client("console-revoked")
    watched.sign_in(user.key)
    expect(watched.page.locator("#sandboxes")).to_be_visible()
    expect_status(api.delete(f"/v1/keys/{user.key_id}"), 204)
    user.revoked = True
    # The next poll finds the key refused.
    expect(watched.page.locator("#sign-in-error")).to_have_text(re.compile("refused"))
    assert watched.page.evaluate("sessionStorage.getItem('hutch.key')") is None


def test_console_files_carry_a_strict_policy_and_no_framing(daemon: Daemon):
    base = daemon.base
    page = requests.get(base + "/console", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    nonce = re.search(r'name="hutch-style-nonce" content="([0-9a-f]{32})"', page.text)
    assert nonce, page.text[:500]
    again = requests.get(base + "/console/", timeout=30)
    assert nonce.group(1) not in again.text, "every page has its own nonce"
    for path in ["/console", "/console/app.js", "/console/terminal.js", "/console/xterm.mjs", "/console/console.css"]:
        r = requests.get(base + path, timeout=30)
        assert r.status_code == 200, (path, r.status_code)
        csp = r.headers["content-security-policy"]
        directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
        assert directives["default-src"] == "'self'", csp
        assert directives["script-src"] == "'self'", csp
        assert directives["frame-ancestors"] == "'none'", csp
        assert directives["object-src"] == "'none'", csp
        assert "unsafe" not in csp, csp
        assert r.headers["x-frame-options"] == "DENY"
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["referrer-policy"] == "no-referrer"
        assert r.headers["cache-control"] in ("no-store", "no-cache"), r.headers["cache-control"]
    assert page.headers["cache-control"] == "no-store"
    assert f"'nonce-{nonce.group(1)}'" in page.headers["content-security-policy"]
    assert "<script>" not in page.text, "no inline script"
    assert requests.get(base + "/console/app.js", timeout=30).headers["content-type"].startswith("text/javascript")
    # The build embedded xterm.js from console/node_modules, not its stand-in.
    assert "xterm.js authors" in requests.get(base + "/console/xterm.mjs", timeout=30).text
    expect_error(requests.get(base + "/console/../admin.key", timeout=30), 404, "not_found")
    expect_error(requests.get(base + "/console/nothing.js", timeout=30), 404, "not_found")


def test_api_answers_are_never_cached(api: Client, sandbox: dict):
    for path in ["/v1/sandboxes", f"/v1/sandboxes/{sandbox['id']}", "/v1/templates", "/v1/snapshots", "/v1/usage"]:
        r = api.get(path)
        expect_status(r, 200)
        assert r.headers.get("cache-control") == "no-store", (path, r.headers)


def test_sandbox_metrics_are_the_owners_only(daemon: Daemon):
    owner = daemon.new_client("metrics-owner")
    other = daemon.new_client("metrics-other")
    sb = owner.create()
    try:
        samples = wait_for(
            "a sample of the new sandbox",
            lambda: owner.get(f"/v1/sandboxes/{sb['id']}/metrics").json()["samples"],
            timeout=30,
        )
        s = samples[-1]
        assert s["mem_total_bytes"] > 0 and s["cpu_count"] >= 1 and 0 <= s["cpu_used_pct"], s
        assert re.match(r"^\d{4}-\d\d-\d\dT", s["at"]), s
        late = owner.get(f"/v1/sandboxes/{sb['id']}/metrics", params={"since": 4_000_000_000})
        expect_status(late, 200)
        assert late.json()["samples"] == []
        expect_error(owner.get(f"/v1/sandboxes/{sb['id']}/metrics", params={"since": -1}), 400, "invalid_request")
        expect_error(other.get(f"/v1/sandboxes/{sb['id']}/metrics"), 404, "not_found")
    finally:
        owner.delete(f"/v1/sandboxes/{sb['id']}")
