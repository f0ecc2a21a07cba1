"""The operator's per-policy series exist at 0 while its loop runs and go away with the policy
(a churn of policies must not grow /metrics forever)."""

from __future__ import annotations

from prometheus_client import REGISTRY
from prometheus_client.metrics_core import Metric

from refit_operator import metrics
from refit_operator.metrics import CoordinatorMetrics
from refit_operator.transition_types import TransitionResult
from refit_protocol.kit.metrics import SECONDS_BUCKETS


def series_of(namespace: str, policy: str) -> list[str]:
    return [
        s.name
        for family in REGISTRY.collect()
        for s in family.samples
        if s.labels.get("namespace") == namespace and s.labels.get("policy") == policy
    ]


def test_a_deleted_policys_series_are_removed_and_the_others_kept() -> None:
    metrics.preset_policy("ns-m", "doomed")
    metrics.preset_policy("ns-m", "kept")
    metrics.LEADER.labels("ns-m", "doomed").set(1)
    assert "kuberefit_operator_transitions_total" in series_of("ns-m", "doomed")
    assert "kuberefit_operator_policy_leader" in series_of("ns-m", "doomed")
    before = len(series_of("ns-m", "kept"))
    metrics.forget_policy("ns-m", "doomed")
    assert series_of("ns-m", "doomed") == []
    assert len(series_of("ns-m", "kept")) == before > 20
    metrics.forget_policy("ns-m", "kept")


def _shape(registry_families: list[Metric], prefix: str, scope: set[str]) -> dict[str, object]:
    """Per family suffix: type, help, label names beyond the scope's, histogram buckets."""
    out: dict[str, object] = {}
    for family in registry_families:
        if not family.name.startswith(prefix):
            continue
        labels = {k for s in family.samples for k in s.labels if k not in scope | {"le"}}
        buckets = sorted(
            {float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")}
        )
        out[family.name[len(prefix) :]] = (family.type, family.documentation, labels, buckets)
    return out


def test_the_operator_and_a_coordinator_process_record_transitions_alike() -> None:
    """One recorder (`TransitionMetrics`): every transition family of a coordinator process
    exists in the operator with the same suffix, type, help, labels and buckets, and one
    committed transition recorded by both lands in the same series."""
    coordinator = CoordinatorMetrics()
    metrics.preset_policy("ns-m", "alike")
    result = TransitionResult("committed", 3, 2, modes=["mixed", "overwrite"], latency_s=1.5)
    coordinator.record(result)
    metrics.TRANSITION.record(result, "ns-m", "alike")
    ours = _shape(list(coordinator.registry.collect()), "kuberefit_coordinator_", set())
    operator = _shape(list(REGISTRY.collect()), "kuberefit_operator_", {"namespace", "policy"})
    transition_families = {k: operator[k] for k in ours}
    assert ours == transition_families
    # Pinned, so a change of what dashboards and alerts read is a deliberate one:
    assert {k: (v[0], sorted(v[2])) for k, v in ours.items()} == {  # type: ignore[index]
        "committed_version": ("gauge", []),
        "last_commit_timestamp_seconds": ("gauge", []),
        "transitions": ("counter", ["outcome"]),
        "attempts": ("counter", ["mode", "outcome"]),
        "transition_latency_seconds": ("histogram", []),
        "transition_stage_seconds": ("histogram", ["stage"]),
        "wire_bytes": ("counter", []),
        "changed_fraction": ("gauge", []),
        "transition_changed_fraction": ("histogram", []),
    }
    seconds = [*SECONDS_BUCKETS, float("inf")]
    assert ours["transition_latency_seconds"][3] == seconds  # type: ignore[index]
    assert ours["transition_stage_seconds"][3] == seconds  # type: ignore[index]

    def sample(registry: object, name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)  # type: ignore[attr-defined]

    policy = {"namespace": "ns-m", "policy": "alike"}
    for name, labels in [
        ("transitions_total", {"outcome": "committed"}),
        ("attempts_total", {"mode": "mixed", "outcome": "failed"}),
        ("attempts_total", {"mode": "overwrite", "outcome": "committed"}),
        ("transition_latency_seconds_sum", {}),
        ("committed_version", {}),
    ]:
        mine = sample(coordinator.registry, "kuberefit_coordinator_" + name, **labels)
        theirs = sample(REGISTRY, "kuberefit_operator_" + name, **policy, **labels)
        assert mine == theirs is not None, name
    assert sample(coordinator.registry, "kuberefit_coordinator_committed_version") == 3
    metrics.forget_policy("ns-m", "alike")
