"""Prometheus metrics of the control plane, one naming scheme (`refit_protocol.kit.metrics`):

- the operator's (`kuberefit operator serve --metrics-bind`, the global registry): per policy,
  labelled `namespace` and `policy`, created when its loop starts: the transition families
  (`TRANSITION`) and the operator's own (takeovers, restores, leadership, audits), plus the
  webhook's admissions;
- one coordinator process's (`kuberefit coordinator serve`, `CoordinatorMetrics`, a registry of its
  own served on its `metrics_port`): the same transition families under `kuberefit_coordinator_`,
  without policy labels (a process coordinates one policy).

Both record transitions through one `TransitionMetrics` (`transition_metrics.py`).
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge
from prometheus_client.metrics import MetricWrapperBase

from refit_operator.transition_metrics import TransitionMetrics, forget
from refit_protocol.kit.metrics import add_build_info, preset

_POLICY = ["namespace", "policy"]
ADMISSION_RESULTS = ("injected", "unchanged", "denied", "invalid")
AUDIT_RESULTS = ("verified", "mismatch", "incomplete")

BUILD_INFO = add_build_info(REGISTRY, "operator")

TRANSITION = TransitionMetrics(REGISTRY, "operator", _POLICY)
TAKEOVERS = Counter(
    "kuberefit_operator_takeovers_total",
    "Transitions this operator continued after another coordinator (or its own previous "
    "process) stopped.",
    _POLICY,
)
RESTORES = Counter(
    "kuberefit_operator_restores_total",
    "Dense restores of joining rollout nodes to the committed version.",
    _POLICY,
)
LEADER = Gauge(
    "kuberefit_operator_policy_leader",
    "1 while this operator holds the policy's Lease (coordinates it), else 0.",
    _POLICY,
)
AUDITS = Counter(
    "kuberefit_operator_audits_total",
    "Audits of the rollout nodes against the committed checkpoint (spec.verify) by result: "
    "verified, mismatch (a node holds other bits), incomplete (a node could not be compared).",
    [*_POLICY, "result"],
)
AUDITED_VERSION = Gauge(
    "kuberefit_operator_audited_version",
    "The last version every rollout node was proven to hold exactly (spec.verify).",
    _POLICY,
)
_PER_POLICY: tuple[MetricWrapperBase, ...] = (
    *TRANSITION.families,
    TAKEOVERS,
    RESTORES,
    LEADER,
    AUDITS,
    AUDITED_VERSION,
)
ADMISSIONS = Counter(
    "kuberefit_webhook_admissions_total",
    "Pod admissions by result: injected, unchanged (not opted in, or injected already), "
    "denied (opted in but cannot be injected as written), invalid (not a Pod review).",
    ["result"],
)
preset(ADMISSIONS, *ADMISSION_RESULTS)


def preset_policy(namespace: str, policy: str) -> None:
    """Create a policy's labelled operator series at 0 (when its loop starts)."""
    TRANSITION.start(namespace, policy)
    TRANSITION.transitions.labels(namespace, policy, "failed")  # the operator's own outcome
    for metric in (TAKEOVERS, RESTORES, LEADER):
        metric.labels(namespace, policy)
    preset(AUDITS, *((namespace, policy, r) for r in AUDIT_RESULTS))


def forget_policy(namespace: str, policy: str) -> None:
    """Remove a deleted policy's series (every family labelled by policy)."""
    forget(_PER_POLICY, (namespace, policy))


class CoordinatorMetrics(TransitionMetrics):
    """One coordinator process's metrics (`kuberefit coordinator serve`), on a registry of its
    own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        super().__init__(self.registry, "coordinator")
        self.build_info = add_build_info(self.registry, "coordinator")
        self.start()
        self.committed(-1)  # not read yet
