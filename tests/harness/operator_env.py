"""The operator on the harness's real API server: a namespace, the operator's least-privilege
role bound to the operator's own user, `kuberefit operator` processes, and pods without a kubelet
(created with what injection adds, then given a Running status and a loopback pod IP)."""

from __future__ import annotations

import datetime as dt
import json
import os
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from kubernetes.client.rest import ApiException

from tests.harness.kube import KubeCluster
from tests.harness.procs import ManagedProcess, free_port, http_ok

REPO = Path(__file__).resolve().parents[2]
CLUSTER_ROLE = REPO / "charts" / "kuberefit" / "files" / "operator-clusterrole.yaml"
LEASES_ROLE = REPO / "charts" / "kuberefit" / "files" / "operator-leases-role.yaml"
GROUP, VERSION = "refit.kuberefit.io", "v1alpha1"
T = TypeVar("T")


def wait_for(what: str, fn: Callable[[], T], timeout: float = 60.0, every: float = 0.1) -> T:
    """`fn()` until it returns something truthy; fails naming `what` after `timeout` s.

    A read the API server answers with a 5xx is tried again: the harness's etcd on a loaded
    2-core machine sometimes times out a request ("etcdserver: request timed out"), which says
    nothing about what is awaited. Any other error propagates."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = fn()
        except ApiException as exc:
            if not (exc.status or 0) >= 500 or time.monotonic() > deadline:
                raise
            value = None  # type: ignore[assignment]
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f}s (last: {value!r})")
        time.sleep(every)


class OperatorEnv:
    """One namespace where tests run operators and pods (see the module docstring)."""

    def __init__(self, kube: KubeCluster, root: Path, namespace: str) -> None:
        from kubernetes import client

        self.kube = kube
        self.root = root
        self.namespace = namespace
        self.api_client = kube.api_client()
        self.core = client.CoreV1Api(self.api_client)
        self.custom = client.CustomObjectsApi(self.api_client)
        self.token = secrets.token_hex(16)
        self.operators: list[ManagedProcess] = []
        self.started = dt.datetime.now(dt.UTC)

    def denials(self) -> list[tuple[str, str]]:
        """What the API server refused the operator's user since this environment started."""
        found = self.kube.audit_denials(self.kube.operator_user, since=self.started)
        return [(d["verb"], d["requestURI"]) for d in found]

    def setup(self) -> OperatorEnv:
        """The namespace, the token Secret, and the operator role bound to its user."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.core.create_namespace({"metadata": {"name": self.namespace}})
        self.kube.kubectl("apply", "-f", str(CLUSTER_ROLE))
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "kuberefit-operator"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "kuberefit-operator",
            },
            "subjects": [
                {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "User",
                    "name": self.kube.operator_user,
                }
            ],
        }
        self.apply(binding)
        # The operators here run with one --namespace and no $POD_NAMESPACE: their Leases live in
        # that namespace, under the chart's leases Role (never cluster-wide).
        self.kube.kubectl("apply", "-n", self.namespace, "-f", str(LEASES_ROLE))
        self.apply(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": "kuberefit-operator-leases"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "Role",
                    "name": "kuberefit-operator-leases",
                },
                "subjects": [
                    {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "User",
                        "name": self.kube.operator_user,
                    }
                ],
            }
        )
        self.core.create_namespaced_secret(
            self.namespace,
            {
                "metadata": {"name": "refit-token", "labels": {"kuberefit.io/token": "true"}},
                "stringData": {"token": self.token},
            },
        )
        return self

    # -- objects --------------------------------------------------------------------------------
    def apply(self, obj: dict[str, Any]) -> None:
        """`kubectl apply` of one object (as a user would)."""
        path = self.root / f"apply-{secrets.token_hex(4)}.yaml"
        path.write_text(yaml.safe_dump(obj))
        self.kube.kubectl("apply", "-n", self.namespace, "-f", str(path))

    def policy(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "RefitPolicy",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": {"tokenSecret": {"name": "refit-token"}, **spec},
        }

    def get(self, plural: str, name: str) -> dict[str, Any]:
        obj: dict[str, Any] = self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, plural, name
        )
        return obj

    def patch_spec(self, policy: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "refitpolicies", policy, {"spec": spec}
        )

    def transitions(self, policy: str) -> list[dict[str, Any]]:
        items = self.custom.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "refittransitions"
        )["items"]
        mine = [t for t in items if t["spec"]["policy"] == policy]
        return sorted(mine, key=lambda t: str(t["metadata"]["name"]))

    def condition(self, policy: str, kind: str) -> dict[str, Any]:
        status = self.get("refitpolicies", policy).get("status") or {}
        return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})

    def events(self, name: str) -> list[dict[str, Any]]:
        """Events whose involved object is `name`, oldest first."""
        items = self.core.list_namespaced_event(self.namespace).items
        mine = [e for e in items if e.involved_object.name == name]
        return [
            {"reason": e.reason, "message": e.message, "type": e.type}
            for e in sorted(mine, key=lambda e: (e.first_timestamp, e.metadata.name))
        ]

    # -- pods -----------------------------------------------------------------------------------
    def create_pod(
        self,
        name: str,
        role: str,
        policy: str,
        ports: dict[str, int],
        labels: dict[str, str] | None = None,
    ) -> str:
        """A pod as injection leaves it, marked Running on 127.0.0.1; returns its UID."""
        body = {
            "metadata": {
                "name": name,
                "labels": labels or {},
                "annotations": {"kuberefit.io/inject": role, "kuberefit.io/policy": policy},
            },
            "spec": {
                "containers": [
                    {"name": "main", "image": "example/main"},
                    {
                        "name": "kuberefit-sidecar",
                        "image": "kuberefit/sidecar:0.1.0",
                        "ports": [
                            {"name": n, "containerPort": p, "protocol": "TCP"}
                            for n, p in ports.items()
                        ],
                    },
                ]
            },
        }
        pod = self.core.create_namespaced_pod(self.namespace, body)
        self.set_running(name)
        return str(pod.metadata.uid)

    def set_running(self, name: str, restarts: int = 0) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        status = {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "podIPs": [{"ip": "127.0.0.1"}],
            "containerStatuses": [
                {
                    "name": c,
                    "ready": True,
                    "restartCount": restarts if c == "kuberefit-sidecar" else 0,
                    "image": "example",
                    "imageID": "",
                    "state": {"running": {"startedAt": now}},
                }
                for c in ("main", "kuberefit-sidecar")
            ],
        }
        self.core.patch_namespaced_pod_status(name, self.namespace, {"status": status})

    def delete_pod(self, name: str) -> None:
        self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)
        wait_for(f"pod {name} gone", lambda: not self._pod_exists(name), timeout=30)

    def _pod_exists(self, name: str) -> bool:
        return any(
            p.metadata.name == name for p in self.core.list_namespaced_pod(self.namespace).items
        )

    # -- operators ------------------------------------------------------------------------------
    def start_operator(self, identity: str, *, lease_s: int = 15) -> ManagedProcess:
        """`kuberefit operator` for this namespace, as the operator's least-privilege user."""
        port = free_port()
        proc = ManagedProcess(
            f"operator-{identity}",
            [
                sys.executable,
                "-m",
                "refit_protocol.kit.cli",
                "operator",
                "serve",
                "--namespace",
                self.namespace,
                "--identity",
                identity,
                "--metrics-bind",
                f"127.0.0.1:{port}",
                "--lease-seconds",
                str(lease_s),
                "--poll-seconds",
                "0.2",
            ],
            self.root / f"operator-{identity}.log",
            env={**os.environ, "KUBECONFIG": str(self.kube.operator_kubeconfig)},
        )
        proc.metrics_url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
        proc.start(lambda: http_ok(f"http://127.0.0.1:{port}/readyz"), timeout=60)
        self.operators.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.operators:
            proc.stop()


def log_events(proc: ManagedProcess) -> list[dict[str, Any]]:
    """The JSON log lines of a process (structlog's JSON renderer)."""
    out = []
    for line in proc.log_path.read_text().splitlines() if proc.log_path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
