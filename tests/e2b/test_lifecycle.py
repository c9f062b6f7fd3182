"""Sandbox lifecycle through the SDK's control API client."""

import time

import pytest
from e2b import Sandbox, SandboxQuery, SandboxState, SandboxNotFoundException, NotFoundException
from conftest import wait_for
from conftest import GVISOR_STATX, on_class


def test_create_with_metadata_and_info(shared):
    info = shared.get_info()
    assert info.sandbox_id == shared.sandbox_id
    assert info.metadata == {"suite": "e2b", "kind": "shared"}
    assert info.template_id == "base" and info.state == SandboxState.RUNNING


def test_kill_then_not_running_and_not_found(daemon):
    sb = Sandbox.create()
    assert sb.is_running()
    sb.kill()
    assert not sb.is_running()
    assert Sandbox.kill(sb.sandbox_id) is False
    with pytest.raises((SandboxNotFoundException, NotFoundException)):
        Sandbox.get_info(sb.sandbox_id)


def test_set_timeout_then_expiry(daemon):
    sb = Sandbox.create(timeout=300)
    sb.set_timeout(2)
    wait_for("expiry", lambda: not sb.is_running(), timeout=20, interval=0.25)


def test_list_with_metadata_filter_and_pages(daemon):
    tag = str(time.time())
    made = [Sandbox.create(metadata={"page": tag}) for _ in range(3)]
    try:
        pager = Sandbox.list(query=SandboxQuery(metadata={"page": tag}), limit=2)
        first = pager.next_items()
        assert len(first) == 2 and pager.has_next
        second = pager.next_items()
        assert len(second) == 1 and not pager.has_next
        assert {s.sandbox_id for s in first + second} == {s.sandbox_id for s in made}
    finally:
        for s in made:
            s.kill()


def test_pause_and_connect_keep_files(daemon):
    sb = Sandbox.create()
    try:
        sb.files.write("kept.txt", "still here")
        sb.pause()
        assert not sb.is_running()
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
        assert sb.sandbox_id in {s.sandbox_id for s in paused}
        again = Sandbox.connect(sb.sandbox_id)
        assert again.is_running()
        assert again.files.read("kept.txt") == "still here"
        assert again.commands.run("echo up").stdout == "up\n"
    finally:
        sb.kill()


def test_connect_to_unknown_is_not_found(daemon):
    with pytest.raises((SandboxNotFoundException, NotFoundException)):
        Sandbox.connect("nosuchsandbox0")


def test_bad_api_key_is_refused(daemon):
    from e2b import AuthenticationException

    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="e2b_" + "0" * 40)


def test_commands_on_a_killed_sandbox_raise_sandbox_not_running(daemon):
    from e2b import SandboxNotRunningException

    sb = Sandbox.create()
    sb.kill()
    with pytest.raises(SandboxNotRunningException):
        sb.commands.run("true")
    with pytest.raises(SandboxNotRunningException):
        sb.files.read("anything.txt")


def test_pause_and_resume_keep_running_processes(daemon):
    sb = Sandbox.create()
    try:
        handle = sb.commands.run("sleep 300", background=True)
        sb.pause()
        again = Sandbox.connect(sb.sandbox_id)
        pids = {p.pid for p in again.commands.list()}
        assert handle.pid in pids, pids
    finally:
        sb.kill()


def test_list_filters_by_template_start_time_and_order_over_plain_http(daemon):
    """Filters the SDK's query object does not expose, on the same route."""
    import os
    import datetime

    import requests

    base, key = os.environ["E2B_API_URL"], os.environ["E2B_API_KEY"]
    tag = {"suite": f"order-{time.time_ns()}"}
    utc = datetime.timezone.utc
    first = Sandbox.create(metadata=tag)
    # The cut: one millisecond (the daemon's resolution) after the first
    # started, as the daemon recorded it; the second starts once the host's
    # clock, which the daemon reads, has reached the cut.
    r = requests.get(f"{base}/v2/sandboxes", params={"metadata": f"suite={tag['suite']}"},
                     headers={"X-API-KEY": key}, timeout=10)
    assert r.status_code == 200, r.text
    started = next(s["startedAt"] for s in r.json() if s["sandboxID"] == first.sandbox_id)
    cut_ms = round(datetime.datetime.fromisoformat(started.replace("Z", "+00:00")).timestamp() * 1000) + 1
    cut = datetime.datetime.fromtimestamp(cut_ms // 1000, utc).strftime("%Y-%m-%dT%H:%M:%S") + f".{cut_ms % 1000:03d}Z"
    wait_for("the clock to reach the cut", lambda: int(time.time() * 1000) >= cut_ms, timeout=5, interval=0.001)
    second = Sandbox.create(metadata=tag)
    try:
        def ids(**params):
            params["metadata"] = f"suite={tag['suite']}"
            r = requests.get(f"{base}/v2/sandboxes", params=params, headers={"X-API-KEY": key}, timeout=10)
            assert r.status_code == 200, r.text
            return [s["sandboxID"] for s in r.json()]

        assert ids() == [second.sandbox_id, first.sandbox_id]
        assert ids(order="asc") == [first.sandbox_id, second.sandbox_id]
        assert ids(startedAfter=cut) == [second.sandbox_id]
        assert ids(template="base") == [second.sandbox_id, first.sandbox_id]
        assert ids(template="no-such-template") == []
        bad = requests.get(f"{base}/v2/sandboxes", params={"startedAfter": "yesterday"}, headers={"X-API-KEY": key}, timeout=10)
        assert bad.status_code == 400, bad.text
    finally:
        first.kill()
        second.kill()


@on_class("gvisor", reason=GVISOR_STATX)
def test_a_template_id_names_one_of_the_callers_templates(daemon):
    """`Sandbox.create("name")` runs the caller's hutch template of that name:
    its env and network policy come with it; an unknown name is a 404."""
    import requests

    r = requests.post(
        daemon["base"] + "/v1/templates",
        headers={"Authorization": f"Bearer {daemon['key']}"},
        json={"name": "e2b-tpl", "env": {"FROM_TPL": "yes"}, "network": {"egress": "deny_all"}},
        timeout=30,
    )
    assert r.status_code == 201, r.text
    sb = Sandbox.create("e2b-tpl")
    try:
        assert sb.get_info().template_id == "e2b-tpl"
        assert sb.commands.run("echo $FROM_TPL; ls /sys/class/net").stdout.split() == ["yes", "lo"]
    finally:
        sb.kill()
    with pytest.raises(Exception) as e:
        Sandbox.create("no-such-template")
    assert "not found" in str(e.value).lower(), e.value
