"""The operator on a real API server without rollouts: what kubectl users see when they get
something wrong, and that the operator stays out of the commit record's way.

One operator process (least-privilege user, as in the chart) serves a namespace of its own for
every test here; the refit path itself is the e2e (tests/test_operator_e2e.py).
"""

from __future__ import annotations

import contextlib
import json
import signal
import urllib.request
import uuid
from collections.abc import Iterator

import pytest
from kubernetes.client.rest import ApiException

from tests.harness.kube import KubeCluster
from tests.harness.operator_env import GROUP, VERSION, OperatorEnv, wait_for
from tests.harness.procs import ManagedProcess


@pytest.fixture(scope="module")
def env(refit_crds: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorEnv]:
    e = OperatorEnv(refit_crds, tmp_path_factory.mktemp("operator"), f"op-{uuid.uuid4().hex[:6]}")
    e.setup()
    e.start_operator("solo")
    try:
        yield e
        # Everything the tests made the operator do, it did as its own user under the chart's
        # ClusterRole: the API server refused it nothing.
        assert e.denials() == []
    finally:
        e.stop()


@pytest.fixture(scope="module")
def operator(env: OperatorEnv) -> ManagedProcess:
    return env.operators[0]


def test_schema_refuses_bad_fields(env: OperatorEnv) -> None:
    for bad in ({"transport": "carrier-pigeon"}, {"producers": 0}, {"postApplyChecks": -2}):
        with pytest.raises(ApiException) as err:
            env.custom.create_namespaced_custom_object(
                GROUP, VERSION, env.namespace, "refitpolicies", env.policy("bad", bad)
            )
        assert err.value.status == 422, bad
        field = next(iter(bad))
        assert f"spec.{field}" in str(err.value.body), err.value.body
    body = env.policy("bad", {})
    del body["spec"]["tokenSecret"]
    with pytest.raises(ApiException) as err:  # no token Secret named at all
        env.custom.create_namespaced_custom_object(
            GROUP, VERSION, env.namespace, "refitpolicies", body
        )
    assert "spec.tokenSecret" in str(err.value.body)


def test_cross_field_rule_reported_in_a_condition_and_cleared_when_fixed(env: OperatorEnv) -> None:
    env.apply(env.policy("audit-half", {"verify": {"everyVersions": 2}}))
    ready = wait_for(
        "InvalidSpec condition",
        lambda: (c := env.condition("audit-half", "Ready")).get("reason") == "InvalidSpec" and c,
    )
    assert ready["status"] == "False"
    assert "spec.verify.everyVersions needs spec.restore.checkpointTemplate" in ready["message"]
    status = env.get("refitpolicies", "audit-half")["status"]
    assert status["observedGeneration"] == 1
    assert env.condition("audit-half", "Degraded")["status"] == "True"
    # Fixing the spec is observed at the new generation.
    env.patch_spec("audit-half", {"restore": {"checkpointTemplate": "/ckpt/v{version}"}})
    wait_for(
        "condition at generation 2",
        lambda: env.get("refitpolicies", "audit-half")["status"].get("observedGeneration") == 2,
    )
    ready = env.condition("audit-half", "Ready")
    assert ready["reason"] == "WaitingForTrainers", ready
    assert "0 of 1 trainer pods" in ready["message"]


def test_missing_or_unmarked_token_secret_is_reported(env: OperatorEnv) -> None:
    body = env.policy("no-secret", {})
    body["spec"]["tokenSecret"] = {"name": "does-not-exist"}
    env.apply(body)
    ready = wait_for(
        "TokenSecretMissing",
        lambda: (
            (c := env.condition("no-secret", "Ready")).get("reason") == "TokenSecretMissing" and c
        ),
    )
    assert "does-not-exist" in ready["message"]
    assert "spec.tokenSecret" in ready["message"]
    # A Secret not marked for KubeRefit is never read (nor sent to any pod).
    env.core.create_namespaced_secret(
        env.namespace, {"metadata": {"name": "db-password"}, "stringData": {"token": "hunter2"}}
    )
    body = env.policy("wrong-secret", {})
    body["spec"]["tokenSecret"] = {"name": "db-password"}
    env.apply(body)
    ready = wait_for(
        "TokenSecretRefused",
        lambda: (
            (c := env.condition("wrong-secret", "Ready")).get("reason") == "TokenSecretRefused"
            and c
        ),
    )
    assert "kuberefit.io/token=true" in ready["message"]
    assert "hunter2" not in str(env.get("refitpolicies", "wrong-secret"))


def test_pods_that_cannot_take_part_get_an_event(env: OperatorEnv) -> None:
    env.create_pod("stray", "rollout", "no-such-policy", {"refit-control": 1})
    events = wait_for("PolicyNotFound event", lambda: env.events("stray"))
    assert [(e["reason"], e["type"]) for e in events] == [("PolicyNotFound", "Warning")]
    assert "no-such-policy" in events[0]["message"]
    env.apply(env.policy("roles", {}))
    env.create_pod("odd-role", "sidecar", "roles", {"refit-control": 1})
    events = wait_for("UnknownRole event", lambda: env.events("odd-role"))
    assert events[0]["reason"] == "UnknownRole"
    assert "neither trainer nor rollout" in events[0]["message"]


def test_paused_policy_is_not_ready_and_says_why(env: OperatorEnv) -> None:
    env.apply(env.policy("paused", {"paused": True}))
    ready = wait_for(
        "Paused", lambda: (c := env.condition("paused", "Ready")).get("reason") == "Paused" and c
    )
    assert "spec.paused" in ready["message"]
    env.patch_spec("paused", {"paused": False})
    wait_for(
        "unpaused",
        lambda: env.condition("paused", "Ready").get("reason") == "WaitingForTrainers",
    )


def test_policy_version_created_untouched_by_kopf_and_deletion_completes(
    env: OperatorEnv, operator: ManagedProcess
) -> None:
    """No finalizer: a policy can be deleted with or without an operator running. The one an
    older operator (a kopf daemon) left is removed, and a foreign one is left alone."""
    body = env.policy("gone", {})
    body["metadata"]["finalizers"] = ["example.com/keep", "kuberefit.io/finalizer"]
    env.apply(body)
    pv = wait_for(
        "PolicyVersion with a record",
        lambda: (p := _maybe(env, "policyversions", "gone")) and "status" in p and p,
    )
    assert pv["status"]["version"] == 0
    assert pv["spec"]["policy"] == "gone"
    policy = wait_for(
        "the old finalizer removed",
        lambda: (
            (p := env.get("refitpolicies", "gone"))["metadata"].get("finalizers")
            == ["example.com/keep"]
            and p
        ),
    )
    annotations = policy["metadata"].get("annotations") or {}
    assert not [k for k in annotations if "kopf" in k or "kuberefit.io/" in k], annotations
    pv = env.get("policyversions", "gone")
    assert not pv["metadata"].get("annotations"), pv
    assert not pv["metadata"].get("finalizers"), pv
    # Deleting the policy stops its coordinator as soon as deletion begins.
    env.kube.kubectl("delete", "-n", env.namespace, "refitpolicy", "gone", "--wait=false")
    wait_for(
        "policy.stopped logged",
        lambda: any(
            '"policy.stopped"' in line and '"gone"' in line
            for line in operator.log_path.read_text().splitlines()
        ),
    )
    env.kube.kubectl(
        "patch", "-n", env.namespace, "refitpolicy", "gone", "--type=merge",
        "-p", '{"metadata":{"finalizers":[]}}',
    )  # fmt: skip
    wait_for("deleted", lambda: _maybe(env, "refitpolicies", "gone") is None)


def test_health_and_metrics(env: OperatorEnv, operator: ManagedProcess) -> None:
    base = operator.metrics_url  # type: ignore[attr-defined]
    for path in ("/healthz", "/readyz"):
        with urllib.request.urlopen(base + path, timeout=5) as resp:
            assert resp.status == 200
    env.apply(env.policy("metered", {}))
    leader = f'kuberefit_operator_policy_leader{{namespace="{env.namespace}",policy="metered"}} 1.0'

    def scrape() -> str:
        with urllib.request.urlopen(base + "/metrics", timeout=5) as resp:
            return str(resp.read().decode())

    version = (
        f'kuberefit_operator_committed_version{{namespace="{env.namespace}",policy="metered"}} 0.0'
    )
    wait_for("leader and version gauges", lambda: leader in (text := scrape()) and version in text)


def _maybe(env: OperatorEnv, plural: str, name: str) -> dict | None:  # type: ignore[type-arg]
    try:
        return env.get(plural, name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def test_sigterm_stops_an_operator_with_exit_0(env: OperatorEnv) -> None:
    """As the sidecars and the coordinator: SIGTERM is a normal stop (`--help` says so). Each
    policy loop is asked to stop and ends its pass; none is cut off by kopf's cancellation of
    leftover tasks (which is what happened while the loops were out of the cleanup's reach)."""
    env.apply(env.policy("graceful", {}))
    standby = env.start_operator("stopped-by-sigterm")
    env.operators.remove(standby)

    def started() -> list[dict]:  # type: ignore[type-arg]
        return [e for e in _events(standby, "policy.started") if e["policy"] == "graceful"]

    wait_for("the standby's loop of policy graceful", started)
    standby.kill(signal.SIGTERM)
    assert standby.proc is not None
    assert standby.proc.wait(timeout=60) == 0, standby.log_path.read_text()[-2000:]
    stopped = _events(standby, "policy.stopped")
    assert stopped, standby.log_path.read_text()[-2000:]
    assert [e["cancelled"] for e in stopped] == [False] * len(stopped)
    assert {e["policy"] for e in stopped} >= {"graceful"}
    assert _events(standby, "operator.stopped")


def _events(proc: ManagedProcess, event: str) -> list[dict]:  # type: ignore[type-arg]
    found = []
    for line in proc.log_path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("event") == event:
                found.append(record)
    return found
