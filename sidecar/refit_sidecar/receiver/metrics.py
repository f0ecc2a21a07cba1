"""Prometheus metrics of one receiver node (its own registry, so several nodes can share a
process in tests and /metrics shows exactly this node)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ReceiverMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self.payloads = Counter(
            "kuberefit_receiver_payloads",
            "Payload offers by outcome (staged, duplicate, wait, obsolete, unknown_attempt, "
            "rejected).",
            ["result"],
            registry=reg,
        )
        self.dropped = Counter(
            "kuberefit_receiver_payloads_dropped",
            "Payloads dropped: late ones of obsolete attempts, queued ones of replaced attempts.",
            ["reason"],
            registry=reg,
        )
        self.applied = Counter(
            "kuberefit_receiver_applied_payloads", "Payloads applied.", registry=reg
        )
        self.apply_seconds = Histogram(
            "kuberefit_receiver_apply_seconds",
            "Time of one applier call (a group of payloads).",
            registry=reg,
            buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120),
        )
        self.queue_depth = Gauge(
            "kuberefit_receiver_queue_depth", "Validated payloads waiting to apply.", registry=reg
        )
        self.staged_bytes = Gauge(
            "kuberefit_receiver_staged_compressed_bytes",
            "Compressed bytes held in host staging (async RL).",
            registry=reg,
        )
        self.held_version = Gauge(
            "kuberefit_receiver_held_version",
            "Version whose bits the node holds (-1: unknown).",
            registry=reg,
        )
        self.attempts = Counter(
            "kuberefit_receiver_attempts",
            "Attempts by outcome (prepared, rejected, flushed, failed, stopped).",
            ["outcome"],
            registry=reg,
        )
        self.http = Counter(
            "kuberefit_receiver_http_requests",
            "Control-plane requests.",
            ["path", "code"],
            registry=reg,
        )
        self.unauthorized = Counter(
            "kuberefit_receiver_http_unauthorized",
            "Control-plane requests refused for a missing or wrong bearer token.",
            registry=reg,
        )
