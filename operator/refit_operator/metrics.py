"""The operator's Prometheus metrics (served on `kuberefit operator --metrics-bind`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_POLICY = ["namespace", "policy"]

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
ADMISSIONS = Counter(
    "kuberefit_webhook_admissions_total",
    "Pod admissions by result: injected, unchanged (not opted in, or injected already), "
    "denied (opted in but cannot be injected as written), invalid (not a Pod review).",
    ["result"],
)
