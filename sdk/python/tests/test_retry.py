"""Idempotent retries: an answer lost after the request reached the daemon
(a proxy drops the connection before forwarding it) is asked for again with
the same Idempotency-Key, and the command runs once; calls that a second
send would repeat are not retried."""

from __future__ import annotations

import hutch
import httpx
import pytest

from conftest import free_port, marker


def _count(client: hutch.Hutch, sb: hutch.Sandbox) -> str:
    return client.sandboxes.get(sb.id).exec("wc -l < /tmp/count").stdout


def test_a_dropped_exec_answer_is_replayed_and_the_command_ran_once(client, admin_key, sandbox, proxy):
    p = proxy(watch=b"/exec HTTP/1.1")
    with hutch.Hutch(p.url, admin_key) as via:
        sb = via.sandboxes.get(sandbox.id)
        p.drop = 1
        r = sb.exec("echo ran >> /tmp/count; wc -l < /tmp/count")
        assert p.dropped == 1 and p.requests == 2, (p.dropped, p.requests)
        assert r.stdout == "1\n"
        assert _count(client, sandbox) == "1\n"
        # A stream's refusal-free start is retried the same way.
        p.drop = 1
        with sb.exec_stream("echo streamed >> /tmp/count") as s:
            events = list(s)
        assert p.dropped == 2 and events[-1].type == "exit" and events[-1].exit_code == 0
        assert _count(client, sandbox) == "2\n"


def test_without_retries_the_same_key_still_replays(client, admin_key, sandbox, proxy):
    p = proxy(watch=b"/exec HTTP/1.1")
    with hutch.Hutch(p.url, admin_key, max_retries=0) as via:
        sb = via.sandboxes.get(sandbox.id)
        p.drop = 1
        key = f"manual-{marker()}"
        with pytest.raises(hutch.HutchConnectionError) as e:
            sb.exec("echo ran >> /tmp/count", idempotency_key=key)
        assert e.value.code == "connection_error" and e.value.status is None
        assert isinstance(e.value.__cause__, httpx.TransportError)
        assert p.requests == 1
        assert sb.exec("echo ran >> /tmp/count", idempotency_key=key).exit_code == 0
    assert _count(client, sandbox) == "1\n"


def test_a_retry_while_the_command_runs_is_refused_and_never_runs_it_twice(client, admin_key, sandbox, proxy):
    p = proxy(watch=b"/exec HTTP/1.1")
    key = f"slow-{marker()}"
    with hutch.Hutch(p.url, admin_key) as via:
        sb = via.sandboxes.get(sandbox.id)
        p.cut = 1
        with pytest.raises(hutch.IdempotencyError) as e:
            sb.exec("sleep 2; echo ran >> /tmp/count; wc -l < /tmp/count", idempotency_key=key)
        assert e.value.code == "execution_outcome_unknown" and p.requests == 2
    # Once it ended, the same key replays its outcome.
    r = hutch.Hutch(client.base_url, admin_key).sandboxes.get(sandbox.id)
    for _ in range(100):
        try:
            done = r.exec("sleep 2; echo ran >> /tmp/count; wc -l < /tmp/count", idempotency_key=key)
            break
        except hutch.IdempotencyError as err:
            assert err.code == "execution_outcome_unknown"
            r.exec("sleep 0.1")
    assert done.stdout == "1\n" and _count(client, sandbox) == "1\n"


def test_a_dropped_create_and_execution_make_one_each(client, admin_key, proxy):
    p = proxy(watch=b"POST /v1/")
    tag = marker()
    with hutch.Hutch(p.url, admin_key) as via:
        p.drop = 1
        sb = via.sandboxes.create(ttl=120, metadata={"retry": tag})
        assert p.dropped == 1 and p.requests == 2
        mine = [s for s in client.sandboxes.iter() if s.metadata.get("retry") == tag]
        assert [s.id for s in mine] == [sb.id]
        sb.delete()
        before = {s.id for s in client.sandboxes.list(limit=50)}
        p.drop = 1
        r = via.run("echo once")
        assert p.dropped == 2 and p.requests == 4 and r.stdout == "once\n"
        new = [s for s in client.sandboxes.list(limit=50) if s.id not in before]
        assert [s.id for s in new] == [r.sandbox_id]


def test_calls_a_second_send_would_repeat_are_not_retried(client, admin_key, sandbox, proxy):
    p = proxy(watch=b"/signal HTTP/1.1")
    proc = sandbox.exec("sleep 100", background=True)
    with hutch.Hutch(p.url, admin_key) as via:
        target = via.sandboxes.get(sandbox.id).process(proc.pid)
        p.drop = 1
        with pytest.raises(hutch.HutchConnectionError):
            target.signal("TERM")
        assert p.requests == 1
    t = proxy(watch=b"POST /v1/templates HTTP/1.1")
    with hutch.Hutch(t.url, admin_key) as via:
        t.drop = 1
        with pytest.raises(hutch.HutchConnectionError):
            via.templates.create(f"sdk-{marker()}")
        assert t.requests == 1
        # Reads are retried.
        g = proxy(watch=b"GET /v1/sandboxes/")
    with hutch.Hutch(g.url, admin_key) as via:
        g.drop = 1
        assert via.sandboxes.get(sandbox.id).id == sandbox.id and g.requests == 2


def test_a_refused_connection_is_retried_then_raised(admin_key):
    port = free_port()
    with hutch.Hutch(f"http://127.0.0.1:{port}", admin_key, max_retries=2) as c:
        with pytest.raises(hutch.HutchConnectionError) as e:
            c.sandboxes.create(ttl=60)
        assert isinstance(e.value.__cause__, httpx.ConnectError)
    with hutch.Hutch(f"http://127.0.0.1:{port}", admin_key, timeout=0.5) as c:
        with pytest.raises(hutch.HutchConnectionError):
            c.health()


async def test_async_retries_replay_too(client, admin_key, sandbox, proxy):
    p = proxy(watch=b"/exec HTTP/1.1")
    async with hutch.AsyncHutch(p.url, admin_key) as via:
        sb = await via.sandboxes.get(sandbox.id)
        p.drop = 1
        r = await sb.exec("echo ran >> /tmp/count; wc -l < /tmp/count")
        assert p.dropped == 1 and p.requests == 2 and r.stdout == "1\n"
        p.drop = 1
        async with await sb.exec_stream("echo again >> /tmp/count") as s:
            events = [e async for e in s]
        assert p.dropped == 2 and events[-1].exit_code == 0
    assert _count(client, sandbox) == "2\n"


def test_an_idle_connection_the_daemon_closed_is_not_reused(admin_key, sandbox, proxy):
    p = proxy(watch=b"/exec HTTP/1.1")
    with hutch.Hutch(p.url, admin_key, max_retries=0) as via:
        sb = via.sandboxes.get(sandbox.id)
        assert sb.exec("echo one").stdout == "one\n"
        assert p.close_connections() >= 1
        # No retries allowed: the closed connection must be seen before it is used.
        assert sb.exec("echo two").stdout == "two\n"
        assert p.requests == 2


async def test_an_idle_async_connection_the_daemon_closed_is_not_reused(admin_key, sandbox, proxy):
    p = proxy(watch=b"/exec HTTP/1.1")
    async with hutch.AsyncHutch(p.url, admin_key, max_retries=0) as via:
        assert via._transport.fast is not None
        sb = await via.sandboxes.get(sandbox.id)
        assert (await sb.exec("echo one")).stdout == "one\n"
        assert p.close_connections() >= 1
        assert (await sb.exec("echo two")).stdout == "two\n"
        assert p.requests == 2


@pytest.mark.parametrize("key", ["a\r\nX-Injected: 1", "a\nb"])
async def test_a_header_value_that_would_break_the_request_is_refused(admin_key, sandbox, daemon, key):
    with hutch.Hutch(daemon.base, admin_key) as c:
        with pytest.raises(ValueError):
            c.sandboxes.get(sandbox.id).exec("true", idempotency_key=key)
    async with hutch.AsyncHutch(daemon.base, admin_key) as c:
        sb = await c.sandboxes.get(sandbox.id)
        with pytest.raises(ValueError):
            await sb.exec("true", idempotency_key=key)
