"""Sandbox networks and egress policies, end to end, against real network
namespaces the suite makes itself:

- "the internet": a network namespace behind a router hop from the host,
  with addresses in 198.51.100.0/24 and 2001:db8:77::/64 on its loopback
  (and INET's NAT64 and 6to4 forms, and a site-local address, routed there
  too), a TCP server (port 8080, IPv4 and IPv6), a UDP echo (port 9090), a
  DNS server (port 53) that knows `allowed.test`, `other.test`,
  `*.wild.test`, a few aliases (CNAMEs), an answer with a record of
  another name, and `*.silent.test`, which it never answers; and a fake
  cloud metadata service at 169.254.169.254:80 routed through it;
- a TCP service on the host itself (all its addresses, loopback included);
- other sandboxes, of the same and of another owner, some of them
  flooding what sandboxes share (the resolver, conntrack).

For each policy, what must connect connects and what must not does not.
Everything the suite makes is removed at the end, also when a test fails.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conftest import Client, Daemon, expect_error, expect_status, net_links, wait_for

PID = os.getpid()
NETNS = f"hutch-inet-{PID}"
LINK_HOST = f"hti{PID % 100000}"
# The hop between the host and "the internet" (a private link, as a real
# uplink's would be; the daemon counts it among the host's networks).
HOP4_HOST, HOP4_NS = "192.168.250.1", "192.168.250.2"
HOP6_HOST, HOP6_NS = "fd99:77::1", "fd99:77::2"
INET = "198.51.100.2"  # DNS and servers
ALLOWED = "198.51.100.3"  # allowed.test, *.wild.test
OTHER = "198.51.100.4"  # other.test
INET6 = "2001:db8:77::2"
ALLOWED6 = "2001:db8:77::3"
METADATA = "169.254.169.254"
# INET's IPv4 address in the IPv6 forms that embed it (NAT64, 6to4), and
# an old site-local address: each is on the internet's loopback, routed
# there from the host, so only the policy can stop a sandbox reaching it.
NAT64_INET = "64:ff9b::c633:6402"
SIXTOFOUR_INET = "2002:c633:6402::1"
SITE_LOCAL = "fec0::2"
TRANSLATED = {"64:ff9b::/96": NAT64_INET, "2002::/16": SIXTOFOUR_INET, "fec0::/10": SITE_LOCAL}

SERVERS = textwrap.dedent(
    r'''
    import socket, struct, threading, sys

    NAMES = {"allowed.test": ("198.51.100.3", "2001:db8:77::3"), "other.test": ("198.51.100.4", None)}
    # name -> the name it is an alias of (the server answers the CNAME and
    # the target's records, as a recursive resolver does).
    CNAMES = {"alias.test": "other.test", "tricky.wild.test": "other.test", "good.wild.test": "allowed.test"}
    # name -> a record of another name slipped into its answer.
    EXTRA = {"extra.wild.test": ("other.test", "198.51.100.4")}

    def lookup(name):
        if name.endswith(".wild.test"):
            return NAMES["allowed.test"]
        return NAMES.get(name)

    def wire(name):
        return b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0"

    def record(owner, rtype, data, ttl=30):
        return owner + struct.pack(">HHIH", rtype, 1, ttl, len(data)) + data

    def tcp(family, addr, port, greeting):
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind((addr, port)); s.listen(64)
        while True:
            c, peer = s.accept()
            try:
                local = c.getsockname()[0].removeprefix("::ffff:")
                c.sendall(f"{greeting} {local}\n".encode())
            finally:
                c.close()

    def udp(family, addr):
        # Bound to the address itself, so replies leave from it.
        s = socket.socket(family, socket.SOCK_DGRAM)
        s.bind((addr, 9090))
        while True:
            data, peer = s.recvfrom(2048)
            s.sendto(b"echo " + data, peer)

    def dns():
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("198.51.100.2", 53))
        while True:
            q, peer = s.recvfrom(2048)
            try:
                off, labels = 12, []
                while q[off]:
                    labels.append(q[off + 1 : off + 1 + q[off]].decode().lower()); off += 1 + q[off]
                qtype = struct.unpack(">H", q[off + 1 : off + 3])[0]
                qend = off + 5
                name = ".".join(labels)
                if name.endswith(".silent.test"):
                    continue  # never answers
                answers = []
                owner = b"\xc0\x0c"
                if name in CNAMES:
                    target = CNAMES[name]
                    answers.append(record(owner, 5, wire(target)))
                    owner, name = wire(target), target
                found = lookup(name) if name not in CNAMES else None
                if found:
                    v4, v6 = found
                    if qtype == 1 and v4:
                        answers.append(record(owner, 1, socket.inet_aton(v4)))
                    if qtype == 28 and v6:
                        answers.append(record(owner, 28, socket.inet_pton(socket.AF_INET6, v6)))
                    if qtype == 1 and name in EXTRA:
                        other, addr = EXTRA[name]
                        answers.append(record(wire(other), 1, socket.inet_aton(addr)))
                rcode = 0 if found else 3
                hdr = q[:2] + struct.pack(">BBHHHH", 0x81, 0x80 | rcode, 1, len(answers), 0, 0)
                s.sendto(hdr + q[12:qend] + b"".join(answers), peer)
            except Exception as e:
                print("dns:", e, file=sys.stderr)

    for args in [(socket.AF_INET6, "::", 8080, "hello"), (socket.AF_INET, "169.254.169.254", 80, "metadata")]:
        threading.Thread(target=tcp, args=args, daemon=True).start()
    for args in [(socket.AF_INET, "198.51.100.2"), (socket.AF_INET6, "2001:db8:77::2")]:
        threading.Thread(target=udp, args=args, daemon=True).start()
    threading.Thread(target=dns, daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()
    '''
)


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}: {r.stderr}")
    return r


def host_address() -> str:
    """The host's own address on its default route."""
    r = subprocess.run(["ip", "-j", "route", "get", "1.1.1.1"], capture_output=True, text=True, timeout=10)
    return json.loads(r.stdout)[0]["prefsrc"]


def remove_internet() -> None:
    subprocess.run(["ip", "link", "del", LINK_HOST], capture_output=True, timeout=10)
    subprocess.run(["ip", "netns", "del", NETNS], capture_output=True, timeout=10)
    for route in ["198.51.100.0/24", f"{METADATA}/32"]:
        subprocess.run(["ip", "route", "del", route], capture_output=True, timeout=10)
    for route in ["2001:db8:77::/64", *TRANSLATED]:
        subprocess.run(["ip", "-6", "route", "del", route], capture_output=True, timeout=10)


@pytest.fixture(scope="module")
def internet(tmp_root: Path):
    remove_internet()
    servers = None
    try:
        ip("netns", "add", NETNS)
        ip("link", "add", LINK_HOST, "type", "veth", "peer", "name", "eth0", "netns", NETNS)
        ip("addr", "add", f"{HOP4_HOST}/30", "dev", LINK_HOST)
        ip("-6", "addr", "add", f"{HOP6_HOST}/64", "dev", LINK_HOST, "nodad")
        ip("link", "set", LINK_HOST, "up")
        ip("link", "set", "lo", "up", ns=NETNS)
        ip("addr", "add", f"{HOP4_NS}/30", "dev", "eth0", ns=NETNS)
        ip("-6", "addr", "add", f"{HOP6_NS}/64", "dev", "eth0", "nodad", ns=NETNS)
        ip("link", "set", "eth0", "up", ns=NETNS)
        for a in [INET, ALLOWED, OTHER, METADATA]:
            ip("addr", "add", f"{a}/32", "dev", "lo", ns=NETNS)
        for a in [INET6, ALLOWED6, *TRANSLATED.values()]:
            ip("-6", "addr", "add", f"{a}/128", "dev", "lo", "nodad", ns=NETNS)
        ip("route", "add", "default", "via", HOP4_HOST, ns=NETNS)
        ip("-6", "route", "add", "default", "via", HOP6_HOST, ns=NETNS)
        ip("route", "add", "198.51.100.0/24", "via", HOP4_NS)
        ip("route", "add", f"{METADATA}/32", "via", HOP4_NS)
        for route in ["2001:db8:77::/64", *TRANSLATED]:
            ip("-6", "route", "add", route, "via", HOP6_NS)
        script = tmp_root / "internet.py"
        script.write_text(SERVERS)
        servers = subprocess.Popen(
            ["ip", "netns", "exec", NETNS, "python3", str(script)],
            stdout=subprocess.PIPE,
            stderr=open(tmp_root / "internet.log", "wb"),
            start_new_session=True,
        )
        assert servers.stdout is not None and servers.stdout.readline().strip() == b"ready"
        yield
    finally:
        if servers is not None:
            servers.kill()
            servers.wait(timeout=10)
        remove_internet()


@pytest.fixture(scope="module")
def host_service():
    """A TCP service on every address of the host, loopback included."""
    srv = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    srv.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("::", 0))
    srv.listen(16)
    stop = threading.Event()

    def serve():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            c.sendall(b"host\n")
            c.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join(timeout=5)
    srv.close()


@pytest.fixture(scope="module")
def netd(tmp_root: Path, internet):
    """A daemon whose sandboxes' resolver forwards to "the internet"."""
    root = tmp_root / "net"
    root.mkdir(parents=True)
    d = Daemon(root, name="net")
    d.extra_env = {"HUTCH_DNS_UPSTREAM": f"{INET}:53", "HUTCH_NET_IPV6": "on"}
    d.start()
    yield d
    problems = d.teardown_with_network()
    assert not problems, problems


@pytest.fixture(scope="module")
def napi(netd: Daemon) -> Client:
    return netd.client("admin")


PROBE = textwrap.dedent(
    """
    import socket, sys
    kind, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    try:
        if kind == "tcp":
            s = socket.create_connection((host, port), timeout=3)
            print("OK", s.recv(100).decode().strip())
        elif kind == "udp":
            fam = socket.AF_INET6 if ":" in host else socket.AF_INET
            s = socket.socket(fam, socket.SOCK_DGRAM); s.settimeout(3)
            s.sendto(b"ping", (host, port))
            print("OK", s.recv(100).decode())
        elif kind == "dns":
            fam = socket.AF_INET6 if port == 6 else socket.AF_INET
            print("OK", socket.getaddrinfo(host, 80, fam, socket.SOCK_STREAM)[0][4][0])
    except Exception as e:
        print("FAIL", type(e).__name__, e)
    """
)


# A TCP service inside a sandbox: greets and closes (IPv4 and IPv6, or
# loopback only).
SERVE = (
    "import socket,sys\n"
    "s=socket.socket(socket.AF_INET6)\n"
    "s.setsockopt(socket.IPPROTO_IPV6,socket.IPV6_V6ONLY,0)\n"
    "s.bind((sys.argv[1],7000)); s.listen(16)\n"
    "while True:\n"
    "    c,_=s.accept(); c.sendall(b'hi\\n'); c.close()\n"
)


def serve(api: Client, sb: str, bind: str = "::") -> None:
    api.exec_raw(sb, {"argv": ["python3", "-c", SERVE, bind], "background": True})
    local = "::1" if bind == "::1" else "127.0.0.1"
    wait_for("the sandbox's server", lambda: reaches(api, sb, "tcp", local, 7000), timeout=15)


def probe(api: Client, sb: str, kind: str, host: str, port: int = 0, user: str = "user") -> str:
    res = api.exec(sb, argv=["python3", "-c", PROBE, kind, host, str(port)], user=user, timeout_seconds=20)
    assert res["exit_code"] == 0, res
    return res["stdout"].strip()


def reaches(api: Client, sb: str, kind: str, host: str, port: int = 0, user: str = "user") -> bool:
    out = probe(api, sb, kind, host, port, user)
    assert out.startswith(("OK", "FAIL")), out
    return out.startswith("OK")


def create(api: Client, **network) -> dict:
    sb = api.create(network=network) if network else api.create()
    assert sb["state"] == "running", sb
    return sb


def test_default_reaches_the_internet_over_tcp_udp_ipv4_ipv6_and_dns(napi: Client):
    sb = create(napi, egress="default")
    assert sb["network"]["egress"] == "default"
    assert sb["network"]["applied"] == "default"
    assert len(sb["network"]["addresses"]) == 2, sb["network"]
    i = sb["id"]
    assert probe(napi, i, "tcp", INET, 8080) == f"OK hello {INET}"
    assert probe(napi, i, "tcp", INET6, 8080) == f"OK hello {INET6}"
    assert probe(napi, i, "udp", INET, 9090) == "OK echo ping"
    assert probe(napi, i, "udp", INET6, 9090) == "OK echo ping"
    assert probe(napi, i, "dns", "allowed.test", 4) == f"OK {ALLOWED}"
    assert probe(napi, i, "dns", "allowed.test", 6) == f"OK {ALLOWED6}"
    assert probe(napi, i, "dns", "other.test", 4) == f"OK {OTHER}"
    resolv = napi.sh(i, "cat /etc/resolv.conf")
    assert "nameserver 100." in resolv
    # The resolver file is the host's, read-only: root cannot point it elsewhere.
    res = napi.exec(i, "echo nameserver 1.1.1.1 > /etc/resolv.conf", user="root")
    assert res["exit_code"] != 0, res


def test_default_never_reaches_the_host_metadata_or_link_local(napi: Client, host_service: int):
    sb = create(napi)
    i = sb["id"]
    gateway = sb["network"]["addresses"][0].rsplit(".", 2)[0] + ".0.1"
    # Positive control: the service is up and reachable from the host.
    with socket.create_connection((host_address(), host_service), timeout=3) as c:
        assert c.recv(10) == b"host\n"
    for target in [host_address(), gateway, HOP4_HOST]:
        assert not reaches(napi, i, "tcp", target, host_service), target
    assert not reaches(napi, i, "tcp", "fe80::1%eth0", host_service)
    assert not reaches(napi, i, "tcp", HOP6_HOST, host_service)
    # The metadata address is routed to a live service: only the policy stops it.
    assert not reaches(napi, i, "tcp", METADATA, 80)
    assert not reaches(napi, i, "udp", host_address(), 53)


def test_default_sandboxes_cannot_reach_each_other(napi: Client):
    a, b = create(napi), create(napi)
    serve(napi, b["id"])
    assert not reaches(napi, a["id"], "tcp", b["network"]["addresses"][0], 7000)
    assert not reaches(napi, a["id"], "tcp", b["network"]["addresses"][1], 7000)


def test_deny_all_has_only_loopback_and_root_cannot_lift_it(napi: Client):
    sb = create(napi, egress="deny_all")
    assert sb["network"]["applied"] == "deny_all"
    assert sb["network"].get("addresses", []) == []
    i = sb["id"]
    links = napi.sh(i, "ls /sys/class/net").split()
    assert links == ["lo"], links
    serve(napi, i, "::1")
    assert not reaches(napi, i, "dns", "allowed.test", 4)
    # Root tries to lift the policy: flush every rule, add links and routes.
    for cmd in ["nft flush ruleset", "ip link add x type veth peer name y", "ip route add default dev lo",
                "ip link set lo down"]:
        res = napi.exec(i, cmd, user="root")
        assert res["exit_code"] != 0, (cmd, res)
    for user in ["root", "user"]:
        assert not reaches(napi, i, "tcp", INET, 8080, user)
        assert not reaches(napi, i, "tcp", INET6, 8080, user)
        assert not reaches(napi, i, "udp", INET, 9090, user)
        assert not reaches(napi, i, "tcp", METADATA, 80, user)
    assert reaches(napi, i, "tcp", "::1", 7000)


def test_private_reaches_its_group_only(napi: Client, netd: Daemon):
    a, b = create(napi, egress="private"), create(napi, egress="private")
    assert a["network"]["applied"] == "private"
    other = netd.new_client("net-other")
    c = other.create(network={"egress": "private"})
    plain = create(napi)
    for sb, api in [(b, napi), (c, other), (plain, napi)]:
        serve(api, sb["id"])
    assert reaches(napi, a["id"], "tcp", b["network"]["addresses"][0], 7000)
    assert reaches(napi, a["id"], "tcp", b["network"]["addresses"][1], 7000)
    assert not reaches(napi, a["id"], "tcp", c["network"]["addresses"][0], 7000), "another owner's group"
    assert not reaches(napi, a["id"], "tcp", plain["network"]["addresses"][0], 7000), "a default sandbox"
    assert not reaches(napi, plain["id"], "tcp", b["network"]["addresses"][0], 7000), "into the group"
    assert not reaches(napi, a["id"], "tcp", INET, 8080)
    assert not reaches(napi, a["id"], "dns", "allowed.test", 4)
    other.destroy(c["id"])


def test_domain_allowlist_admits_only_what_it_resolved(napi: Client):
    sb = create(napi, allow=["allowed.test", "*.wild.test"])
    assert sb["network"]["applied"] == "default"
    i = sb["id"]
    # Before any lookup, not even the allowed address is reachable.
    assert not reaches(napi, i, "tcp", ALLOWED, 8080)
    assert probe(napi, i, "dns", "allowed.test", 4) == f"OK {ALLOWED}"
    assert probe(napi, i, "tcp", "allowed.test", 8080) == f"OK hello {ALLOWED}"
    assert probe(napi, i, "dns", "allowed.test", 6) == f"OK {ALLOWED6}"
    assert reaches(napi, i, "tcp", ALLOWED6, 8080)
    assert probe(napi, i, "dns", "x.wild.test", 4) == f"OK {ALLOWED}"
    assert not reaches(napi, i, "dns", "other.test", 4)
    assert not reaches(napi, i, "dns", "wild.test", 4), "a wildcard covers names below it only"
    assert not reaches(napi, i, "tcp", OTHER, 8080), "the raw IP of other.test"
    assert not reaches(napi, i, "tcp", INET, 8080)
    # /etc/hosts pointing an allowed name at another address does not help.
    napi.sh(i, f"echo '{OTHER} sneaky.allowed.test' >> /etc/hosts", user="root")
    assert not reaches(napi, i, "tcp", "sneaky.allowed.test", 8080)
    assert not reaches(napi, i, "tcp", METADATA, 80)


def test_cidr_allow_and_deny_lists(napi: Client):
    allowed = create(napi, allow=[f"{OTHER}/32", "2001:db8:77::/64"])
    assert reaches(napi, allowed["id"], "tcp", OTHER, 8080)
    assert reaches(napi, allowed["id"], "tcp", INET6, 8080)
    assert not reaches(napi, allowed["id"], "tcp", ALLOWED, 8080)
    assert not reaches(napi, allowed["id"], "dns", "other.test", 4), "names are not on the list"
    denied = create(napi, deny=[f"{ALLOWED}/32", "other.test"])
    assert not reaches(napi, denied["id"], "tcp", ALLOWED, 8080)
    assert reaches(napi, denied["id"], "tcp", OTHER, 8080)
    assert not reaches(napi, denied["id"], "dns", "other.test", 4)
    assert reaches(napi, denied["id"], "dns", "allowed.test", 4)


def test_bad_policies_are_refused_before_anything_starts(napi: Client):
    before = len(napi.list_all())
    for network in [
        {"egress": "open"},
        {"egress": "deny_all", "allow": ["pypi.org"]},
        {"egress": "default", "allow": ["not a name"]},
        {"egress": "default", "allow": ["10.0.0.0/99"]},
        {"egress": "default", "allow": [f"10.0.{n}.0/24" for n in range(65)]},
        {"egress": "default", "surprise": True},
    ]:
        r = napi.post("/v1/sandboxes", {"network": network})
        expect_error(r, 400, "invalid_request")
    assert len(napi.list_all()) == before


def test_flushed_host_rules_come_back_with_every_policy(napi: Client, netd: Daemon, host_service: int):
    sb = create(napi)
    listed = create(napi, allow=["allowed.test"])
    assert probe(napi, listed["id"], "dns", "allowed.test", 4) == f"OK {ALLOWED}"
    # A host admin flushes the table behind the daemon's back.
    subprocess.run(["nft", "delete", "table", "inet", f"hutch{netd.net_instance}"], check=True, timeout=10)
    wait_for("the table to be loaded again", lambda: subprocess.run(
        ["nft", "list", "set", "inet", f"hutch{netd.net_instance}", "listed4"], capture_output=True, text=True,
        timeout=10).stdout.count(listed["network"]["addresses"][0]) == 1, timeout=10)
    assert not reaches(napi, sb["id"], "tcp", host_address(), host_service)
    assert reaches(napi, sb["id"], "tcp", INET, 8080)
    assert reaches(napi, listed["id"], "tcp", ALLOWED, 8080), "what was admitted is admitted again"
    assert not reaches(napi, listed["id"], "tcp", OTHER, 8080)
    assert create(napi)["network"]["applied"] == "default"


def test_networks_survive_a_daemon_restart(own_daemon: Daemon, internet):
    d = own_daemon
    d.extra_env = {"HUTCH_DNS_UPSTREAM": f"{INET}:53", "HUTCH_NET_IPV6": "on"}
    d.start()
    api = d.client("admin")
    sb = create(api, allow=["allowed.test"])
    assert probe(api, sb["id"], "tcp", "allowed.test", 8080) == f"OK hello {ALLOWED}"
    d.stop()
    d.start()
    after = api.sandbox(sb["id"])
    assert after["state"] == "running" and after["network"] == sb["network"], after
    # The policy came back with it: what was admitted, and nothing more.
    assert reaches(api, sb["id"], "tcp", ALLOWED, 8080)
    assert not reaches(api, sb["id"], "tcp", OTHER, 8080)
    assert probe(api, sb["id"], "dns", "allowed.test", 4) == f"OK {ALLOWED}"


def test_suspend_makes_applied_unknown_until_resume(napi: Client):
    sb = create(napi)
    r = napi.post(f"/v1/sandboxes/{sb['id']}/suspend")
    assert r.status_code in (200, 202), r.text
    assert napi.sandbox(sb["id"])["network"]["applied"] == "unknown"
    r = napi.post(f"/v1/sandboxes/{sb['id']}/resume")
    assert r.status_code in (200, 202), r.text
    assert napi.sandbox(sb["id"])["network"]["applied"] == "default"


def test_many_creates_reuse_namespaces_and_leave_nothing(napi: Client, netd: Daemon):
    # The daemon keeps 8 namespaces ready: measure once the pool is full, so
    # that its first fill does not count as growth.
    wait_for("the namespace pool to fill", lambda: len(net_links(netd.net_instance)) >= 8, timeout=30)
    links_before = set(net_links(netd.net_instance))
    for _ in range(12):
        sb = create(napi)
        napi.destroy(sb["id"])
    grown = set(net_links(netd.net_instance)) - links_before
    # Namespaces are recycled: a dozen sandboxes in a row need no dozen links.
    assert len(grown) <= 4, grown


def test_one_shot_executions_take_a_policy(napi: Client):
    r = napi.post("/v1/executions", {"command": "ls /sys/class/net", "network": {"egress": "deny_all"}})
    assert r.status_code == 200, r.text
    assert r.json()["stdout"].split() == ["lo"]
    r = napi.post("/v1/executions", {"argv": ["python3", "-c", PROBE, "tcp", INET, "8080"]})
    assert r.status_code == 200, r.text
    assert r.json()["stdout"].strip() == f"OK hello {INET}"


def test_templates_carry_a_network_policy(napi: Client):
    r = napi.post("/v1/templates", {"name": f"net-{PID}", "network": {"egress": "deny_all"}, "warm": {"min": 1, "max": 2}})
    assert r.status_code == 201, r.text
    tpl = r.json()
    assert tpl["network"]["egress"] == "deny_all"
    try:
        wait_for("a warm sandbox", lambda: napi.get(f"/v1/templates/{tpl['id']}").json()["warm_ready"] >= 1, timeout=30)
        warm = napi.create(template=tpl["name"])
        assert warm["warm"] and warm["network"]["applied"] == "deny_all", warm
        assert napi.sh(warm["id"], "ls /sys/class/net").split() == ["lo"]
        # A create may choose its own policy; it then starts cold.
        own = napi.create(template=tpl["name"], network={"egress": "default"})
        assert not own["warm"] and own["network"]["applied"] == "default", own
        # A new policy is a new version: old warm sandboxes are never claimed.
        r = napi.request("PATCH", f"/v1/templates/{tpl['id']}", json={"network": {"egress": "private"}})
        assert r.status_code == 200 and r.json()["version"] == tpl["version"] + 1, r.text
        a = napi.create(template=tpl["name"])
        b = napi.create(template=tpl["name"])
        for sb in (a, b):
            assert sb["network"]["applied"] == "private" and sb["template_version"] == tpl["version"] + 1, sb
        serve(napi, b["id"])
        assert reaches(napi, a["id"], "tcp", b["network"]["addresses"][0], 7000), "same template, same owner"
        bad = napi.post("/v1/templates", {"name": f"net2-{PID}", "network": {"egress": "deny_all", "allow": ["x.org"]}})
        expect_error(bad, 400, "invalid_request")
    finally:
        napi.delete(f"/v1/templates/{tpl['id']}")


def test_ipv6_forms_of_ipv4_and_site_local_are_refused(napi: Client):
    sb = create(napi)
    denied = create(napi, deny=[f"{INET}/32"])
    # Positive controls: each address answers from the host, and the plain
    # IPv6 internet answers the sandbox.
    for addr in TRANSLATED.values():
        with socket.create_connection((addr, 8080), timeout=3) as c:
            assert c.recv(100).startswith(b"hello"), addr
    assert reaches(napi, sb["id"], "tcp", INET6, 8080)
    for prefix, addr in TRANSLATED.items():
        assert not reaches(napi, sb["id"], "tcp", addr, 8080), prefix
    # A deny of an IPv4 address holds for its NAT64 form too.
    assert not reaches(napi, denied["id"], "tcp", INET, 8080)
    assert not reaches(napi, denied["id"], "tcp", NAT64_INET, 8080)
    assert reaches(napi, denied["id"], "tcp", INET6, 8080)


def test_a_cname_into_a_denied_or_unlisted_name_is_refused_and_not_admitted(napi: Client):
    listed = create(napi, allow=["allowed.test", "*.wild.test"])
    i = listed["id"]
    # tricky.wild.test is an alias of other.test, which is not on the list.
    assert not reaches(napi, i, "dns", "tricky.wild.test", 4)
    assert not reaches(napi, i, "tcp", OTHER, 8080), "the CNAME target's address was admitted"
    # An answer's records of another name are not admitted either.
    assert probe(napi, i, "dns", "extra.wild.test", 4) == f"OK {ALLOWED}"
    assert not reaches(napi, i, "tcp", OTHER, 8080), "a record of another name was admitted"
    # An alias whose every name is allowed works.
    assert probe(napi, i, "dns", "good.wild.test", 4) == f"OK {ALLOWED}"
    assert probe(napi, i, "tcp", "good.wild.test", 8080) == f"OK hello {ALLOWED}"
    # A deny of a name holds through an alias of it.
    denied = create(napi, deny=["other.test"])
    assert not reaches(napi, denied["id"], "dns", "alias.test", 4)
    assert not reaches(napi, denied["id"], "dns", "other.test", 4)
    # Denied beats allowed, through an alias too.
    both = create(napi, allow=["*.wild.test", "other.test"], deny=["other.test"])
    assert not reaches(napi, both["id"], "dns", "tricky.wild.test", 4)
    assert not reaches(napi, both["id"], "tcp", OTHER, 8080)
    plain = create(napi)
    assert probe(napi, plain["id"], "dns", "alias.test", 4) == f"OK {OTHER}"


# A DNS client: `count` queries for `name`, one at a time, to the
# sandbox's resolver, each given `timeout` seconds; prints how many were
# answered (NOERROR with an answer) and how many were not.
DNSQ = textwrap.dedent(
    """
    import random, socket, struct, sys
    name, count, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    server = next(l.split()[1] for l in open("/etc/resolv.conf") if l.startswith("nameserver"))
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(timeout)
    answered = failed = 0
    for _ in range(count):
        qid = random.randrange(65536)
        q = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0)
        q += b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\\0" + struct.pack(">HH", 1, 1)
        s.sendto(q, (server, 53))
        try:
            while True:
                r = s.recv(4096)
                if r[:2] == q[:2]:
                    break
            ok = r[3] & 0x0F == 0 and struct.unpack(">H", r[6:8])[0] > 0
        except socket.timeout:
            ok = False
        answered += ok
        failed += not ok
    print(answered, failed)
    """
)

# A flood of queries to the sandbox's resolver until /tmp/stop exists (or
# 90 s): half for names that are answered at once, half for names whose
# server never answers; /tmp/flooding appears once it is under way.
FLOOD_DNS = textwrap.dedent(
    """
    import os, random, socket, struct, time
    server = next(l.split()[1] for l in open("/etc/resolv.conf") if l.startswith("nameserver"))
    def q(name):
        return struct.pack(">HHHHHH", random.randrange(65536), 0x0100, 1, 0, 0, 0) + b"".join(
            bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\\0" + struct.pack(">HH", 1, 1)
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(8)]
    for s in socks:
        s.setblocking(False)
    end, sent = time.monotonic() + 90, 0
    while time.monotonic() < end and not os.path.exists("/tmp/stop"):
        for s in socks:
            name = "allowed.test" if sent % 2 else f"n{sent}.silent.test"
            try:
                s.sendto(q(name), (server, 53))
                sent += 1
            except (BlockingIOError, OSError):
                pass
            try:
                while True:
                    s.recv(4096)
            except (BlockingIOError, OSError):
                pass
        if sent >= 2000 and not os.path.exists("/tmp/flooding"):
            open("/tmp/flooding", "w").write(str(sent))
    """
)


# How many FLOOD_DNS processes run (its own command line does not match).
FLOODING = (
    "import os\n"
    "print(sum(b'sil' + b'ent.test' in open(f'/proc/{p}/cmdline', 'rb').read() for p in os.listdir('/proc') if p.isdigit()))"
)


def test_a_flooding_sandbox_does_not_starve_its_neighbours_resolver(napi: Client, netd: Daemon):
    other = netd.new_client("dns-flooder")
    flooder = other.create(network={"egress": "default"})
    quiet = create(napi)
    for _ in range(2):
        other.exec_raw(flooder["id"], {"argv": ["python3", "-c", FLOOD_DNS], "background": True})
    try:
        wait_for("the flood", lambda: other.exec(flooder["id"], "test -f /tmp/flooding")["exit_code"] == 0, timeout=30)
        res = napi.exec(quiet["id"], argv=["python3", "-c", DNSQ, "allowed.test", "20", "2"], timeout_seconds=50)
        assert res["exit_code"] == 0, res
        answered, failed = map(int, res["stdout"].split())
        # Still flooding: the neighbour's answers were measured during it.
        floods = other.exec(flooder["id"], argv=["python3", "-c", FLOODING])["stdout"].strip()
        assert floods == "2", floods
        assert (answered, failed) == (20, 0), f"the quiet sandbox got {answered} answers and {failed} failures"
    finally:
        other.exec(flooder["id"], "touch /tmp/stop")
        other.destroy(flooder["id"])


# New flows without end, slower than the new-flow rate limit (about 400 a
# second), so it is the limit on flows tracked at once that stops them:
# UDP datagrams to ever new ports of the internet (nothing listens there,
# so each stays tracked, unreplied, for 30 s), until /tmp/stop exists (or
# 90 s).
FLOOD_FLOWS = textwrap.dedent(
    """
    import os, socket, sys, time
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    end, port = time.monotonic() + 90, 0
    while time.monotonic() < end and not os.path.exists("/tmp/stop"):
        for _ in range(40):
            try:
                s.sendto(b"x", (sys.argv[1], 20000 + port % 40000))
            except OSError:
                pass
            port += 1
        time.sleep(0.1)
    """
)


def test_a_sandbox_past_its_flow_limit_is_refused_while_its_neighbour_works(napi: Client, netd: Daemon):
    other = netd.new_client("flow-flooder")
    flooder = other.create(network={"egress": "default"})
    quiet = create(napi)
    assert reaches(other, flooder["id"], "tcp", INET, 8080), "before the flood"
    other.exec_raw(flooder["id"], {"argv": ["python3", "-c", FLOOD_FLOWS, INET], "background": True})
    try:
        wait_for("the flooder's new flows to be refused", lambda: not reaches(other, flooder["id"], "tcp", INET, 8080),
                 timeout=60, interval=0.5)
        for _ in range(3):
            assert probe(napi, quiet["id"], "tcp", INET, 8080) == f"OK hello {INET}"
            assert probe(napi, quiet["id"], "udp", INET, 9090) == "OK echo ping"
        assert not reaches(other, flooder["id"], "udp", INET, 9090)
    finally:
        other.exec(flooder["id"], "touch /tmp/stop")
        other.destroy(flooder["id"])
    # Its flows went with it: the next sandbox, on the same recycled
    # namespace and address, starts with none of them.
    after = other.create(network={"egress": "default"})
    assert after["network"]["addresses"] == flooder["network"]["addresses"], (after, flooder)
    assert reaches(other, after["id"], "tcp", INET, 8080)
    other.destroy(after["id"])


def test_a_network_the_host_joins_later_is_refused_without_a_restart(napi: Client):
    link, peer = f"htn{PID % 100000}", "eth1"
    net, near, host = "203.0.113.0/24", "203.0.113.10", "203.0.113.1"
    sb = create(napi)
    try:
        # 203.0.113.0/24 starts as the internet: behind the router hop.
        ip("link", "add", link, "type", "veth", "peer", "name", peer, "netns", NETNS)
        ip("link", "set", link, "up")
        ip("addr", "add", f"{near}/24", "dev", peer, ns=NETNS)
        ip("link", "set", peer, "up", ns=NETNS)
        ip("route", "add", net, "via", HOP4_NS, "metric", "100")
        wait_for("the internet's new address", lambda: reaches(napi, sb["id"], "tcp", near, 8080), timeout=15)
        # Then the host joins that network (DHCP, a VPN, a new bridge).
        ip("addr", "add", f"{host}/24", "dev", link)
        wait_for("the host's new network to be refused", lambda: not reaches(napi, sb["id"], "tcp", near, 8080),
                 timeout=15, interval=0.2)
        assert reaches(napi, sb["id"], "tcp", INET, 8080), "the rest of the internet stays"
        # And leaves it again.
        ip("addr", "del", f"{host}/24", "dev", link)
        wait_for("the network to be the internet again", lambda: reaches(napi, sb["id"], "tcp", near, 8080),
                 timeout=15, interval=0.2)
    finally:
        subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=10)
        subprocess.run(["ip", "route", "del", net], capture_output=True, timeout=10)


def test_a_second_daemon_on_the_same_instance_refuses_to_start(netd: Daemon, tmp_root: Path):
    root = tmp_root / "second"
    root.mkdir()
    second = Daemon(root, name="second")
    try:
        second.net_instance = netd.net_instance
        with pytest.raises(AssertionError) as refused:
            second.start()
        assert f"network instance {netd.net_instance} is held by another hutch daemon (pid {netd.pid})" in str(
            refused.value
        ), refused.value
        assert netd.alive()
        assert netd.client("admin").get("/healthz").status_code == 200
    finally:
        if second.alive():
            second.stop()
        second.release_net()


def test_a_first_run_without_nft_or_btrfs_tools_gets_networks_and_disk_state(own_daemon: Daemon, internet):
    """A host without nftables or btrfs-progs installed: the daemon loads its
    ruleset over netlink and makes its storage image from the embedded seed,
    so networks and disk-backed sandboxes work on a PATH that has neither
    tool (nor any other: the daemon runs no program for them)."""
    d = own_daemon
    bare = d.root / "bin"
    bare.mkdir()
    for tool in ["python3", "sh"]:
        (bare / tool).symlink_to(shutil.which(tool))
    for hidden in ["nft", "mkfs.btrfs", "btrfs", "btrfstune"]:
        assert shutil.which(hidden, path=str(bare)) is None, hidden
    d.extra_env = {"PATH": str(bare), "HUTCH_DNS_UPSTREAM": f"{INET}:53", "HUTCH_NET_IPV6": "on"}
    d.start()
    log = d.log_path.read_text(errors="replace")
    assert "no sandbox networking" not in log and "no disk storage" not in log, d.log_tail()
    assert (d.state_dir / "storage" / "btrfs.img").is_file()
    doctor = subprocess.run(
        [str(d.binary), "doctor", "--json", "--state-dir", str(d.state_dir)],
        env={"PATH": str(bare)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    findings = {f["name"]: f for f in json.loads(doctor.stdout)["findings"]}
    assert findings["network"]["ok"] and findings["storage"]["ok"], findings

    api = d.client("admin")
    sb = create(api, allow=[f"{OTHER}/32", "allowed.test"])
    i = sb["id"]
    assert sb["storage"] == "disk", sb
    # The policy is enforced: listed addresses and names only.
    assert probe(api, i, "tcp", OTHER, 8080) == f"OK hello {OTHER}"
    assert probe(api, i, "tcp", "allowed.test", 8080) == f"OK hello {ALLOWED}"
    assert not reaches(api, i, "tcp", INET, 8080)
    assert not reaches(api, i, "tcp", METADATA, 80)
    assert not reaches(api, i, "dns", "other.test", 4)
    # Disk-backed state: kept across a pause to disk and a resume.
    api.sh(i, "echo kept > /workspace/k")
    r = api.post(f"/v1/sandboxes/{i}/suspend", {"mode": "disk"})
    expect_status(r, 200)
    assert api.sandbox(i)["state"] == "paused"
    expect_status(api.post(f"/v1/sandboxes/{i}/resume"), 200)
    assert api.sh(i, "cat /workspace/k") == "kept\n"
    assert reaches(api, i, "tcp", OTHER, 8080)
