"""E2B's network rules from the SDK: `network` and `allow_internet_access`
on create, and `update_network` (`PUT /sandboxes/{id}/network`) replacing
them on a running sandbox, as hutch policies the host enforces (seen
through the native API's view, whose `applied` is read back from the
host's rules)."""

import pytest
import requests
from e2b import AsyncSandbox, NotFoundException, Sandbox, SandboxException

from conftest import E2bDaemon

PROBE = (
    "import socket\ntry:\n    socket.getaddrinfo('example.com', 80)\n    print('resolved')\n"
    "except OSError:\n    print('refused')"
)


def native(daemon, sid):
    r = requests.get(f"{daemon['base']}/v1/sandboxes/{sid}", headers={"Authorization": f"Bearer {daemon['key']}"},
                     timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["network"]


def put(daemon, sid, body, key=None):
    return requests.put(f"{daemon['base']}/sandboxes/{sid}/network", json=body,
                        headers={"X-API-KEY": key or daemon["key"]}, timeout=30)


def test_create_maps_e2b_rules_onto_host_policies(daemon):
    made = []
    try:
        off = Sandbox.create(allow_internet_access=False)
        made.append(off)
        # Closed, with an interface kept so that an update can open it.
        net = native(daemon, off.sandbox_id)
        assert (net["egress"], net["applied"]) == ("deny_all", "deny_all"), net
        assert off.get_info().allow_internet_access is False
        denied = Sandbox.create(network={"deny_out": ["0.0.0.0/0"]})
        made.append(denied)
        assert native(daemon, denied.sandbox_id)["egress"] == "deny_all"
        on = Sandbox.create()
        made.append(on)
        assert native(daemon, on.sandbox_id)["egress"] == "default"
        listed = Sandbox.create(network={"allow_out": ["pypi.org", "1.1.1.1"], "deny_out": ["0.0.0.0/0"]})
        made.append(listed)
        net = native(daemon, listed.sandbox_id)
        assert (net["egress"], sorted(net["allow"]), net["applied"]) == \
            ("default", ["1.1.1.1/32", "pypi.org"], "default"), net
        # Only names on the list resolve through the sandbox's resolver.
        assert listed.commands.run(f'python3 -c "{PROBE}"').stdout.strip() == "refused"
        info = listed.get_info().network
        assert info["allow_out"] == ["pypi.org", "1.1.1.1"] and info["deny_out"] == ["0.0.0.0/0"], info
        # An allowed range wins over the denied one it lies in: cut out of it.
        cut = Sandbox.create(network={"allow_out": ["203.0.113.0/26"], "deny_out": ["203.0.113.0/24"]})
        made.append(cut)
        assert native(daemon, cut.sandbox_id)["deny"] == ["203.0.113.64/26", "203.0.113.128/25"]
    finally:
        for sb in made:
            sb.kill()


@pytest.mark.parametrize("network", [
    {"allow_out": ["pypi.org"]},  # a name without everything else denied
    {"deny_out": ["pypi.org"]},
    {"deny_out": ["10.0.0.0/33"]},
    {"allow_out": ["not a name"], "deny_out": ["0.0.0.0/0"]},
    {"dns_servers": ["1.1.1.1"]},
])
def test_bad_rules_are_refused_before_anything_starts(daemon, network):
    before = {s.sandbox_id for s in Sandbox.list().next_items()}
    with pytest.raises(SandboxException) as e:
        Sandbox.create(network=network)
    assert "400" in str(e.value), e.value
    # Nothing new was made (others may end meanwhile).
    assert {s.sandbox_id for s in Sandbox.list().next_items()} <= before


def test_update_network_replaces_the_rules_of_a_running_sandbox(daemon):
    sb = Sandbox.create(allow_internet_access=False)
    try:
        sb.commands.run("true")
        # Opened while it runs: everything it left out is cleared.
        sb.update_network({"deny_out": ["198.51.100.0/24"]})
        net = native(daemon, sb.sandbox_id)
        assert (net["egress"], net["deny"], net["applied"]) == ("default", ["198.51.100.0/24"], "default"), net
        assert sb.get_info().network["deny_out"] == ["198.51.100.0/24"]
        # An allow list of names, then closed again, then the template's default.
        sb.update_network({"allow_out": ["pypi.org"], "deny_out": ["0.0.0.0/0"]})
        net = native(daemon, sb.sandbox_id)
        assert (net["egress"], net["allow"], net.get("deny", [])) == ("default", ["pypi.org"], []), net
        assert sb.commands.run(f'python3 -c "{PROBE}"').stdout.strip() == "refused"
        sb.update_network({"deny_out": ["0.0.0.0/0"]})
        net = native(daemon, sb.sandbox_id)
        assert (net["egress"], net["applied"]) == ("deny_all", "deny_all"), net
        sb.update_network({})
        net = native(daemon, sb.sandbox_id)
        assert (net["egress"], net.get("allow", []), net.get("deny", []), net["applied"]) == \
            ("default", [], [], "default"), net
        # The sandbox ran on throughout.
        assert sb.commands.run("echo still").stdout == "still\n"
    finally:
        sb.kill()


async def test_async_update_network(daemon):
    sb = await AsyncSandbox.create()
    try:
        await sb.update_network({"allow_out": ["pypi.org"], "deny_out": ["0.0.0.0/0"]})
        assert native(daemon, sb.sandbox_id)["allow"] == ["pypi.org"]
    finally:
        await sb.kill()


def test_update_network_refuses_bad_input_foreign_and_paused_sandboxes(daemon):
    sb = Sandbox.create()
    try:
        sid = sb.sandbox_id
        for body in [{"allowOut": ["pypi.org"]}, {"denyOut": ["nope"]}, {"egressProxy": {"url": "http://x"}}]:
            r = put(daemon, sid, body)
            assert r.status_code == 400 and r.json()["message"], (body, r.text)
        # A refused update leaves the policy as it was.
        assert native(daemon, sid)["egress"] == "default"
        other = daemon["daemon"].make_key("e2b-network-other")
        r = put(daemon, sid, {}, key=other)
        assert r.status_code == 404, r.text
        with pytest.raises(NotFoundException):
            Sandbox.update_network(sid, {}, api_key=other)
        assert put(daemon, "sb-0000000000000000", {}).status_code == 404
        sb.pause()
        r = put(daemon, sid, {"denyOut": ["0.0.0.0/0"]})
        assert r.status_code == 409, r.text
    finally:
        sb.kill()


def test_e2b_settings_and_closed_interfaces_survive_a_daemon_restart():
    d = E2bDaemon()
    try:
        sb = Sandbox.create(allow_internet_access=False, network={"allow_public_traffic": False}, **d.opts())
        own = {"base": d.base, "key": d.key}
        token = sb.traffic_access_token
        d.restart()
        net = native(own, sb.sandbox_id)
        assert (net["egress"], net["applied"]) == ("deny_all", "deny_all"), net
        # Its traffic token is still wanted, and still its own.
        host = {"Host": sb.get_host(8000)}
        r = requests.get(d.base + "/", headers=host, timeout=30)
        assert r.status_code == 403, r.text
        r = requests.get(d.base + "/", headers={**host, "e2b-traffic-access-token": token}, timeout=30)
        assert r.status_code == 502 and "port is not open" in r.json()["message"], r.text
        # The adopted interface opens as before.
        sb.update_network({"deny_out": ["198.51.100.0/24"]})
        net = native(own, sb.sandbox_id)
        assert (net["egress"], net["deny"], net["applied"]) == ("default", ["198.51.100.0/24"], "default"), net
        assert sb.commands.run("echo alive").stdout == "alive\n"
    finally:
        try:
            d.kill_all()
        finally:
            d.stop()
