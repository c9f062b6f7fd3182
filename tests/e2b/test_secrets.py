"""Secrets through the unmodified SDK's `Secret` API: `create`, `list`,
`get_info`, `exists`, `update` (a new version), `destroy`; values are never
answered, not kept in the clear, and another key's secrets are not there.
The same secrets as `/v1/secrets` (see tests/api/test_secrets.py for their
injection by the host)."""

import subprocess

import pytest
import requests
from e2b import Secret
from e2b.exceptions import SecretException, SecretNotFoundException

VALUE = "e2b-sdk-secret-value-5c1d9e7a3b"


def test_a_secret_is_made_listed_updated_and_destroyed_without_its_value(daemon):
    info = Secret.create("E2B_TOKEN", VALUE, metadata={"team": "ci"})
    try:
        assert info.secret_id.startswith("sec-") and info.name == "E2B_TOKEN"
        assert info.version == 1 and info.metadata == {"team": "ci"}
        paginator = Secret.list()
        listed = paginator.next_items()
        assert [s.name for s in listed] == ["E2B_TOKEN"] and not paginator.has_next
        assert Secret.get_info("E2B_TOKEN").secret_id == info.secret_id
        assert Secret.get_info(info.secret_id).name == "E2B_TOKEN"
        assert Secret.exists("E2B_TOKEN") and not Secret.exists("NO_SUCH")
        updated = Secret.update(info.secret_id, VALUE + "-2")
        assert updated.version == 2 and updated.metadata == {"team": "ci"}
        # Neither API answers the value; the state directory holds it sealed.
        h = {"Authorization": f"Bearer {daemon['key']}"}
        for path in ["/secrets", f"/secrets/{info.secret_id}", "/v1/secrets", "/v1/secrets/E2B_TOKEN"]:
            r = requests.get(daemon["base"] + path, headers={**h, "X-API-Key": daemon["key"]}, timeout=10)
            assert r.status_code == 200 and VALUE not in r.text, (path, r.text)
        found = subprocess.run(["grep", "-rlF", VALUE, str(daemon["root"])], capture_output=True, text=True)
        assert found.returncode == 1, f"the value is in the clear in: {found.stdout}"
        with pytest.raises(SecretException):
            Secret.create("E2B_TOKEN", "again")
        with pytest.raises(SecretException):
            Secret.create("not a name", "x")
    finally:
        Secret.destroy("E2B_TOKEN")
    assert not Secret.exists("E2B_TOKEN")
    assert Secret.destroy("E2B_TOKEN") is False


def test_another_keys_secret_is_not_there(daemon):
    d = daemon["daemon"]
    other = d.opts(d.make_key("e2b-secret-other"))
    info = Secret.create("PRIVATE_TOKEN", VALUE)
    try:
        assert Secret.list(**other).next_items() == []
        with pytest.raises(SecretNotFoundException):
            Secret.get_info(info.secret_id, **other)
        with pytest.raises(SecretNotFoundException):
            Secret.update("PRIVATE_TOKEN", "stolen", **other)
        assert Secret.destroy(info.secret_id, **other) is False
        assert Secret.get_info("PRIVATE_TOKEN").version == 1
    finally:
        Secret.destroy(info.secret_id)
