"""A sandbox's ports by E2B's host names (`sandbox.get_host(port)`, under
the daemon's `--e2b-domain`): public and token-guarded ports, the masked
Host, auto-resume of a paused sandbox, and the refusals E2B's proxy gives
(no token, a wrong or foreign one, a closed port, an unknown sandbox)."""

import requests
from e2b import Sandbox

from conftest import wait_for

# Answers every GET with the Host it saw and the headers it got, as JSON.
ECHO = r"""
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"host": self.headers.get("Host"), "path": self.path,
                           "headers": {k.lower(): v for k, v in self.headers.items()}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
"""

PORT = 8000
TOKEN_HEADER = "e2b-traffic-access-token"


def serve(sb, port=PORT):
    sb.files.write("/home/user/echo.py", ECHO)
    sb.commands.run(f"python3 /home/user/echo.py {port}", background=True, timeout=0)


def get(daemon, host, path="/", **headers):
    """A request to the daemon naming `host`, as a client resolving the
    E2B domain to this host sends it."""
    return requests.get(f"{daemon['base']}{path}", headers={"Host": host, **headers}, timeout=30)


def wait_open(daemon, host, **headers):
    return wait_for(f"{host} to answer", lambda: (r := get(daemon, host, **headers)).status_code == 200 and r,
                    timeout=20, interval=0.1)


def test_get_host_names_the_port_under_the_domain_and_reaches_it(daemon):
    sb = Sandbox.create()
    try:
        host = sb.get_host(PORT)
        assert host == f"{PORT}-{sb.sandbox_id}.{daemon['domain']}"
        assert sb.traffic_access_token is None
        # Nothing listens yet: E2B's proxy answer for a closed port.
        r = get(daemon, host)
        assert r.status_code == 502 and r.json()["message"] == "The sandbox is running but port is not open", r.text
        assert r.json()["sandboxId"] == sb.sandbox_id
        serve(sb)
        r = wait_open(daemon, host)
        seen = r.json()
        # The application sees the Host as sent, and the path and query.
        assert seen["host"] == host and get(daemon, host, "/a/b?c=d").json()["path"] == "/a/b?c=d"
        # E2B's host names serve applications as they are: no hutch policy headers.
        assert "content-security-policy" not in {k.lower() for k in r.headers}
        # The envd port is the daemon's envd API.
        envd = get(daemon, sb.get_host(49983), "/health", **{"X-Access-Token": sb._envd_access_token})
        assert envd.status_code in (200, 204), envd.text
    finally:
        sb.kill()
    # A sandbox that ended is not found, as E2B's proxy says it.
    r = get(daemon, host)
    assert r.status_code == 502 and "was not found" in r.json()["message"], r.text


def test_unknown_sandboxes_and_other_domains_are_not_served_as_ports(daemon):
    r = get(daemon, f"{PORT}-sb-0000000000000000.{daemon['domain']}")
    assert r.status_code == 502 and "was not found" in r.json()["message"], r.text
    # A malformed label, or another domain, is the daemon's own API.
    assert get(daemon, f"x-y.{daemon['domain']}", "/healthz").status_code == 200
    assert get(daemon, "8000-sb-0000000000000000.elsewhere.test", "/healthz").status_code == 200


def test_private_ports_want_their_sandboxs_traffic_token(daemon):
    private = Sandbox.create(network={"allow_public_traffic": False})
    other = Sandbox.create(network={"allow_public_traffic": False})
    try:
        token = private.traffic_access_token
        assert token and token != other.traffic_access_token and token != private._envd_access_token
        # Connecting again answers the same token.
        assert Sandbox.connect(private.sandbox_id).traffic_access_token == token
        assert Sandbox.get_info(private.sandbox_id).network["allow_public_traffic"] is False
        serve(private)
        host = private.get_host(PORT)
        r = wait_open(daemon, host, **{TOKEN_HEADER: token})
        # The token never reaches the application.
        assert TOKEN_HEADER not in r.json()["headers"], r.json()
        missing = get(daemon, host)
        assert missing.status_code == 403 and "is missing" in missing.json()["message"], missing.text
        for bad in ["wrong", other.traffic_access_token, private._envd_access_token, token + "x"]:
            r = get(daemon, host, **{TOKEN_HEADER: bad})
            assert r.status_code == 403 and "is invalid" in r.json()["message"], (bad, r.text)
    finally:
        private.kill()
        other.kill()


def test_a_masked_host_is_what_the_application_sees(daemon):
    sb = Sandbox.create(network={"mask_request_host": "localhost:${PORT}"})
    try:
        assert Sandbox.get_info(sb.sandbox_id).network["mask_request_host"] == "localhost:${PORT}"
        serve(sb)
        host = sb.get_host(PORT)
        seen = wait_open(daemon, host).json()
        assert seen["host"] == f"localhost:{PORT}", seen
        assert seen["headers"].get("x-forwarded-host") == host, seen
    finally:
        sb.kill()
    with __import__("pytest").raises(Exception):
        Sandbox.create(network={"mask_request_host": "bad host\r\nx"})


def test_a_paused_sandbox_with_auto_resume_is_resumed_by_a_request(daemon):
    sb = Sandbox.create(lifecycle={"on_timeout": "pause", "auto_resume": True})
    plain = Sandbox.create()
    try:
        serve(sb)
        serve(plain)
        host, plain_host = sb.get_host(PORT), plain.get_host(PORT)
        wait_open(daemon, host)
        wait_open(daemon, plain_host)
        sb.pause()
        plain.pause()
        assert Sandbox.get_info(sb.sandbox_id).state.value == "paused"
        # The request resumes it, and the server it ran answers.
        r = get(daemon, host)
        assert r.status_code == 200 and r.json()["host"] == host, r.text
        assert Sandbox.get_info(sb.sandbox_id).state.value == "running"
        # Many requests at once to the paused sandbox: one resume, all served.
        sb.pause()
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: get(daemon, host).status_code, range(8)))
        assert codes == [200] * 8, codes
        assert Sandbox.get_info(sb.sandbox_id).state.value == "running"
        assert sb.commands.run("echo up").stdout == "up\n"
        # Without auto-resume, a paused sandbox stays paused.
        r = get(daemon, plain_host)
        assert r.status_code == 409 and "paused" in r.json()["message"], r.text
        assert Sandbox.get_info(plain.sandbox_id).state.value == "paused"
    finally:
        sb.kill()
        plain.kill()


def test_a_sandbox_without_internet_still_serves_its_ports(daemon):
    """E2B's egress rules say nothing of what comes in, as on E2B."""
    sb = Sandbox.create(allow_internet_access=False)
    try:
        serve(sb)
        host = sb.get_host(PORT)
        wait_open(daemon, host)
        # Opened, and closed again, it still serves.
        sb.update_network({})
        assert get(daemon, host).status_code == 200
        sb.update_network({"deny_out": ["0.0.0.0/0"]})
        assert get(daemon, host).status_code == 200
    finally:
        sb.kill()
