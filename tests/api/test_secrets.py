"""Secrets that never enter a sandbox, end to end, against a daemon whose
sandboxes reach "the internet" of test_network.py (a network namespace
with `allowed.test` at 198.51.100.3 and `other.test` at 198.51.100.4),
where an HTTPS server of the test's own CA answers on port 443 with the
request's headers and whom it served.

- the API keeps names, hosts and times, never values; the value is not in
  the state directory in the clear;
- a sandbox that names a secret sees only its placeholder (env, /proc,
  files);
- an HTTPS request from inside to a host the secret lists arrives with the
  value (in the placeholder's place and in the configured header), over a
  certificate the sandbox trusted (the daemon's CA);
- the same request to a host it does not list arrives with the
  placeholder, over the server's own certificate (never intercepted);
- another key neither sees nor names the secret.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from conftest import Client, Daemon, expect_error, require_root
from test_network import ALLOWED, INET, NETNS, OTHER, internet  # noqa: F401 (the fixture)

VALUE = "sk-live-7f3c9a1e5b2d4c6e8f0a1b2c3d4e5f6a"

SERVER = textwrap.dedent(
    r"""
    import http.server, json, ssl, sys, threading

    class Echo(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"host": self.server.name, "headers": dict(self.headers.items())}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(sys.argv[1], sys.argv[2])
    for addr, name in [(sys.argv[3], "allowed"), (sys.argv[4], "other")]:
        srv = http.server.ThreadingHTTPServer((addr, 443), Echo)
        srv.name = name
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()
    """
)

# Runs inside the sandbox: GET https://<host>/ with the given headers
# (`$NAME` is replaced by the environment's value), trusting the default
# CA bundle or the file given; prints the server's echo and the issuer.
FETCH = textwrap.dedent(
    r"""
    import json, os, socket, ssl, sys, urllib.request
    host, cafile, headers = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    headers = {k: os.path.expandvars(v) for k, v in headers.items()}
    ctx = ssl.create_default_context(cafile=cafile or None)
    with socket.create_connection((host, 443), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=host) as s:
            issuer = dict(x[0] for x in s.getpeercert()["issuer"])
    req = urllib.request.Request(f"https://{host}/", headers=headers)
    with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
        print(json.dumps({"echo": json.loads(r.read()), "issuer": issuer.get("commonName")}))
    """
)


def openssl(*args: str, cwd: Path) -> None:
    r = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def test_ca(tmp_root: Path) -> Path:
    """A CA of the test's own and a server certificate for both names."""
    d = tmp_root / "secrets-ca"
    d.mkdir(parents=True)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
            "-days", "2", "-subj", "/CN=hutch secrets test CA", cwd=d)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr",
            "-subj", "/CN=allowed.test", cwd=d)
    (d / "ext").write_text("subjectAltName=DNS:allowed.test,DNS:other.test\nextendedKeyUsage=serverAuth\n")
    openssl("x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "srv.pem", "-days", "2", "-extfile", "ext", cwd=d)
    return d


@pytest.fixture(scope="module")
def https(internet, test_ca: Path, tmp_root: Path):  # noqa: F811
    script = tmp_root / "secrets-https.py"
    script.write_text(SERVER)
    proc = subprocess.Popen(
        ["ip", "netns", "exec", NETNS, "python3", str(script), str(test_ca / "srv.pem"), str(test_ca / "srv.key"),
         ALLOWED, OTHER],
        stdout=subprocess.PIPE,
        stderr=open(tmp_root / "secrets-https.log", "wb"),
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        yield
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def sd(tmp_root: Path, https, test_ca: Path):
    """A daemon whose sandboxes resolve through "the internet" and whose
    egress proxy trusts the test's CA upstream."""
    require_root()
    root = tmp_root / "secrets"
    root.mkdir(parents=True)
    d = Daemon(root, name="secrets")
    d.extra_env = {
        "HUTCH_DNS_UPSTREAM": f"{INET}:53",
        "HUTCH_NET_IPV6": "off",
        "HUTCH_EGRESS_EXTRA_ROOTS": str(test_ca / "ca.pem"),
    }
    d.start()
    yield d
    problems = d.teardown_with_network()
    assert not problems, problems


@pytest.fixture(scope="module")
def api(sd: Daemon) -> Client:
    return sd.client("admin")


@pytest.fixture(scope="module")
def secret(api: Client) -> dict:
    r = api.post("/v1/secrets", {"name": "API_TOKEN", "value": VALUE, "hosts": ["allowed.test"],
                                 "header": "Authorization", "format": "Bearer {value}"})
    assert r.status_code == 201, r.text
    return r.json()


def fetch(api: Client, sb: str, host: str, headers: dict, cafile: str = "") -> dict:
    res = api.exec(sb, argv=["python3", "-c", FETCH, host, cafile, json.dumps(headers)], timeout_seconds=30)
    assert res["exit_code"] == 0, (res["exit_code"], res["stdout"][-1000:], res["stderr"][-2000:])
    return json.loads(res["stdout"])


def test_the_api_never_returns_a_value(api: Client, secret: dict):
    assert secret == {**secret, "name": "API_TOKEN", "hosts": ["allowed.test"], "header": "Authorization",
                      "format": "Bearer {value}"}
    for r in [api.get("/v1/secrets"), api.get("/v1/secrets/API_TOKEN")]:
        assert r.status_code == 200, r.text
        assert VALUE not in r.text and "value" not in r.json()
    r = api.request("PATCH", "/v1/secrets/API_TOKEN", json={"hosts": ["allowed.test", "*.wild.test"]})
    assert r.status_code == 200 and VALUE not in r.text, r.text
    assert r.json()["hosts"] == ["*.wild.test", "allowed.test"]
    expect_error(api.post("/v1/secrets", {"name": "API_TOKEN", "value": "x"}), 409, "secret_name_taken")
    expect_error(api.get("/v1/secrets/NOPE"), 404, "secret_not_found")
    expect_error(api.delete("/v1/secrets/NOPE"), 404, "secret_not_found")
    for bad in [{"name": "1BAD", "value": "x"}, {"name": "A", "value": ""}, {"name": "A", "value": "a\nb"},
                {"name": "A", "value": "x", "hosts": ["not a host"]},
                {"name": "A", "value": "x", "header": "Bad Header"},
                {"name": "A", "value": "x", "format": "{value}"}]:
        expect_error(api.post("/v1/secrets", bad), 400, "invalid_request")
    caps = api.get("/v1/capabilities").json()
    assert caps["features"]["secrets"]["enabled"] is True, caps["features"]["secrets"]


def test_the_value_is_nowhere_in_the_state_directory(sd: Daemon, secret: dict):
    key = sd.state_dir / "secrets.key"
    assert key.stat().st_mode & 0o777 == 0o600
    assert (sd.state_dir / "egress" / "ca.key").stat().st_mode & 0o777 == 0o600
    found = subprocess.run(["grep", "-rlF", VALUE, str(sd.state_dir)], capture_output=True, text=True)
    assert found.returncode == 1, f"the value is in the clear in: {found.stdout}"


def test_a_sandbox_sees_only_its_placeholder(api: Client, secret: dict):
    sb = api.create(secrets=["API_TOKEN"])
    assert sb["state"] == "running", sb
    env = api.sh(sb["id"], "echo $API_TOKEN")
    assert env.strip().startswith("hutch-secret-"), env
    out = api.exec(sb["id"], command="env; cat /proc/*/environ | tr '\\0' '\\n'; "
                                      "grep -rlF -- \"$V\" /etc /tmp /home /root /run 2>/dev/null; true",
                   env={"V": VALUE[:12]}, user="root")
    assert VALUE not in out["stdout"] and VALUE not in out["stderr"], out
    # The placeholder is the sandbox's own.
    other = api.create(secrets=["API_TOKEN"])
    assert api.sh(other["id"], "echo $API_TOKEN").strip() != env.strip()


def test_a_listed_host_gets_the_value_over_the_daemons_ca(api: Client, secret: dict):
    sb = api.create(secrets=["API_TOKEN"])
    got = fetch(api, sb["id"], "allowed.test", {"X-Api-Key": "$API_TOKEN", "X-Plain": "kept"})
    assert got["echo"]["host"] == "allowed"
    assert got["issuer"] == "hutch egress proxy CA", got
    headers = {k.lower(): v for k, v in got["echo"]["headers"].items()}
    assert headers["x-api-key"] == VALUE
    assert headers["authorization"] == f"Bearer {VALUE}"
    assert headers["x-plain"] == "kept"


def test_a_host_not_listed_gets_the_placeholder_and_its_own_certificate(api: Client, secret: dict, test_ca: Path):
    sb = api.create(secrets=["API_TOKEN"])
    ca = (test_ca / "ca.pem").read_text()
    api.exec(sb["id"], argv=["python3", "-c", "import sys; open('/tmp/test-ca.pem','w').write(sys.argv[1])", ca])
    placeholder = api.sh(sb["id"], "echo $API_TOKEN").strip()
    got = fetch(api, sb["id"], "other.test", {"X-Api-Key": "$API_TOKEN"}, cafile="/tmp/test-ca.pem")
    assert got["echo"]["host"] == "other"
    assert got["issuer"] == "hutch secrets test CA", got
    headers = {k.lower(): v for k, v in got["echo"]["headers"].items()}
    assert headers["x-api-key"] == placeholder
    assert "authorization" not in headers
    assert VALUE not in json.dumps(got)


def test_a_sandbox_naming_no_secret_is_not_intercepted(api: Client, secret: dict, test_ca: Path):
    sb = api.create()
    ca = (test_ca / "ca.pem").read_text()
    api.exec(sb["id"], argv=["python3", "-c", "import sys; open('/tmp/test-ca.pem','w').write(sys.argv[1])", ca])
    got = fetch(api, sb["id"], "allowed.test", {"X-Api-Key": "hutch-secret-0000"}, cafile="/tmp/test-ca.pem")
    assert got["issuer"] == "hutch secrets test CA", got
    assert "authorization" not in {k.lower() for k in got["echo"]["headers"]}


def test_another_key_neither_sees_nor_names_the_secret(sd: Daemon, api: Client, secret: dict):
    other = sd.new_client("secrets-other")
    assert other.get("/v1/secrets").json() == {"secrets": []}
    expect_error(other.get("/v1/secrets/API_TOKEN"), 404, "secret_not_found")
    expect_error(other.request("PATCH", "/v1/secrets/API_TOKEN", json={"value": "x"}), 404, "secret_not_found")
    expect_error(other.delete("/v1/secrets/API_TOKEN"), 404, "secret_not_found")
    expect_error(other.post("/v1/sandboxes", {"secrets": ["API_TOKEN"]}), 404, "secret_not_found")
    # Its own secret of the same name is its own.
    r = other.post("/v1/secrets", {"name": "API_TOKEN", "value": "theirs", "hosts": ["allowed.test"]})
    assert r.status_code == 201, r.text
    assert [x["name"] for x in other.get("/v1/secrets").json()["secrets"]] == ["API_TOKEN"]
    # Neither changed the other's: the first key's still opens and injects.
    assert api.get("/v1/secrets/API_TOKEN").status_code == 200
    sb = api.create(secrets=["API_TOKEN"])
    got = fetch(api, sb["id"], "allowed.test", {"X-Api-Key": "$API_TOKEN"})
    assert {k.lower(): v for k, v in got["echo"]["headers"].items()}["x-api-key"] == VALUE


def test_templates_carry_secrets_and_a_deleted_secret_is_refused(api: Client, secret: dict):
    r = api.post("/v1/templates", {"name": "with-secret", "secrets": ["API_TOKEN"]})
    assert r.status_code == 201, r.text
    assert r.json()["secrets"] == ["API_TOKEN"]
    sb = api.create(template="with-secret")
    assert api.sh(sb["id"], "echo $API_TOKEN").strip().startswith("hutch-secret-")
    expect_error(api.post("/v1/templates", {"name": "bad", "secrets": ["NOPE"]}), 404, "secret_not_found")
    expect_error(api.post("/v1/sandboxes", {"secrets": ["API_TOKEN"], "network": {"egress": "deny_all"}}),
                 400, "invalid_request")
    r = api.post("/v1/secrets", {"name": "GONE", "value": "v", "hosts": ["allowed.test"]})
    assert r.status_code == 201
    assert api.delete("/v1/secrets/GONE").status_code == 204
    expect_error(api.post("/v1/sandboxes", {"secrets": ["GONE"]}), 404, "secret_not_found")
