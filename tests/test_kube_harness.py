"""The kube harness's kubectl and operator identity are real: kubectl v1.20.2 matches the apiserver,
RBAC refuses the group-less operator user until a test binds it a role, and the audit log records
each refusal (so an operator test can assert exactly which permission its chart failed to grant)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness.kube import K8S_VERSION, OPERATOR_USER, KubeCluster, kubectl_binary
from tests.harness.procs import ComponentError


@pytest.fixture
def namespace(kube: KubeCluster) -> Iterator[str]:
    """A fresh namespace, deleted afterwards (it stays Terminating: there is no controller-manager
    to finalize it, which is harmless as every name is unique)."""
    name = f"harness-{uuid.uuid4().hex[:8]}"
    kube.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        kube.kubectl("delete", "namespace", name, "--wait=false")


def _poll(what: str, fn: Any, timeout: float = 10.0) -> Any:
    """fn() until it returns something truthy; the audit log and RBAC's cache lag a little."""
    deadline = time.monotonic() + timeout
    while True:
        result = fn()
        if result or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert result, f"{what}: not within {timeout}s"
    return result


def test_kubectl_client_and_server_are_v1_20_2(kube: KubeCluster) -> None:
    versions = json.loads(kube.kubectl("version", "-o", "json"))
    assert versions["clientVersion"]["gitVersion"] == K8S_VERSION
    assert versions["serverVersion"]["gitVersion"] == K8S_VERSION


def test_admin_kubectl_lists_default_namespace(kube: KubeCluster) -> None:
    assert "namespace/default" in kube.kubectl("get", "namespaces", "-o", "name").split()


def test_missing_kubectl_fails_with_instructions(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KUBEREFIT_KUBECTL", str(tmp_path / "no-kubectl"))
    with pytest.raises(ComponentError, match="make kubectl"):
        kubectl_binary()


def _configmap_list_denials(kube: KubeCluster, namespace: str) -> list[dict[str, Any]]:
    return [
        e
        for e in kube.audit_denials(OPERATOR_USER)
        if e["verb"] == "list"
        and e.get("objectRef", {}).get("resource") == "configmaps"
        and e.get("objectRef", {}).get("namespace") == namespace
    ]


def _configmap_lister_rbac(namespace: str) -> list[dict[str, Any]]:
    meta = {"name": "pod-lister", "namespace": namespace}
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "pod-lister",
            },
            "subjects": [
                {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": OPERATOR_USER}
            ],
        },
    ]


def test_operator_is_denied_and_audited_until_a_role_is_bound(
    kube: KubeCluster, namespace: str, tmp_path: Path
) -> None:
    # configmaps: a resource the operator's own ClusterRole (bound by the operator tests of the
    # same session) never grants.
    operator = kube.operator_kubeconfig
    with pytest.raises(AssertionError) as err:
        kube.kubectl("get", "configmaps", "-n", "default", kubeconfig=operator)
    assert "Forbidden" in str(err.value)
    assert f'User "{OPERATOR_USER}" cannot list resource "configmaps"' in str(err.value)
    denied = _poll("403 in the audit log", lambda: _configmap_list_denials(kube, "default"))
    assert denied[-1]["annotations"]["authorization.k8s.io/decision"] == "forbid"

    # The fresh namespace is no different until the binding exists.
    with pytest.raises(AssertionError, match="Forbidden"):
        kube.kubectl("get", "configmaps", "-n", namespace, kubeconfig=operator)
    manifest = tmp_path / "rbac.yaml"
    manifest.write_text(yaml.safe_dump_all(_configmap_lister_rbac(namespace)))
    kube.kubectl("apply", "-f", str(manifest))

    def lists_configmaps() -> bool:
        try:
            kube.kubectl("get", "configmaps", "-n", namespace, kubeconfig=operator)
        except AssertionError:
            return False  # RBAC's informer has not seen the binding yet
        return True

    _poll("operator lists configmaps once bound", lists_configmaps)
    # Only that namespace: default still refuses, and only the operator, the admin and service
    # accounts (the chart's operator runs as one) are audited, not the API server's own traffic.
    with pytest.raises(AssertionError, match="Forbidden"):
        kube.kubectl("get", "configmaps", "-n", "default", kubeconfig=operator)
    users = {e["user"]["username"] for e in kube.audit_events()}
    accounts = {u for u in users if u.startswith("system:serviceaccount:")}
    assert users - accounts <= {OPERATOR_USER, "kuberefit-admin"}, users
