"""The one recorder of transition metrics, for the operator and the standalone coordinator.

Both export the same families under their own prefix (`kuberefit_operator_…` on the global
registry, labelled `namespace` and `policy`; `kuberefit_coordinator_…` on a process's own
registry, unlabelled: a process coordinates one policy), with the same suffixes, label names,
help texts and buckets, because both record through `TransitionMetrics.record`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from refit_operator.transition_types import (
    ATTEMPT_OUTCOMES,
    MODES,
    OUTCOMES,
    STAGES,
    TransitionResult,
)
from refit_protocol.kit.metrics import FRACTION_BUCKETS, SECONDS_BUCKETS, preset


class TransitionMetrics:
    """Transition families named `kuberefit_{component}_…`, each labelled first by `labels`
    (the scope's label names: none for one coordinator process, namespace and policy in the
    operator)."""

    def __init__(
        self, registry: CollectorRegistry, component: str, labels: Sequence[str] = ()
    ) -> None:
        scope = list(labels)
        prefix = f"kuberefit_{component}_"
        self.committed_version = Gauge(
            prefix + "committed_version",
            "The policy's committed version, as the commit store holds it (-1: not read yet).",
            scope,
            registry=registry,
        )
        self.last_commit = Gauge(
            prefix + "last_commit_timestamp_seconds",
            "Unix time of the last transition committed here (0: none since start).",
            scope,
            registry=registry,
        )
        self.transitions = Counter(
            prefix + "transitions",
            "Finished transitions by outcome (committed, rejected, conflict, aborted; the "
            "operator also counts failed: its coordinator raised).",
            [*scope, "outcome"],
            registry=registry,
        )
        self.attempts = Counter(
            prefix + "attempts",
            "Attempts by mode (mixed, overwrite) and outcome (committed, failed, rejected, "
            "conflict).",
            [*scope, "mode", "outcome"],
            registry=registry,
        )
        self.latency = Histogram(
            prefix + "transition_latency_seconds",
            "Committed transitions: first producer start to last baseline update.",
            scope,
            registry=registry,
            buckets=SECONDS_BUCKETS,
        )
        self.stages = Histogram(
            prefix + "transition_stage_seconds",
            "Committed transitions by stage: construct (slowest producer's delta construction "
            "and encoding), transport (its sending), apply (slowest receiver's applier calls "
            "and sync), finalize (flush acknowledged to the last baseline update).",
            [*scope, "stage"],
            registry=registry,
            buckets=SECONDS_BUCKETS,
        )
        self.wire_bytes = Counter(
            prefix + "wire_bytes",
            "Payload bytes the producers sent in committed transitions.",
            scope,
            registry=registry,
        )
        self.changed_fraction = Gauge(
            prefix + "changed_fraction",
            "Changed elements / total elements of the last committed transition.",
            scope,
            registry=registry,
        )
        self.changed_fractions = Histogram(
            prefix + "transition_changed_fraction",
            "Changed elements / total elements, per committed transition.",
            scope,
            registry=registry,
            buckets=FRACTION_BUCKETS,
        )
        self.families: tuple[MetricWrapperBase, ...] = (
            self.committed_version,
            self.last_commit,
            self.transitions,
            self.attempts,
            self.latency,
            self.stages,
            self.wire_bytes,
            self.changed_fraction,
            self.changed_fractions,
        )

    def start(self, *scope: str) -> None:
        """Create a scope's series at 0. The committed version appears with its first read
        (`committed`): a standby operator replica never reads it."""
        preset(self.transitions, *((*scope, o) for o in OUTCOMES))
        preset(self.attempts, *((*scope, m, o) for m in MODES for o in ATTEMPT_OUTCOMES))
        preset(self.stages, *((*scope, s) for s in STAGES))
        for metric in (self.latency, self.wire_bytes, self.changed_fraction):
            _child(metric, scope)
        _child(self.changed_fractions, scope)
        _child(self.last_commit, scope).set(0)

    def committed(self, version: int, *scope: str) -> None:
        """The commit store's record, as just read."""
        _child(self.committed_version, scope).set(version)

    def record(self, result: TransitionResult, *scope: str) -> None:
        """Count a finished transition."""
        self.transitions.labels(*scope, result.outcome).inc()
        for mode, outcome in result.attempt_outcomes():
            self.attempts.labels(*scope, mode, outcome).inc()
        if result.outcome != "committed":
            return
        self.committed(result.version, *scope)
        _child(self.last_commit, scope).set(time.time())
        _child(self.latency, scope).observe(result.latency_s)
        for stage, seconds in result.stage_seconds().items():
            self.stages.labels(*scope, stage).observe(seconds)
        p = result.progress
        if p is not None:
            _child(self.wire_bytes, scope).inc(p.wire_bytes)
            if p.total_elements:
                fraction = p.changed_elements / p.total_elements
                _child(self.changed_fraction, scope).set(fraction)
                _child(self.changed_fractions, scope).observe(fraction)

    def forget(self, *scope: str) -> None:
        """Remove a scope's series (a deleted policy's)."""
        forget(self.families, scope)


def forget(families: Sequence[MetricWrapperBase], scope: Sequence[str]) -> None:
    """Remove every series of `families` whose first labels are `scope`."""
    n = len(scope)
    for metric in families:
        for labels in list(metric._metrics):
            if labels[:n] == tuple(scope):
                metric.remove(*labels)


def _child(metric: MetricWrapperBase, scope: Sequence[str]) -> Any:
    """The series of `scope` (the metric itself when it has no labels)."""
    return metric.labels(*scope) if scope else metric
