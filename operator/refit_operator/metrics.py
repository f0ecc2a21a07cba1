"""Prometheus metrics of the control plane, one naming scheme (`refit_protocol.metrics`):

- the operator's (`kuberefit operator serve --metrics-bind`, the global registry): per policy,
  labelled `namespace` and `policy`, created when its loop starts;
- one coordinator process's (`kuberefit coordinator serve`, `CoordinatorMetrics`, a registry of its
  own served on its `metrics_port`): the same families under `kuberefit_coordinator_`, without
  policy labels (a process coordinates one policy).

A transition's stages (`STAGES`, from `TransitionProgress.timings`): construct (the slowest
producer's delta construction and encoding), transport (its sending), apply (the slowest
receiver's applier calls and device sync), finalize (flush acknowledged to the last baseline
update).
"""

from __future__ import annotations

import time

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from refit_operator.coordinator import TransitionResult
from refit_protocol.metrics import FRACTION_BUCKETS, SECONDS_BUCKETS, add_build_info, preset

_POLICY = ["namespace", "policy"]
#: Transition outcomes a coordinator reports ("failed" is the operator's own: its coordinator
#: raised).
OUTCOMES = ("committed", "rejected", "conflict", "aborted")
MODES = ("mixed", "overwrite")
#: How one attempt ended: the one that committed, one that failed (retried in overwrite mode
#: or the transition aborted), a rejected first prepare, a conflict with another coordinator.
ATTEMPT_OUTCOMES = ("committed", "failed", "rejected", "conflict")
STAGES = ("construct", "transport", "apply", "finalize")
_STAGE_TIMINGS = {
    "construct": "construct_s",
    "transport": "transport_s",
    "apply": "apply_s",
    "finalize": "finalization_s",
}
ADMISSION_RESULTS = ("injected", "unchanged", "denied", "invalid")

BUILD_INFO = add_build_info(REGISTRY, "operator")

TRANSITIONS = Counter(
    "kuberefit_operator_transitions_total",
    "Finished transitions by outcome (committed, rejected, conflict, aborted).",
    [*_POLICY, "outcome"],
)
ATTEMPTS = Counter(
    "kuberefit_operator_attempts_total", "Attempts by mode (mixed, overwrite).", [*_POLICY, "mode"]
)
LATENCY = Histogram(
    "kuberefit_operator_transition_latency_seconds",
    "Committed transitions: first producer start to last baseline update.",
    _POLICY,
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
)
STAGE_SECONDS = Histogram(
    "kuberefit_operator_transition_stage_seconds",
    "Committed transitions by stage: construct, transport, apply, finalize.",
    [*_POLICY, "stage"],
    buckets=SECONDS_BUCKETS,
)
LAST_COMMIT = Gauge(
    "kuberefit_operator_last_commit_timestamp_seconds",
    "Unix time of the last transition this operator committed (0: none since start).",
    _POLICY,
)
WIRE_BYTES = Counter(
    "kuberefit_operator_wire_bytes_total", "Payload bytes sent by committed transitions.", _POLICY
)
CHANGED_FRACTION = Gauge(
    "kuberefit_operator_changed_fraction",
    "Changed elements / total elements of the last committed transition.",
    _POLICY,
)
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
COMMITTED_VERSION = Gauge(
    "kuberefit_operator_committed_version", "The policy's committed version.", _POLICY
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
    TRANSITIONS,
    ATTEMPTS,
    LATENCY,
    STAGE_SECONDS,
    LAST_COMMIT,
    WIRE_BYTES,
    CHANGED_FRACTION,
    TAKEOVERS,
    RESTORES,
    COMMITTED_VERSION,
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


def stage_seconds(result: TransitionResult) -> dict[str, float]:
    """The stage times of a committed transition (those its progress recorded)."""
    timings = result.progress.timings if result.progress is not None else {}
    return {stage: timings[key] for stage, key in _STAGE_TIMINGS.items() if key in timings}


def attempt_outcomes(result: TransitionResult) -> list[tuple[str, str]]:
    """(mode, outcome) of each attempt of a finished transition: every attempt but the last
    failed; the last one ended as the transition did (an abort: failed)."""
    if not result.modes:
        return []
    last = result.outcome if result.outcome in ATTEMPT_OUTCOMES else "failed"
    out: list[tuple[str, str]] = [(m, "failed") for m in result.modes[:-1]]
    return [*out, (result.modes[-1], last)]


def preset_policy(namespace: str, policy: str) -> None:
    """Create a policy's labelled operator series at 0 (when its loop starts)."""
    labels = (namespace, policy)
    preset(TRANSITIONS, *((*labels, o) for o in (*OUTCOMES, "failed")))
    preset(ATTEMPTS, *((*labels, m) for m in MODES))
    preset(STAGE_SECONDS, *((*labels, s) for s in STAGES))
    for metric in (LATENCY, WIRE_BYTES, CHANGED_FRACTION, TAKEOVERS, RESTORES, LAST_COMMIT):
        metric.labels(*labels)
    preset(AUDITS, *((*labels, r) for r in ("verified", "mismatch", "incomplete")))


def forget_policy(namespace: str, policy: str) -> None:
    """Remove a deleted policy's series (every family labelled by policy)."""
    for metric in _PER_POLICY:
        for labels in list(metric._metrics):
            if labels[:2] == (namespace, policy):
                metric.remove(*labels)


class CoordinatorMetrics:
    """One coordinator process's metrics (`kuberefit coordinator serve`), on a registry of its
    own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self.build_info = add_build_info(reg, "coordinator")
        self.committed_version = Gauge(
            "kuberefit_coordinator_committed_version",
            "The policy's committed version, as the commit store holds it (-1: not read yet).",
            registry=reg,
        )
        self.committed_version.set(-1)
        self.last_commit = Gauge(
            "kuberefit_coordinator_last_commit_timestamp_seconds",
            "Unix time of the last transition this process committed (0: none since start).",
            registry=reg,
        )
        self.transitions = Counter(
            "kuberefit_coordinator_transitions",
            "Finished transitions by outcome (committed, rejected, conflict, aborted).",
            ["outcome"],
            registry=reg,
        )
        preset(self.transitions, *OUTCOMES)
        self.attempts = Counter(
            "kuberefit_coordinator_attempts",
            "Attempts by mode (mixed, overwrite) and outcome (committed, failed, rejected, "
            "conflict).",
            ["mode", "outcome"],
            registry=reg,
        )
        preset(self.attempts, *((m, o) for m in MODES for o in ATTEMPT_OUTCOMES))
        self.latency = Histogram(
            "kuberefit_coordinator_transition_latency_seconds",
            "Committed transitions: first producer start to last baseline update.",
            registry=reg,
            buckets=SECONDS_BUCKETS,
        )
        self.stages = Histogram(
            "kuberefit_coordinator_transition_stage_seconds",
            "Committed transitions by stage: construct (slowest producer's delta construction "
            "and encoding), transport (its sending), apply (slowest receiver's applier calls "
            "and sync), finalize (flush acknowledged to the last baseline update).",
            ["stage"],
            registry=reg,
            buckets=SECONDS_BUCKETS,
        )
        preset(self.stages, *STAGES)
        self.wire_bytes = Counter(
            "kuberefit_coordinator_wire_bytes",
            "Payload bytes the producers sent in committed transitions.",
            registry=reg,
        )
        self.changed_fraction = Gauge(
            "kuberefit_coordinator_changed_fraction",
            "Changed elements / total elements of the last committed transition.",
            registry=reg,
        )
        self.changed_fractions = Histogram(
            "kuberefit_coordinator_transition_changed_fraction",
            "Changed elements / total elements, per committed transition.",
            registry=reg,
            buckets=FRACTION_BUCKETS,
        )

    def record(self, result: TransitionResult) -> None:
        """Count a finished transition."""
        self.transitions.labels(result.outcome).inc()
        for mode, outcome in attempt_outcomes(result):
            self.attempts.labels(mode, outcome).inc()
        if result.outcome != "committed":
            return
        self.committed_version.set(result.version)
        self.last_commit.set(time.time())
        self.latency.observe(result.latency_s)
        for stage, seconds in stage_seconds(result).items():
            self.stages.labels(stage).observe(seconds)
        p = result.progress
        if p is not None:
            self.wire_bytes.inc(p.wire_bytes)
            if p.total_elements:
                fraction = p.changed_elements / p.total_elements
                self.changed_fraction.set(fraction)
                self.changed_fractions.observe(fraction)
