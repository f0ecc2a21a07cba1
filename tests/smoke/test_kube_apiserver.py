"""The harness's kube-apiserver is real: CRDs with status, optimistic concurrency, webhooks."""

from __future__ import annotations

import base64
import json
import ssl
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.harness.kube import KubeCluster
from tests.harness.operator_env import wait_for

GROUP = "smoke.kuberefit.io"
MUTATED = {"kuberefit.io/mutated": "yes"}  # the labels the smoke webhook adds


def _crd(plural: str, kind: str) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": kind.lower(), "kind": kind},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "properties": {"replicas": {"type": "integer"}},
                                },
                                "status": {
                                    "type": "object",
                                    "properties": {"phase": {"type": "string"}},
                                },
                            },
                        }
                    },
                }
            ],
        },
    }


@pytest.fixture(scope="module")
def widgets(kube: KubeCluster) -> Iterator[client.CustomObjectsApi]:
    api = kube.api_client()
    ext = client.ApiextensionsV1Api(api)
    ext.create_custom_resource_definition(_crd("widgets", "Widget"))
    # The CRD is served only once it is Established.
    for _ in range(100):
        crd = ext.read_custom_resource_definition(f"widgets.{GROUP}")
        conds = {c.type: c.status for c in (crd.status.conditions or [])}
        if conds.get("Established") == "True":
            break
        threading.Event().wait(0.1)
    else:
        pytest.fail("CRD never became Established")
    yield client.CustomObjectsApi(api)
    ext.delete_custom_resource_definition(f"widgets.{GROUP}")


def test_apiserver_reports_v1_20_2(kube: KubeCluster) -> None:
    assert client.VersionApi(kube.api_client()).get_code().git_version == "v1.20.2"


def test_crd_status_subresource_and_stale_resource_version_conflict(
    widgets: client.CustomObjectsApi, kube: KubeCluster
) -> None:
    body = {"apiVersion": f"{GROUP}/v1", "kind": "Widget", "metadata": {"name": "w1"}}
    body["spec"] = {"replicas": 1}
    created = widgets.create_namespaced_custom_object(GROUP, "v1", "default", "widgets", body)
    stale = created["metadata"]["resourceVersion"]

    # Status goes through the /status subresource only; the main resource ignores it.
    created["status"] = {"phase": "Committed"}
    updated = widgets.replace_namespaced_custom_object_status(
        GROUP, "v1", "default", "widgets", "w1", created
    )
    assert updated["status"] == {"phase": "Committed"}
    assert updated["metadata"]["resourceVersion"] != stale

    # A compare-and-set with the old resourceVersion must lose with 409 Conflict.
    created["metadata"]["resourceVersion"] = stale
    created["status"] = {"phase": "Stale"}
    with pytest.raises(ApiException) as err:
        widgets.replace_namespaced_custom_object_status(
            GROUP, "v1", "default", "widgets", "w1", created
        )
    assert err.value.status == 409
    current = widgets.get_namespaced_custom_object(GROUP, "v1", "default", "widgets", "w1")
    assert current["status"] == {"phase": "Committed"}

    # The audit log proves the requests reached this apiserver.
    audit = (kube.workdir / "audit.log").read_text()
    assert '"resource":"widgets"' in audit
    assert '"subresource":"status"' in audit


class _WebhookServer(ThreadingHTTPServer):
    """One test's webhook: the reviews it was sent are its own, not shared between tests."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Webhook)
        self.seen: list[dict[str, Any]] = []


class _Webhook(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cast(_WebhookServer, self.server).seen.append(review)
        patch = [{"op": "add", "path": "/metadata/labels", "value": MUTATED}]
        response = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {
                "uid": review["request"]["uid"],
                "allowed": True,
                "patchType": "JSONPatch",
                "patch": base64.b64encode(json.dumps(patch).encode()).decode(),
            },
        }
        data = json.dumps(response).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass


def test_https_mutating_webhook_mutates_pod(kube: KubeCluster) -> None:
    assert kube.ca is not None
    pair = kube.ca.issue("smoke-webhook")
    server = _WebhookServer()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pair.cert_path, pair.key_path)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    api = kube.api_client()
    adm = client.AdmissionregistrationV1Api(api)
    name = f"smoke-{uuid.uuid4().hex[:6]}"
    adm.create_mutating_webhook_configuration(
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": [
                {
                    "name": "smoke.kuberefit.io",
                    "admissionReviewVersions": ["v1"],
                    "sideEffects": "None",
                    "failurePolicy": "Fail",
                    "timeoutSeconds": 5,
                    "clientConfig": {
                        "url": f"https://127.0.0.1:{server.server_address[1]}/mutate",
                        "caBundle": base64.b64encode(kube.ca.cert_pem).decode(),
                    },
                    "rules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE"],
                            "resources": ["pods"],
                        }
                    ],
                }
            ],
        }
    )
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "c", "image": "example.invalid/none:1"}]},
    }
    try:
        core = client.CoreV1Api(api)

        def mutated_dry_run() -> bool:
            pod = core.create_namespaced_pod("default", body, dry_run="All")
            return bool(pod.metadata.labels == MUTATED)

        # The apiserver takes a new webhook configuration in through an informer: until it has,
        # pods are admitted unmutated. Server-side dry runs find out when, without a pod.
        wait_for("the webhook configuration in force", mutated_dry_run, timeout=30)
        before = len(server.seen)
        pod = core.create_namespaced_pod("default", body)
        assert pod.metadata.labels == MUTATED
        assert [(r["request"]["name"], r["request"]["dryRun"]) for r in server.seen[before:]] == [
            (name, False)
        ]
        core.delete_namespaced_pod(name, "default")
    finally:
        adm.delete_mutating_webhook_configuration(name)
        server.shutdown()
