"""Sandboxes through the sync client: create with every field, get, list in
pages and as an iterator, extend, suspend, resume, delete; errors carry
their codes."""

from __future__ import annotations

import hutch
import pytest

from conftest import marker


def test_create_with_every_field_and_delete_on_exit(client: hutch.Hutch):
    tag = marker()
    fields = dict(
        template="base",
        ttl="10m",
        memory_mb=256,
        vcpus=0.5,
        disk_mib=128,
        pids=64,
        env={"GREETING": "hi"},
        metadata={"test": tag},
        network={"egress": "deny_all"},
        wait="30s",
        idempotency_key=f"create-{tag}",
        storage="disk",
        on_expire="pause",
        paused_ttl="2d",
    )
    with client.sandboxes.create(**fields) as sb:
        assert sb.state == "running" and sb.id.startswith("sb-")
        info = sb.info
        assert info.memory_mb == 256 and info.limits.vcpus == 0.5 and info.limits.disk_mib == 128
        assert info.limits.pids == 64 and info.metadata == {"test": tag} and sb.metadata == {"test": tag}
        assert info.network.egress == "deny_all" and info.template == "base"
        assert (info.storage, info.on_expire, info.paused_ttl_seconds) == ("disk", "pause", 2 * 86400)
        assert 590 <= (info.expires_at_datetime - hutch.models.parse_time(info.created_at)).total_seconds() <= 600
        assert sb.exec("echo $GREETING").stdout == "hi\n"
        # The same key again is the same sandbox, not a second one.
        assert client.sandboxes.create(**fields).id == sb.id
        with pytest.raises(hutch.IdempotencyError) as e:
            client.sandboxes.create(**{**fields, "memory_mb": 512})
        assert e.value.code == "idempotency_conflict" and e.value.status == 409
    assert sb.state == "terminated"
    assert client.sandboxes.get(sb.id).state == "terminated"


def test_network_policies_are_sent_as_given(client: hutch.Hutch):
    with client.sandboxes.create(ttl=120, network=hutch.Network(egress="default", allow=["pypi.org"],
                                                                 deny=["10.0.0.0/8"])) as sb:
        assert sb.info.network.egress == "default"
        assert sb.info.network.allow == ["pypi.org"] and sb.info.network.deny == ["10.0.0.0/8"]
    with client.sandboxes.create(ttl=120, network="private") as sb:
        assert sb.info.network.egress == "private"


def test_get_refresh_extend_suspend_resume(client: hutch.Hutch, sandbox: hutch.Sandbox):
    same = client.sandboxes.get(sandbox.id)
    assert same.id == sandbox.id and same.state == "running"
    before = sandbox.info.expires_at_datetime
    after = sandbox.extend("5m").expires_at_datetime
    assert 299 <= (after - before).total_seconds() <= 301
    until = "2100-01-01T00:00:00Z"
    with pytest.raises(hutch.InvalidRequestError) as e:
        sandbox.extend(until=until)  # past the template's maximum lifetime
    assert e.value.code == "invalid_request" and e.value.status == 400
    assert sandbox.suspend().state == "suspended"
    with pytest.raises(hutch.SandboxNotRunningError) as e:
        sandbox.exec("true")
    assert e.value.code == "sandbox_session_not_running" and e.value.status == 409
    assert sandbox.resume().state == "running"
    assert sandbox.exec("true").exit_code == 0
    assert sandbox.refresh().state == "running"
    with pytest.raises(ValueError):
        sandbox.extend()


def test_list_in_pages_and_iterate(client: hutch.Hutch):
    made = [client.sandboxes.create(ttl=120) for _ in range(3)]
    try:
        first = client.sandboxes.list(limit=2)
        assert len(first) == 2 and first.next_cursor
        second = client.sandboxes.list(limit=2, cursor=first.next_cursor)
        ids = [s.id for s in first] + [s.id for s in second]
        assert len(set(ids)) == len(ids)
        # Newest first: the three just made lead the listing.
        assert ids[:3] == [s.id for s in reversed(made)]
        every = [s.id for s in client.sandboxes.iter(page_size=2)]
        assert set(s.id for s in made) <= set(every) and len(every) == len(set(every))
        assert all(isinstance(s, hutch.Sandbox) for s in first)
        assert {s.id for s in client.sandboxes.iter(owner="*")} >= set(every)
    finally:
        for sb in made:
            assert client.sandboxes.delete(sb.id).state == "terminated"
            # Again is a no-op.
            assert sb.delete().state == "terminated"


def test_errors_carry_their_codes(client: hutch.Hutch, daemon):
    with pytest.raises(hutch.NotFoundError) as e:
        client.sandboxes.get("sb-doesnotexist")
    assert e.value.code == "not_found" and e.value.status == 404 and e.value.message
    with pytest.raises(hutch.InvalidRequestError) as e:
        client.sandboxes.create(template="no-such-template", ttl=60)
    assert e.value.code == "unknown_template"
    with pytest.raises(hutch.InvalidRequestError) as e:
        client.sandboxes.create(ttl=60, memory_mb=1)
    assert e.value.code == "invalid_request"
    with hutch.Hutch(daemon.base, "hutch_not_a_key") as bad:
        with pytest.raises(hutch.AuthenticationError) as e:
            bad.sandboxes.list()
        assert e.value.code == "unauthorized" and e.value.status == 401
        assert bad.health() is True
    with pytest.raises(ValueError):
        client.sandboxes.create(ttl="ten minutes")


def test_a_key_sees_only_its_own(client: hutch.Hutch, daemon, user_key):
    k = user_key(max_sandboxes=1)
    with hutch.Hutch(daemon.base, k.secret) as mine:
        sb = mine.sandboxes.create(ttl=120)
        assert sb.info.owner == k.id
        with pytest.raises(hutch.CapacityError) as e:
            mine.sandboxes.create(ttl=120)
        assert e.value.code == "quota_exceeded" and e.value.status == 429
        with pytest.raises(hutch.PermissionDeniedError) as e:
            mine.keys.list()
        assert e.value.code == "forbidden"
        with pytest.raises(hutch.NotFoundError):
            hutch.Sandbox(mine, client.sandboxes.create(ttl=60).info).exec("true")
        assert [s.id for s in client.sandboxes.list(owner=k.id)] == [sb.id]


def test_a_client_passed_in_carries_every_call(daemon, admin_key):
    import httpx

    seen = []
    with httpx.Client(event_hooks={"request": [lambda r: seen.append((r.method, r.url.path))]}) as h:
        c = hutch.Hutch(daemon.base, admin_key, http_client=h)
        with c.sandboxes.create(ttl="2m") as sb:
            assert sb.exec("echo through").stdout == "through\n"
    assert ("POST", "/v1/sandboxes") in seen and ("POST", f"/v1/sandboxes/{sb.id}/exec") in seen
    assert ("DELETE", f"/v1/sandboxes/{sb.id}") in seen
