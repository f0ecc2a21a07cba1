"""The operator's per-policy series exist at 0 while its loop runs and go away with the policy
(a churn of policies must not grow /metrics forever)."""

from __future__ import annotations

from prometheus_client import REGISTRY

from refit_operator import metrics


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
