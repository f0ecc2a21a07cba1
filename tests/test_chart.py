"""The Helm chart, offline: strict lint against Kubernetes 1.20, what it renders for the default,
full and URL values, its values schema, and docs/operator.md (Chart values) against values.yaml.

Installs and upgrades against a real API server live in the chart e2e; here `lookup` returns
nothing, so every render takes the install path (fresh certificate and metrics token)."""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import NameOID

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "kuberefit"
DOCS = REPO / "docs" / "operator.md"  # its "Chart values" section
KUBE_VERSION = "v1.20.2"
RELEASE, NAMESPACE = "kuberefit", "kuberefit-system"
FULLNAME = "kuberefit"  # the release name contains the chart name
#: Values that are Kubernetes objects: documented (and schema-checked) as a whole.
OPAQUE = {
    "operator.resources",
    "operator.securityContext",
    "sidecar.resources",
    "webhook.namespaceSelector",
}
INJECTION_KEYS = {
    "image",
    "imagePullPolicy",
    "resources",
    "ports",
    "workDir",
    "shmDir",
    "vllmBundleDir",
    "shmSizeLimit",
    "defaultTokenSecret",
    "env",
    "vllmContainer",
    "logFormat",
    "logLevel",
}
OPERATOR_EXCLUSION = {"key": "kuberefit.io/component", "operator": "NotIn", "values": ["operator"]}


@pytest.fixture(scope="module")
def chart() -> Iterator[helm_python.Chart]:
    with helm_python.Chart.load(CHART) as loaded:
        yield loaded


def ci_values(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((CHART / "ci" / f"{name}-values.yaml").read_text())
    return loaded


class Rendered:
    """The rendered objects of one release, by (kind, name, namespace)."""

    def __init__(self, manifests: dict[str, str]) -> None:
        self.notes = manifests.pop(f"{CHART.name}/templates/NOTES.txt", "")
        self.objects: list[dict[str, Any]] = [
            doc
            for text in manifests.values()
            for doc in yaml.safe_load_all(text)
            if doc  # templates that render nothing
        ]

    def kinds(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str, namespace: str | None = NAMESPACE) -> dict[str, Any]:
        found = [
            o
            for o in self.kinds(kind)
            if o["metadata"]["name"] == name and o["metadata"].get("namespace") == namespace
        ]
        assert len(found) == 1, (kind, name, namespace, [o["metadata"] for o in self.objects])
        return found[0]


def render(chart: helm_python.Chart, values: dict[str, Any] | None = None) -> Rendered:
    return Rendered(
        chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True, revision=1)
    )


def operator_container(out: Rendered) -> dict[str, Any]:
    pod = out.get("Deployment", f"{FULLNAME}-operator")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["name"] == "operator"
    return dict(container)


def pem_certs(b64: str) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(base64.b64decode(b64))


# --- lint ----------------------------------------------------------------------------------


@pytest.mark.parametrize("values", ["default", "full", "url"])
def test_lints_strict_on_kubernetes_1_20(values: str) -> None:
    report = helm_python.lint(
        CHART,
        None if values == "default" else ci_values(values),
        strict=True,
        namespace=NAMESPACE,
        kube_version=KUBE_VERSION,
    )
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


# --- default values ------------------------------------------------------------------------


def test_operator_deployment(chart: helm_python.Chart) -> None:
    out = render(chart)
    deployment = out.get("Deployment", f"{FULLNAME}-operator")
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    template = spec["template"]
    labels = template["metadata"]["labels"]
    assert labels["kuberefit.io/component"] == "operator"
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    for key in ("name", "instance", "version", "managed-by"):
        assert f"app.kubernetes.io/{key}" in deployment["metadata"]["labels"]
    pod = template["spec"]
    assert pod["serviceAccountName"] == f"{FULLNAME}-operator"
    out.get("ServiceAccount", f"{FULLNAME}-operator")

    container = operator_container(out)
    assert container["image"] == "kuberefit/operator:0.1.0"
    assert container["command"] == ["kuberefit", "operator", "serve"]
    assert container["args"] == [
        "--metrics-bind=0.0.0.0:8080",
        "--metrics-token-file=/etc/kuberefit/metrics-token/token",
        "--lease-seconds=15",
        "--poll-seconds=0.5",
        "--webhook-bind=0.0.0.0:9443",
        "--webhook-cert-dir=/etc/kuberefit/webhook-tls",
        "--injection-config=/etc/kuberefit/injection/injection.json",
    ]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["KUBEREFIT_LOG_FORMAT"]["value"] == "json"
    assert env["KUBEREFIT_LOG_LEVEL"]["value"] == "info"
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "metrics": 8080,
        "webhook": 9443,
    }
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] == 65532
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}

    # Every volume is mounted where the args say (the local harness maps mountPaths by prefix).
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {
        "webhook-tls": "/etc/kuberefit/webhook-tls",
        "injection": "/etc/kuberefit/injection",
        "metrics-token": "/etc/kuberefit/metrics-token",
        "tmp": "/tmp",
    }
    assert volumes["webhook-tls"]["secret"]["secretName"] == f"{FULLNAME}-webhook-tls"
    assert volumes["injection"]["configMap"]["name"] == f"{FULLNAME}-injection"
    assert volumes["metrics-token"]["secret"]["secretName"] == f"{FULLNAME}-metrics-token"
    assert volumes["tmp"] == {"name": "tmp", "emptyDir": {}}

    # Changing the sidecar values restarts the operator.
    injection = out.get("ConfigMap", f"{FULLNAME}-injection")["data"]["injection.json"]
    annotations = template["metadata"]["annotations"]
    assert annotations["checksum/injection"] == hashlib.sha256(injection.encode()).hexdigest()
    changed = render(chart, {"sidecar": {"shmSizeLimit": "16Gi"}})
    changed_template = changed.get("Deployment", f"{FULLNAME}-operator")["spec"]["template"]
    assert (
        changed_template["metadata"]["annotations"]["checksum/injection"]
        != (annotations["checksum/injection"])
    )


def test_services_and_metrics_token(chart: helm_python.Chart) -> None:
    out = render(chart)
    service = out.get("Service", f"{FULLNAME}-webhook")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert (ports["webhook"]["port"], ports["webhook"]["targetPort"]) == (443, "webhook")
    assert (ports["metrics"]["port"], ports["metrics"]["targetPort"]) == (8080, "metrics")
    assert service["spec"]["selector"]["kuberefit.io/component"] == "operator"
    token = out.get("Secret", f"{FULLNAME}-metrics-token")
    assert len(base64.b64decode(token["data"]["token"])) >= 32

    own = render(chart, {"operator": {"metricsTokenSecret": {"name": "mine", "key": "bearer"}}})
    assert not [s for s in own.kinds("Secret") if "metrics-token" in s["metadata"]["name"]]
    container = operator_container(own)
    assert "--metrics-token-file=/etc/kuberefit/metrics-token/bearer" in container["args"]
    pod = own.get("Deployment", f"{FULLNAME}-operator")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["metrics-token"]["secret"]["secretName"] == "mine"


def test_webhook_configuration_and_self_signed_tls(chart: helm_python.Chart) -> None:
    out = render(chart)
    config = out.get("MutatingWebhookConfiguration", FULLNAME, None)
    [hook] = config["webhooks"]
    assert hook["name"] == "inject.kuberefit.io"
    assert hook["admissionReviewVersions"] == ["v1"]
    assert hook["sideEffects"] == "None"
    assert hook["failurePolicy"] == "Ignore"
    assert hook["timeoutSeconds"] == 5
    assert hook["reinvocationPolicy"] == "IfNeeded"
    assert hook["rules"] == [
        {
            "operations": ["CREATE"],
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]
    assert hook["namespaceSelector"] == {
        "matchExpressions": [
            {"key": "kuberefit.io/injection", "operator": "NotIn", "values": ["disabled"]},
            {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"]},
        ]
    }
    assert hook["objectSelector"] == {"matchExpressions": [OPERATOR_EXCLUSION]}
    client_config = hook["clientConfig"]
    svc = f"{FULLNAME}-webhook"
    assert client_config["service"] == {
        "name": svc,
        "namespace": NAMESPACE,
        "path": "/mutate-pods",
        "port": 443,
    }
    assert "url" not in client_config

    secret = out.get("Secret", f"{FULLNAME}-webhook-tls")
    assert secret["type"] == "kubernetes.io/tls"
    assert set(secret["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    assert client_config["caBundle"] == secret["data"]["ca.crt"]
    [ca] = pem_certs(secret["data"]["ca.crt"])
    [leaf] = pem_certs(secret["data"]["tls.crt"])
    leaf.verify_directly_issued_by(ca)
    assert leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == svc
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == [
        svc,
        f"{svc}.{NAMESPACE}",
        f"{svc}.{NAMESPACE}.svc",
        f"{svc}.{NAMESPACE}.svc.cluster.local",
    ]
    assert sans.get_values_for_type(x509.IPAddress) == []
    lifetime = leaf.not_valid_after_utc - leaf.not_valid_before_utc
    assert lifetime.days >= 3649
    template = out.get("Deployment", f"{FULLNAME}-operator")["spec"]["template"]
    tls_sum = hashlib.sha256(secret["data"]["tls.crt"].encode()).hexdigest()
    assert template["metadata"]["annotations"]["checksum/webhook-tls"] == tls_sum


def test_webhook_objectselector_keeps_user_terms(chart: helm_python.Chart) -> None:
    user = {"matchLabels": {"team": "rl"}, "matchExpressions": [{"key": "a", "operator": "Exists"}]}
    out = render(chart, {"webhook": {"objectSelector": user, "failurePolicy": "Fail"}})
    [hook] = out.get("MutatingWebhookConfiguration", FULLNAME, None)["webhooks"]
    assert hook["failurePolicy"] == "Fail"
    assert hook["objectSelector"] == {
        "matchLabels": {"team": "rl"},
        "matchExpressions": [{"key": "a", "operator": "Exists"}, OPERATOR_EXCLUSION],
    }


def test_cluster_role_is_the_shared_least_privilege_role(chart: helm_python.Chart) -> None:
    out = render(chart)
    shipped = yaml.safe_load((CHART / "files" / "operator-clusterrole.yaml").read_text())
    role = out.get("ClusterRole", f"{FULLNAME}-operator", None)
    assert role["rules"] == shipped["rules"]
    assert role["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    binding = out.get("ClusterRoleBinding", f"{FULLNAME}-operator", None)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": f"{FULLNAME}-operator",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": f"{FULLNAME}-operator", "namespace": NAMESPACE}
    ]
    assert out.kinds("RoleBinding") == []


def test_injection_config(chart: helm_python.Chart) -> None:
    out = render(chart)
    config = json.loads(out.get("ConfigMap", f"{FULLNAME}-injection")["data"]["injection.json"])
    assert set(config) == INJECTION_KEYS
    assert config["image"] == "kuberefit/sidecar:0.1.0"
    assert config["imagePullPolicy"] == "IfNotPresent"
    assert config["ports"] == {"control": 8470, "producer": 8471, "relay": 8472}
    assert config["defaultTokenSecret"] == {"name": "kuberefit-token", "key": "token"}
    assert config["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}}
    assert (config["workDir"], config["shmDir"]) == ("/var/lib/kuberefit", "/dev/shm/kuberefit")
    assert (config["shmSizeLimit"], config["env"], config["vllmContainer"]) == ("8Gi", [], "")
    assert (config["logFormat"], config["logLevel"]) == ("json", "info")


def test_notes_name_the_next_commands(chart: helm_python.Chart) -> None:
    notes = render(chart).notes
    for needle in (
        "kuberefit.io/token=true",
        "kuberefit.io/inject",
        "kuberefit.io/policy",
        "kind: RefitPolicy",
        "kubectl get refittransitions -w",
        "kubectl get kuberefit -A",
    ):
        assert needle in notes, needle


def test_webhook_disabled_renders_no_webhook(chart: helm_python.Chart) -> None:
    out = render(chart, {"webhook": {"enabled": False}})
    assert out.kinds("MutatingWebhookConfiguration") == []
    assert out.kinds("ConfigMap") == []
    assert [s["metadata"]["name"] for s in out.kinds("Secret")] == [f"{FULLNAME}-metrics-token"]
    container = operator_container(out)
    assert not [a for a in container["args"] if "webhook" in a or "injection" in a]
    assert [p["name"] for p in container["ports"]] == ["metrics"]


# --- schema --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"webhook": {"failurePolicy": "Sometimes"}},
        {"operator": {"replicas": 0}},
        {"operator": {"leaseSeconds": 2}},
        {"operator": {"metricsPort": 70000}},
        {"logFormat": "xml"},
        {"logLevel": "verbose"},
        {"image": {"pullPolicy": "Sometimes"}},
        {"webhook": {"url": "http://insecure.example"}},
        {"operatr": {}},
    ],
)
def test_schema_rejects(chart: helm_python.Chart, bad: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmValuesError):
        chart.validate_schema(chart.merge_values(bad))
    with pytest.raises(helm_python.HelmValuesError):
        chart.render(bad, name=RELEASE, namespace=NAMESPACE)


def test_schema_accepts_the_defaults_and_ci_values(chart: helm_python.Chart) -> None:
    for values in ({}, ci_values("full"), ci_values("url")):
        chart.validate_schema(chart.merge_values(values))


# --- URL mode and the full values ----------------------------------------------------------


def test_url_mode(chart: helm_python.Chart) -> None:
    out = render(chart, ci_values("url"))
    [hook] = out.get("MutatingWebhookConfiguration", FULLNAME, None)["webhooks"]
    client_config = hook["clientConfig"]
    assert client_config["url"] == "https://127.0.0.1:9443/mutate-pods"
    assert "service" not in client_config
    assert hook["failurePolicy"] == "Fail"
    secret = out.get("Secret", f"{FULLNAME}-webhook-tls")
    assert client_config["caBundle"] == secret["data"]["ca.crt"]
    [leaf] = pem_certs(secret["data"]["tls.crt"])
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    trailing = render(chart, {"webhook": {"url": "https://10.0.0.1:8443/"}})
    [hook] = trailing.get("MutatingWebhookConfiguration", FULLNAME, None)["webhooks"]
    assert hook["clientConfig"]["url"] == "https://10.0.0.1:8443/mutate-pods"


def test_full_values(chart: helm_python.Chart) -> None:
    out = render(chart, ci_values("full"))
    spec = out.get("Deployment", f"{FULLNAME}-operator")["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"]["type"] == "RollingUpdate"
    args = operator_container(out)["args"]
    assert [a for a in args if a.startswith("--namespace=")] == [
        "--namespace=team-a",
        "--namespace=team-b",
    ]

    # watchNamespaces: one RoleBinding (to the ClusterRole) per namespace, no cluster binding.
    assert out.kinds("ClusterRoleBinding") == []
    out.get("ClusterRole", f"{FULLNAME}-operator", None)
    for ns in ("team-a", "team-b"):
        binding = out.get("RoleBinding", f"{FULLNAME}-operator", ns)
        assert binding["roleRef"]["kind"] == "ClusterRole"
        assert binding["roleRef"]["name"] == f"{FULLNAME}-operator"
        assert binding["subjects"][0]["namespace"] == NAMESPACE

    # cert-manager: a Certificate (from a self-signed Issuer) writes the Secret; CA injected.
    assert not [s for s in out.kinds("Secret") if s["metadata"]["name"].endswith("webhook-tls")]
    cert = out.get("Certificate", f"{FULLNAME}-webhook")
    assert cert["spec"]["secretName"] == f"{FULLNAME}-webhook-tls"
    assert f"{FULLNAME}-webhook.{NAMESPACE}.svc" in cert["spec"]["dnsNames"]
    issuer = out.get("Issuer", cert["spec"]["issuerRef"]["name"])
    assert issuer["spec"] == {"selfSigned": {}}
    config = out.get("MutatingWebhookConfiguration", FULLNAME, None)
    assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
        f"{NAMESPACE}/{FULLNAME}-webhook"
    )
    assert "caBundle" not in config["webhooks"][0]["clientConfig"]
    given = render(
        chart,
        {"webhook": {"certManager": {"enabled": True, "issuerRef": {"name": "ca", "kind": "X"}}}},
    )
    assert given.kinds("Issuer") == []
    assert given.get("Certificate", f"{FULLNAME}-webhook")["spec"]["issuerRef"] == {
        "name": "ca",
        "kind": "X",
    }

    # NetworkPolicies: three per namespace, on named ports.
    kuberefit_pods = {"matchExpressions": [{"key": "kuberefit.io/role", "operator": "Exists"}]}
    assert len(out.kinds("NetworkPolicy")) == 6
    for ns in ("team-a", "team-b"):
        control = out.get("NetworkPolicy", "kuberefit-control", ns)["spec"]
        assert control["podSelector"] == kuberefit_pods
        [rule] = control["ingress"]
        assert rule["ports"] == [{"port": "refit-control", "protocol": "TCP"}]
        assert rule["from"] == [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}},
                "podSelector": {"matchLabels": {"kuberefit.io/component": "operator"}},
            }
        ]
        relay = out.get("NetworkPolicy", "kuberefit-relay", ns)["spec"]
        assert relay["podSelector"] == kuberefit_pods
        # KubeRefit pods of the namespace: every port; relayFrom peers: the relay port only.
        assert relay["ingress"] == [
            {"from": [{"podSelector": kuberefit_pods}]},
            {
                "ports": [{"port": "refit-relay", "protocol": "TCP"}],
                "from": [{"ipBlock": {"cidr": "10.0.0.0/8"}}],
            },
        ]
        open_ports = out.get("NetworkPolicy", "kuberefit-open-ports", ns)["spec"]
        assert open_ports["podSelector"] == kuberefit_pods
        assert open_ports["ingress"] == [{"ports": [{"port": 8000, "protocol": "TCP"}]}]
        for policy in (control, relay, open_ports):
            assert policy["policyTypes"] == ["Ingress"]


def test_network_policies_default_to_the_release_namespace(chart: helm_python.Chart) -> None:
    assert render(chart).kinds("NetworkPolicy") == []
    values = {"networkPolicies": {"enabled": True, "openPorts": []}}
    out = render(chart, values)
    assert sorted(p["metadata"]["name"] for p in out.kinds("NetworkPolicy")) == [
        "kuberefit-control",
        "kuberefit-relay",
    ]
    assert {p["metadata"]["namespace"] for p in out.kinds("NetworkPolicy")} == {NAMESPACE}


# --- values.yaml, its schema and its docs agree ---------------------------------------------


def value_paths(values: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Leaf paths of values.yaml; OPAQUE Kubernetes objects count as one leaf."""
    for key, value in values.items():
        path = prefix + key
        if isinstance(value, dict) and value and path not in OPAQUE:
            yield from value_paths(value, path + ".")
        else:
            yield path, value


def default_values() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return loaded


def documented() -> dict[str, str]:
    """`key` -> default (JSON) of the table rows in the "Chart values" section of the docs."""
    section = DOCS.read_text().split("\n## Chart values\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| `([^`]*)` \|", section, re.MULTILINE)
    return dict(rows)


def test_docs_list_every_value_with_its_default() -> None:
    paths = dict(value_paths(default_values()))
    docs = documented()
    assert sorted(paths) == sorted(docs), "docs/operator.md (Chart values) and values.yaml differ"
    for path, default in paths.items():
        assert json.loads(docs[path]) == default, path


def test_every_value_has_a_helm_docs_comment() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    wanted = set(dict(value_paths(default_values())))
    wanted |= {p.rsplit(".", i)[0] for p in wanted for i in range(1, p.count(".") + 1)}
    stack: list[tuple[int, str]] = []
    seen = set()
    for number, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z][A-Za-z0-9]*):", line)
        if not match:
            continue
        indent = len(match.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match.group(2)))
        path = ".".join(key for _, key in stack)
        if path not in wanted:
            continue
        seen.add(path)
        start = number
        while start > 0 and lines[start - 1].strip().startswith("#"):
            start -= 1
        assert start < number, f"values.yaml: {path} has no comment"
        assert lines[start].strip().startswith("# -- "), f"values.yaml: {path}: not `# --`"
    assert seen == wanted


def test_schema_covers_every_value(chart: helm_python.Chart) -> None:
    schema = chart.schema
    assert schema is not None
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"

    def resolve(node: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in node:
            node = schema["definitions"][node["$ref"].rsplit("/", 1)[-1]]
        return node

    for path, _ in value_paths(default_values()):
        node = schema
        for key in path.split("."):
            node = resolve(node)
            assert key in node.get("properties", {}), f"values.schema.json lacks {path}"
            node = node["properties"][key]


def test_an_existing_service_account_must_be_named(chart: helm_python.Chart) -> None:
    with pytest.raises(helm_python.HelmError, match=r"serviceAccount\.name is required"):
        render(chart, {"serviceAccount": {"create": False}})
    out = render(chart, {"serviceAccount": {"create": False, "name": "ops"}})
    assert out.kinds("ServiceAccount") == []
