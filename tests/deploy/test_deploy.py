"""The deployment files (deploy/): the Helm chart, its plain manifests and
kustomization, the Nomad job, the systemd unit and the image's Dockerfile.

There is no helm, kubectl, nomad or cluster on the test machines: the
chart is rendered by gotmpl.py (the Go template subset it uses) and the
objects are checked as data: the kinds, image, privileges, host
namespaces and paths, probes, the environment (every HUTCH_* variable
named anywhere in deploy/ must be one hutch reads), and that the plain
manifests are what the chart renders with its default values.
"""

import glob
import os
import re
import subprocess
from pathlib import Path

import hcl2
import pytest
import yaml

from gotmpl import Missing, Renderer, TemplateError

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "hutch"
K8S = DEPLOY / "k8s"
NOMAD = DEPLOY / "nomad" / "hutch.nomad.hcl"
UNIT = DEPLOY / "systemd" / "hutch.service"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
SERVE_RS = ROOT / "crates" / "hutch" / "src" / "serve.rs"
MANAGED_BY = "app.kubernetes.io/managed-by"


# --- what hutch reads -------------------------------------------------------

def serve_args():
    """{flag: env} of `hutch serve`, from its clap definitions (hidden
    flags left out, as `--help` does)."""
    src = SERVE_RS.read_text()
    body = re.search(r"pub struct ServeArgs \{(.*?)\n\}", src, re.S).group(1)
    args = {}
    for attr, field in re.findall(r"#\[arg\((.*?)\)\]\s*(?:///[^\n]*\s*)*pub (\w+):", body, re.S):
        if not re.search(r"\blong\b", attr) or re.search(r"\bhide\s*=\s*true", attr):
            continue
        named = re.search(r'\blong\s*=\s*"([^"]+)"', attr)
        flag = "--" + (named.group(1) if named else field.replace("_", "-"))
        env = re.search(r'\benv\s*=\s*"(HUTCH_\w+)"', attr)
        args[flag] = env.group(1) if env else None
    assert len(args) > 20, f"ServeArgs not understood: {args}"
    return args


def runtime_env():
    """HUTCH_* variables the crates read themselves (std::env::var)."""
    names = set()
    for path in glob.glob(str(ROOT / "crates" / "*" / "src" / "**" / "*.rs"), recursive=True):
        for name in re.findall(r'env::var(?:_os)?\(\s*"(HUTCH_\w+)"', Path(path).read_text()):
            names.add(name)
    return names


def known_env():
    return {e for e in serve_args().values() if e} | runtime_env()


def hutch_binary():
    given = os.environ.get("HUTCH_BIN")
    candidates = [given] if given else []
    candidates += [str(ROOT / "target" / "x86_64-unknown-linux-gnu" / "debug" / "hutch"),
                   str(ROOT / "target" / "debug" / "hutch")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def test_the_clap_definitions_read_here_are_what_the_binary_accepts():
    binary = hutch_binary()
    if binary is None:
        pytest.skip("no built hutch binary (scripts/test.sh builds one before this stage)")
    out = subprocess.run([binary, "serve", "--help"], capture_output=True, text=True, check=True).stdout
    flags = set(re.findall(r"^\s+(--[a-z0-9-]+)", out, re.M)) - {"--help"}
    envs = set(re.findall(r"\[env: (HUTCH_\w+)", out))
    args = serve_args()
    assert flags == set(args), f"serve.rs {sorted(args)} vs --help {sorted(flags)}"
    assert envs == {e for e in args.values() if e}


def hutch_vars_in(text):
    return set(re.findall(r"\bHUTCH_[A-Z0-9_]*[A-Z0-9]\b", text))


def test_every_hutch_variable_named_in_deploy_is_one_hutch_reads():
    known = known_env()
    files = [p for p in DEPLOY.rglob("*") if p.is_file()] + [ROOT / "docs" / "deploy.md"]
    seen = set()
    for path in files:
        names = hutch_vars_in(path.read_text())
        unknown = names - known
        assert not unknown, f"{path.relative_to(ROOT)} names {sorted(unknown)}, which hutch does not read"
        seen |= names
    # The ones a fleet node needs are named somewhere.
    assert {"HUTCH_DATABASE", "HUTCH_NODE", "HUTCH_ADVERTISE", "HUTCH_LISTEN", "HUTCH_STATE_DIR",
            "HUTCH_FLEET_SECRET_FILE"} <= seen


# --- the chart --------------------------------------------------------------

def load_yaml(path):
    return yaml.safe_load(Path(path).read_text())


def values():
    return load_yaml(CHART / "values.yaml")


def templates():
    return {p.name: p.read_text() for p in (CHART / "templates").iterdir() if p.is_file()}


def merge(base, over):
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def render_root(overrides, release):
    chart = load_yaml(CHART / "Chart.yaml")
    return {
        "Values": merge(values(), overrides or {}),
        "Release": {"Name": release, "Namespace": "hutch", "Service": "Helm"},
        "Chart": {"Name": chart["name"], "Version": chart["version"], "AppVersion": chart["appVersion"]},
    }


def render_notes(overrides=None, release="hutch"):
    return Renderer(templates()).render("NOTES.txt", render_root(overrides, release))


def render(overrides=None, release="hutch"):
    """The chart's objects with values.yaml and `overrides`, as helm
    template would render them: [object]."""
    root = render_root(overrides, release)
    r = Renderer(templates())
    objs = []
    for name in sorted(templates()):
        if name.startswith("_") or not name.endswith(".yaml"):
            continue
        objs += [d for d in yaml.safe_load_all(r.render(name, root)) if d]
    return objs


def by_kind(objs, kind):
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


def container(objs):
    ds = by_kind(objs, "DaemonSet")
    cs = ds["spec"]["template"]["spec"]["containers"]
    assert len(cs) == 1
    return cs[0]


def env_of(c):
    return {e["name"]: e for e in c.get("env", [])}


FULL = {
    "ingress": {"enabled": True, "host": "hutch.example.com", "className": "nginx", "tlsSecret": "hutch-tls"},
    "serve": {"e2bDomain": "sbx.example.com", "dnsUpstream": "1.1.1.1,9.9.9.9"},
    "priorityClassName": "system-node-critical",
    "imagePullSecrets": [{"name": "regcred"}],
}


def test_chart_metadata_and_its_optional_postgresql():
    chart = load_yaml(CHART / "Chart.yaml")
    assert chart["apiVersion"] == "v2" and chart["name"] == "hutch" and chart["type"] == "application"
    version = re.search(r'^version = "([^"]+)"', (ROOT / "Cargo.toml").read_text(), re.M).group(1)
    assert chart["appVersion"] == version, "appVersion is the workspace's version"
    assert values()["image"]["tag"] == version
    deps = {d["name"]: d for d in chart.get("dependencies", [])}
    assert deps["postgresql"]["condition"] == "postgresql.enabled"
    assert values()["postgresql"]["enabled"] is False, "PostgreSQL in the release is opt-in"


def test_the_chart_renders_every_kind_the_fleet_needs():
    kinds = sorted(o["kind"] for o in render(FULL))
    assert kinds == ["DaemonSet", "Ingress", "Secret", "Service", "ServiceAccount"]
    # Defaults: no Ingress (it needs a host name).
    assert sorted(o["kind"] for o in render()) == ["DaemonSet", "Secret", "Service", "ServiceAccount"]


def value_paths(node, prefix=()):
    if isinstance(node, dict) and node:
        for k, v in node.items():
            yield from value_paths(v, prefix + (k,))
    else:
        yield prefix


# Values consumed whole (toYaml, with) rather than key by key.
WHOLE = {("nodeSelector",), ("tolerations",), ("resources",), ("ingress", "annotations"), ("imagePullSecrets",)}


def test_every_value_a_template_names_is_in_values_yaml_and_every_value_is_used():
    vals = values()
    named = set()
    for name, text in templates().items():
        for path in re.findall(r"\.Values((?:\.\w+)+)", text):
            parts = tuple(path.strip(".").split("."))
            node = vals
            for p in parts:
                assert isinstance(node, dict) and p in node, f"{name}: .Values.{'.'.join(parts)} is not in values.yaml"
                node = node[p]
            named.add(parts)
    for path in value_paths(vals):
        used = any(path[:len(n)] == n for n in named) or any(path[:len(w)] == w for w in WHOLE)
        assert used, f"values.yaml's {'.'.join(path)} is named by no template"


def test_each_privilege_and_host_path_says_why_in_values_yaml():
    lines = (CHART / "values.yaml").read_text().splitlines()
    for section in ("security", "hostPaths"):
        start = lines.index(f"{section}:")
        keys = 0
        for i in range(start + 1, len(lines)):
            line = lines[i]
            if line and not line.startswith(" "):
                break
            m = re.match(r"  (\w+):", line)
            if m:
                keys += 1
                assert lines[i - 1].lstrip().startswith("#"), f"values.yaml {section}.{m.group(1)} has no comment"
        assert keys >= 3, section


def test_the_renderer_refuses_what_it_does_not_know():
    # So that the comparisons below can fail: a missing value, an unknown
    # function and an unbalanced block are errors, not empty output.
    r = Renderer({"a": "x: {{ .Values.nope }}", "b": "{{ frobnicate 1 }}"})
    with pytest.raises(Missing):
        r.render("a", {"Values": {}})
    with pytest.raises(TemplateError):
        r.render("b", {"Values": {}})
    with pytest.raises(TemplateError):
        Renderer({"c": "{{ if .Values.x }}y"})
    # fail stops the render; len and lt compare only what Go would.
    r = Renderer({"d": '{{ if lt (len .Values.s) 3 }}{{ fail "short" }}{{ end }}ok', "e": "{{ lt 1 .Values.s }}"})
    assert r.render("d", {"Values": {"s": "abc"}}) == "ok"
    with pytest.raises(TemplateError, match="short"):
        r.render("d", {"Values": {"s": "ab"}})
    with pytest.raises(TemplateError):
        r.render("e", {"Values": {"s": "2"}})


# --- the node's pod ---------------------------------------------------------

def test_the_node_is_privileged_on_the_hosts_namespaces_and_paths():
    objs = render()
    ds = by_kind(objs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    c = container(objs)
    sec = c["securityContext"]
    assert sec["privileged"] is True and sec["runAsUser"] == 0
    assert sec["seccompProfile"]["type"] == "Unconfined"
    assert pod["hostNetwork"] is True and pod["hostPID"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet", "with hostNetwork, cluster names need this policy"
    assert pod["automountServiceAccountToken"] is False and pod["serviceAccountName"] == "hutch"
    assert by_kind(objs, "ServiceAccount")["automountServiceAccountToken"] is False
    # A DaemonSet on the labelled hosts, tolerating their taint.
    vals = values()
    assert pod["nodeSelector"] == vals["nodeSelector"] == {"hutch.dev/node": "true"}
    assert any(t["key"] == "hutch.dev/node" for t in pod["tolerations"])
    sel = ds["spec"]["selector"]["matchLabels"]
    assert all(ds["spec"]["template"]["metadata"]["labels"][k] == v for k, v in sel.items())
    # The daemon in the host's cgroup namespace.
    assert c["command"][:5] == ["nsenter", "--target", "1", "--cgroup", "--"]
    assert c["command"][5:] == ["/usr/local/bin/hutch", "serve"]
    # Host paths: where, which type, which propagation.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    state = vals["serve"]["stateDir"]
    want = {
        state: ("DirectoryOrCreate", "Bidirectional", False),
        vals["hostPaths"]["runDir"]: ("DirectoryOrCreate", "Bidirectional", False),
        "/sys/fs/cgroup": ("Directory", None, False),
        "/dev": ("Directory", None, False),
        "/lib/modules": ("Directory", None, True),
    }
    host_mounts = {p for p, m in mounts.items() if "hostPath" in volumes[m["name"]]}
    assert host_mounts == set(want)
    for path, (kind, propagation, ro) in want.items():
        m = mounts[path]
        host = volumes[m["name"]]["hostPath"]
        assert host["path"] == path and host["type"] == kind, path
        assert m.get("mountPropagation") == propagation, path
        assert bool(m.get("readOnly")) == ro, path
    # The run directory holds the host-wide uid locks (/run/hutch/uids).
    assert vals["hostPaths"]["runDir"] == "/run/hutch"
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == 1


def test_probes_hit_healthz_on_the_containers_port_and_the_service_routes_there():
    objs = render()
    c = container(objs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert list(ports.values()) == [values()["port"]]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/healthz", probe
        port = ports.get(get["port"], get["port"])
        assert port == values()["port"], probe
        assert "host" not in get, "the kubelet probes the pod's IP, where the API listens"
    svc = by_kind(objs, "Service")
    (sp,) = svc["spec"]["ports"]
    assert ports.get(sp["targetPort"], sp["targetPort"]) == values()["port"]
    assert sp["port"] == values()["service"]["port"]
    ds = by_kind(objs, "DaemonSet")
    assert svc["spec"]["selector"] == ds["spec"]["selector"]["matchLabels"]


def test_the_environment_names_the_node_its_address_and_the_database_secret():
    objs = render()
    c = container(objs)
    env = env_of(c)
    names = [e["name"] for e in c["env"]]
    assert not (set(names) - {"POD_IP"}) - known_env()
    assert env["HUTCH_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] in ("status.podIP", "status.hostIP")
    # $(POD_IP) is expanded only when POD_IP comes first.
    assert names.index("POD_IP") < names.index("HUTCH_LISTEN") < names.index("HUTCH_ADVERTISE")
    port = values()["port"]
    assert env["HUTCH_LISTEN"]["value"] == f"$(POD_IP):{port}"
    assert env["HUTCH_ADVERTISE"]["value"] == f"http://$(POD_IP):{port}"
    assert env["HUTCH_STATE_DIR"]["value"] == values()["serve"]["stateDir"]
    assert env["HUTCH_HEARTBEAT"]["value"] == values()["serve"]["heartbeat"]
    # The database URL only from a Secret, one the chart makes with that key.
    db = env["HUTCH_DATABASE"]
    assert "value" not in db
    ref = db["valueFrom"]["secretKeyRef"]
    secret = by_kind(objs, "Secret")
    assert secret["metadata"]["name"] == ref["name"]
    assert secret["stringData"][ref["key"]] == values()["database"]["url"]
    assert values()["database"]["url"].startswith("postgres://")
    # Unset options are not passed.
    assert "HUTCH_E2B_DOMAIN" not in env and "HUTCH_DNS_UPSTREAM" not in env


def test_the_charts_options_render_what_they_say():
    objs = render(FULL)
    env = env_of(container(objs))
    assert env["HUTCH_E2B_DOMAIN"]["value"] == "sbx.example.com"
    assert env["HUTCH_DNS_UPSTREAM"]["value"] == "1.1.1.1,9.9.9.9"
    pod = by_kind(objs, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    # The Ingress: the API's host and the E2B sandbox hosts, to the Service.
    ing = by_kind(objs, "Ingress")
    assert ing["spec"]["ingressClassName"] == "nginx"
    hosts = [r["host"] for r in ing["spec"]["rules"]]
    assert hosts == ["hutch.example.com", "*.sbx.example.com"]
    assert ing["spec"]["tls"] == [{"secretName": "hutch-tls", "hosts": hosts}]
    svc = by_kind(objs, "Service")
    for rule in ing["spec"]["rules"]:
        (path,) = rule["http"]["paths"]
        backend = path["backend"]["service"]
        assert backend["name"] == svc["metadata"]["name"]
        assert backend["port"]["name"] in [p["name"] for p in svc["spec"]["ports"]]
    no_wild = render(merge(FULL, {"ingress": {"sandboxHosts": False}}))
    assert [r["host"] for r in by_kind(no_wild, "Ingress")["spec"]["rules"]] == ["hutch.example.com"]
    with pytest.raises(TemplateError, match="ingress.host"):
        render({"ingress": {"enabled": True}})
    # A Secret of the operator's (e.g. CloudNativePG's): the chart makes none.
    objs = render({"database": {"existingSecret": "pg-app", "existingSecretKey": "uri"}})
    assert not [o for o in objs if o["kind"] == "Secret"]
    ref = env_of(container(objs))["HUTCH_DATABASE"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "pg-app", "key": "uri"}
    # Bitnami's PostgreSQL in the release: a password is required, and the
    # URL names the subchart's Service.
    with pytest.raises(TemplateError, match="password"):
        render({"postgresql": {"enabled": True}})
    objs = render({"postgresql": {"enabled": True, "auth": {"password": "s3cret"}}}, release="fleet")
    assert by_kind(objs, "Secret")["stringData"]["database-url"] == "postgres://hutch:s3cret@fleet-postgresql:5432/hutch"
    with pytest.raises(TemplateError, match="database.url"):
        render({"database": {"url": ""}})


# --- the fleet's registry ---------------------------------------------------

def comment_above(section, key):
    """The comment lines right above `section.key` in values.yaml, as one
    line of words."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    i = lines.index(f"{section}:") + 1
    while not lines[i].startswith(f"  {key}:"):
        i += 1
    words = []
    while lines[i - 1].lstrip().startswith("#"):
        i -= 1
        words.insert(0, lines[i].lstrip().lstrip("#").strip())
    return " ".join(words)


REGISTRY = "https://registry.example.com/hutch"


def test_every_deployment_sets_the_registry_from_a_value_and_empty_means_none():
    # The chart: HUTCH_REGISTRY from serve.registry, empty by default (no
    # registry: `hutch serve` takes an empty one as none), and the
    # insecure switch beside it; values.yaml says what they are.
    vals = values()
    assert vals["serve"]["registry"] == "" and vals["serve"]["registryInsecure"] is False
    assert "HUTCH_REGISTRY: " in comment_above("serve", "registry")
    assert "Empty: no registry" in comment_above("serve", "registry")
    assert "HUTCH_REGISTRY_INSECURE: " in comment_above("serve", "registryInsecure")
    env = env_of(container(render()))
    assert env["HUTCH_REGISTRY"] == {"name": "HUTCH_REGISTRY", "value": ""}
    assert env["HUTCH_REGISTRY_INSECURE"] == {"name": "HUTCH_REGISTRY_INSECURE", "value": "false"}
    env = env_of(container(render({"serve": {"registry": REGISTRY, "registryInsecure": True}})))
    assert env["HUTCH_REGISTRY"]["value"] == REGISTRY
    assert env["HUTCH_REGISTRY_INSECURE"]["value"] == "true"
    # The plain manifests: the chart's defaults (an overlay sets it).
    env = env_of(container([o for _, o in plain()]))
    assert env["HUTCH_REGISTRY"]["value"] == vals["serve"]["registry"]
    assert env["HUTCH_REGISTRY_INSECURE"]["value"] == "false"
    # Nomad: from the job's variables, empty and off by default.
    variables = {}
    for v in hcl2.loads(NOMAD.read_text(), serialization_options=hcl2.SerializationOptions(
            with_comments=False, explicit_blocks=False, strip_string_quotes=True)).get("variable", []):
        variables.update(v)
    assert variables["registry"] == {"type": "string", "default": ""}
    assert variables["registry_insecure"] == {"type": "bool", "default": False}
    (task,) = nomad_task()["env"]
    assert task["HUTCH_REGISTRY"] == "${var.registry}"
    assert task["HUTCH_REGISTRY_INSECURE"] == "${var.registry_insecure}"
    # docs/deploy.md says how each one sets it.
    doc = (ROOT / "docs" / "deploy.md").read_text()
    for how in ("serve.registry", "-var registry=", "HUTCH_REGISTRY="):
        assert how in doc, how


# --- the fleet's shared secret ----------------------------------------------

FLEET_SECRET = "fleet-secret-0123456789abcdef0123456789abcdef"


def fleet_secret_source(objs):
    """Where the node's HUTCH_FLEET_SECRET_FILE comes from: the
    (Secret name, key) of the read-only, mode 0400 Secret volume mounted
    where the variable points, after checking that wiring."""
    pod = by_kind(objs, "DaemonSet")["spec"]["template"]["spec"]
    c = container(objs)
    var = env_of(c)["HUTCH_FLEET_SECRET_FILE"]
    # A path, not the secret: no valueFrom, nothing but a file name.
    assert set(var) == {"name", "value"}, var
    path = var["value"]
    assert path.startswith("/") and "$(" not in path, path
    volumes = {v["name"]: v for v in pod["volumes"]}
    (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mount.get("readOnly") is True and "subPath" not in mount, mount
    secret = volumes[mount["name"]].get("secret")
    assert secret, f"{path} is not on a Secret's volume: {volumes[mount['name']]}"
    assert secret["defaultMode"] == 0o400, secret
    assert "optional" not in secret or secret["optional"] is False, "the node waits for its secret"
    (item,) = secret["items"]
    assert path == mount["mountPath"].rstrip("/") + "/" + item["path"], (path, mount, item)
    # No variable takes the fleet's Secret into the environment.
    for e in c["env"]:
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        assert not ref or ref["name"] != secret["secretName"], e
    return secret["secretName"], item["key"]


def secrets_named(objs, name):
    return [o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == name]


def test_the_node_reads_the_fleet_secret_from_a_mounted_secret():
    # Defaults: the Secret `<release>-fleet`, which the chart does not make
    # (no placeholder, nothing random): the operator makes it.
    for release in ("hutch", "fleet"):
        objs = render(release=release)
        name, key = fleet_secret_source(objs)
        assert (name, key) == (f"{release}-fleet", values()["fleetSecret"]["existingSecretKey"])
        assert not secrets_named(objs, name)
        # The install's notes say how to make it.
        notes = render_notes(release=release)
        assert f"create secret generic {name} \\\n    --from-literal={key}=" in notes, notes
    # fleetSecret.value: the chart makes that Secret, and the secret is in
    # it and nowhere in the DaemonSet.
    objs = render({"fleetSecret": {"value": FLEET_SECRET}})
    name, key = fleet_secret_source(objs)
    (secret,) = secrets_named(objs, name)
    assert secret["stringData"] == {key: FLEET_SECRET}
    assert FLEET_SECRET not in yaml.safe_dump(by_kind(objs, "DaemonSet"))
    # A Secret of the operator's: the chart makes none.
    objs = render({"fleetSecret": {"existingSecret": "shared", "existingSecretKey": "k", "value": FLEET_SECRET}})
    assert fleet_secret_source(objs) == ("shared", "k")
    assert not secrets_named(objs, "hutch-fleet") and FLEET_SECRET not in yaml.safe_dump(objs)
    for given in ({"value": FLEET_SECRET}, {"existingSecret": "shared"}):
        assert "create secret" not in render_notes({"fleetSecret": given})
    # One hutch would refuse is refused at render.
    with pytest.raises(TemplateError, match="fleetSecret.value"):
        render({"fleetSecret": {"value": "too-short"}})


def test_the_plain_manifests_read_the_fleet_secret_from_a_secret_made_apart():
    objs = [o for _, o in plain()]
    name, key = fleet_secret_source(objs)
    assert key == values()["fleetSecret"]["existingSecretKey"]
    assert not secrets_named(objs, name), "a published fleet secret would sign for anyone"
    # The kustomization says how to make it, under that name and key.
    text = (K8S / "kustomization.yaml").read_text()
    assert re.search(rf"create secret generic {name} \\\n#\s+--from-literal={key}=", text), text


# --- the plain manifests ----------------------------------------------------

def plain():
    objs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            objs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return objs


def without_managed_by(obj):
    """The rendered object without Helm's managed-by label (the plain
    manifests are not Helm's)."""
    if isinstance(obj, dict):
        return {k: without_managed_by(v) for k, v in obj.items() if k != MANAGED_BY}
    if isinstance(obj, list):
        return [without_managed_by(v) for v in obj]
    return obj


def test_the_plain_manifests_are_what_the_chart_renders_with_its_defaults():
    rendered = {(o["kind"], o["metadata"]["name"]): without_managed_by(o) for o in render()}
    manifests = {(o["kind"], o["metadata"]["name"]): o for _, o in plain()}
    kust = load_yaml(K8S / "kustomization.yaml")
    # The plain manifests add the namespace the kustomization names.
    assert manifests.pop(("Namespace", kust["namespace"]))
    assert set(manifests) == set(rendered)
    for key, obj in rendered.items():
        assert manifests[key] == obj, f"deploy/k8s {key} differs from the chart's render"


def test_the_plain_manifests_key_settings_are_values_yaml():
    # The same agreement, said setting by setting.
    vals = values()
    objs = [o for _, o in plain()]
    c = container(objs)
    pod = by_kind(objs, "DaemonSet")["spec"]["template"]["spec"]
    assert c["image"] == f'{vals["image"]["repository"]}:{vals["image"]["tag"]}'
    assert c["imagePullPolicy"] == vals["image"]["pullPolicy"]
    assert [p["containerPort"] for p in c["ports"]] == [vals["port"]]
    assert pod["nodeSelector"] == vals["nodeSelector"]
    assert pod["tolerations"] == vals["tolerations"]
    assert c["securityContext"]["privileged"] == vals["security"]["privileged"]
    assert c["securityContext"]["runAsUser"] == vals["security"]["runAsUser"]
    assert pod["hostNetwork"] == vals["security"]["hostNetwork"]
    assert pod["hostPID"] == vals["security"]["hostPID"]
    assert c["resources"] == vals["resources"]
    assert pod["terminationGracePeriodSeconds"] == vals["terminationGracePeriodSeconds"]
    svc = by_kind(objs, "Service")
    assert svc["spec"]["type"] == vals["service"]["type"]
    assert svc["spec"]["ports"][0]["port"] == vals["service"]["port"]
    key = vals["database"]["existingSecretKey"]
    assert by_kind(objs, "Secret")["stringData"][key] == vals["database"]["url"]


def test_the_kustomization_lists_every_manifest():
    kust = load_yaml(K8S / "kustomization.yaml")
    assert kust["kind"] == "Kustomization"
    files = sorted(p.name for p in K8S.iterdir() if p.name != "kustomization.yaml")
    assert sorted(kust["resources"]) == files
    assert len(set(kust["resources"])) == len(kust["resources"])
    (ns,) = [o for _, o in plain() if o["kind"] == "Namespace"]
    assert ns["metadata"]["name"] == kust["namespace"]
    # No object pins a namespace of its own against the kustomization's.
    assert all("namespace" not in o["metadata"] for _, o in plain())


# --- Nomad ------------------------------------------------------------------

def nomad_job():
    opts = hcl2.SerializationOptions(with_comments=False, explicit_blocks=False,
                                     preserve_heredocs=False, strip_string_quotes=True)
    doc = hcl2.loads(NOMAD.read_text(), serialization_options=opts)
    (job,) = doc["job"]
    ((name, body),) = job.items()
    assert name == "hutch"
    return body


def nomad_task():
    (group,) = nomad_job()["group"]
    ((_, group),) = group.items()
    (task,) = group["task"]
    ((_, task),) = task.items()
    return task


def test_the_nomad_job_runs_one_privileged_node_per_opted_in_client():
    job = nomad_job()
    assert job["type"] == "system"
    constraints = {c["attribute"]: c["value"] for c in job["constraint"]}
    assert constraints.get("${meta.hutch_node}") == "true"
    (group,) = job["group"]
    ((_, group),) = group.items()
    ports = {}
    for net in group["network"]:
        for port in net["port"]:
            for label, spec in port.items():
                ports[label] = spec
    assert ports == {"http": {"static": values()["port"]}}
    (service,) = group["service"]
    assert service["port"] == "http"
    (check,) = service["check"]
    assert check["type"] == "http" and check["path"] == "/healthz"
    (task,) = group["task"]
    ((_, task),) = task.items()
    # raw_exec: root in the host's namespaces (exec would confine it to a
    # chroot, a PID namespace and a cgroup that end with the task).
    assert task["driver"] == "raw_exec"
    assert "user" not in task or task["user"] == "root"
    (config,) = task["config"]
    assert config["command"] == "/usr/local/bin/hutch" and config["args"] == ["serve"]
    (env,) = task["env"]
    assert set(env) <= known_env(), sorted(set(env) - known_env())
    assert env["HUTCH_NODE"] == "${node.unique.name}"
    assert env["HUTCH_LISTEN"] == "${NOMAD_ADDR_http}"
    assert env["HUTCH_ADVERTISE"] == "http://${NOMAD_ADDR_http}"
    # The database URL from a Nomad variable, into the environment, from a
    # file in the task's secrets directory.
    templates = {t["destination"]: t for t in task["template"]}
    (tmpl,) = [t for t in templates.values() if "HUTCH_DATABASE" in t["data"]]
    assert tmpl["env"] is True and tmpl["destination"].startswith("secrets/")
    assert re.search(r"nomadVar .*HUTCH_DATABASE=\{\{ *\.\w+ *\}\}", tmpl["data"])
    assert "HUTCH_DATABASE" not in env
    # The fleet's shared secret from the variable too, as a file the task
    # reads (not its environment) in its secrets directory.
    path = env["HUTCH_FLEET_SECRET_FILE"]
    assert path.startswith("${NOMAD_SECRETS_DIR}/"), path
    fleet = templates.get("secrets/" + path.removeprefix("${NOMAD_SECRETS_DIR}/"))
    assert fleet, f"no template writes {path}: {sorted(templates)}"
    assert not fleet.get("env"), "the secret stays in its file"
    assert fleet["perms"] == "0400"
    var = r'nomadVar \\?"([^"\\]+)\\?"'
    m = re.fullmatch(r"\{\{ *with " + var + r" *\}\}\{\{ *\.(\w+) *\}\}\{\{ *end *\}\}", fleet["data"].strip())
    assert m, fleet["data"]
    # The variable the database URL comes from, and the item the job's
    # comment tells to put there.
    assert m.group(1) == re.search(var, tmpl["data"]).group(1)
    assert re.search(rf"^# .*nomad var put {m.group(1)} .*\n#\s+{m.group(2)}=", NOMAD.read_text(), re.M)
    assert not re.search(r"HUTCH_FLEET_SECRET\b", tmpl["data"])
    assert task["kill_signal"] == "SIGTERM"


# --- systemd ----------------------------------------------------------------

def unit_lines():
    return [l for l in UNIT.read_text().splitlines() if l and not l.startswith("#")]


def test_the_systemd_unit_passes_only_flags_and_variables_hutch_serve_has():
    args = serve_args()
    (exec_start,) = [l.split("=", 1)[1] for l in unit_lines() if l.startswith("ExecStart=")]
    words = exec_start.split()
    assert words[0] == "/usr/local/bin/hutch" and words[1] == "serve"
    flags = [w for w in words[2:] if w.startswith("--")]
    assert flags and all(f in args for f in flags), flags
    envs = dict(l.split("=", 1)[1].split("=", 1) for l in unit_lines() if l.startswith("Environment="))
    assert set(envs) <= known_env()
    # The address is a variable: a flag would win over the environment file.
    assert "--listen" not in flags and envs["HUTCH_LISTEN"] == "127.0.0.1:7700"
    # A flag and its variable, if both given, agree.
    for flag, value in zip(words[2::2], words[3::2]):
        env = args[flag]
        if env in envs:
            assert envs[env] == value, flag
    # The fleet's settings come from an optional file, after Environment=.
    (env_file,) = [l.split("=", 1)[1] for l in unit_lines() if l.startswith("EnvironmentFile=")]
    assert env_file.startswith("-/")
    text = UNIT.read_text()
    for name in ("HUTCH_DATABASE", "HUTCH_NODE", "HUTCH_ADVERTISE"):
        assert name in text, f"the unit says nothing of {name}"
    # The fleet's shared secret: a file of its own, named in the
    # environment file; never a value in the unit.
    assert re.search(r"^#\s+HUTCH_FLEET_SECRET_FILE=/etc/hutch/[\w.-]+$", text, re.M)
    assert not [l for l in unit_lines() if "FLEET_SECRET" in l]


# --- the image and the docs -------------------------------------------------

def test_the_image_ships_what_the_pod_runs():
    text = DOCKERFILE.read_text()
    copy = re.search(r"^COPY (.+) (\S+)$", text, re.M)
    assert copy and set(copy.group(1).split()) == {"hutch", "hutch-agent"} and copy.group(2) == "/usr/local/bin/"
    install = re.search(r"apt-get install[^\n]*\\?\n((?:.*\\\n)*.*)", text).group(0)
    c = container(render())
    if c["command"][0] == "nsenter":
        assert "util-linux" in install
    assert "mmdebstrap" in install, "presets and Debian image builds"
    assert c["command"][5] == "/usr/local/bin/hutch"


def test_the_docs_say_what_ran_and_are_linked():
    doc = (ROOT / "docs" / "deploy.md").read_text()
    for part in ("deploy/helm/hutch", "deploy/k8s", "deploy/nomad", "deploy/systemd", "tests/deploy"):
        assert part in doc, part
    assert "docs/deploy.md" in (ROOT / "README.md").read_text()
    assert "docs/deploy.md" in (ROOT / "ARCHITECTURE.md").read_text()
