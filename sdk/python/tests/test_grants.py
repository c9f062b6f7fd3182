"""Grants through the SDK: `Sandbox.grant` mints an `hg_` token, a client
made with it (`Hutch(api_key=token)`) reaches that sandbox for the named
scopes only, and rotating the key's grant secret revokes it."""

from __future__ import annotations

import pytest

import hutch


def test_a_grant_is_minted_used_refused_outside_its_scope_and_rotated(client: hutch.Hutch, daemon, user_key):
    key = user_key()
    with hutch.Hutch(daemon.base, key.secret, timeout=60) as owner:
        with owner.sandboxes.create(ttl="10m") as sb, owner.sandboxes.create(ttl="10m") as other:
            g = sb.grant(scopes=["exec", "files:read"], ttl=600)
            assert isinstance(g, hutch.Grant)
            assert g.token.startswith("hg_") and g.sandbox_id == sb.id
            assert g.scopes == ["exec", "files:read"]
            with hutch.Hutch(daemon.base, api_key=g.token, timeout=60) as user:
                mine = user.sandboxes.get(sb.id)
                assert mine.exec("echo hi").stdout == "hi\n"
                assert mine.files.read("/etc/hostname")
                with pytest.raises(hutch.PermissionDeniedError) as e:
                    mine.files.write("/workspace/x", b"no")
                assert e.value.code == "grant_scope"
                with pytest.raises(hutch.PermissionDeniedError):
                    user.sandboxes.get(other.id)
                with pytest.raises(hutch.PermissionDeniedError):
                    user.sandboxes.list()
                with pytest.raises(hutch.PermissionDeniedError):
                    mine.grant(scopes=["exec"], ttl=60)
                owner.keys.rotate_grant_secret(key.id)
                with pytest.raises(hutch.AuthenticationError):
                    user.sandboxes.get(sb.id)


def test_grant_arguments_are_checked_by_the_daemon(sandbox: hutch.Sandbox):
    for scopes, ttl in [([], 60), (["root"], 60), (["exec"], 0), (["exec"], 86401)]:
        with pytest.raises(hutch.InvalidRequestError):
            sandbox.grant(scopes=scopes, ttl=ttl)


def test_an_idle_timeout_is_sent_and_shown(client: hutch.Hutch):
    with client.sandboxes.create(ttl="10m", idle_timeout="1h", on_idle="delete") as sb:
        info = sb.refresh()
        assert info.idle_timeout_seconds == 3600 and info.on_idle == "delete"
        assert info.idle_since is not None
