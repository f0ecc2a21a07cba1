"""Prometheus metrics of one receiver node (its own registry, so several nodes can share a
process in tests and /metrics shows exactly this node). Names follow `refit_protocol.kit.metrics`:
`_total` counters, units in names, no `_created` series, labelled series created at 0."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from refit_protocol.kit.metrics import SECONDS_BUCKETS, add_build_info, preset

#: Labels known at start (each series exists at 0 before its first event).
PAYLOAD_RESULTS = ("staged", "duplicate", "wait", "obsolete", "unknown_attempt", "rejected")
DROP_REASONS = ("obsolete", "stopped", "replaced", "failed")
ATTEMPT_OUTCOMES = ("prepared", "rejected", "flushed", "failed", "stopped")
#: What a flushed attempt spent on this node (the receiver's stages of a refit).
STAGES = ("decode", "apply", "sync")


class ReceiverMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self.build_info = add_build_info(reg, "receiver")
        self.payloads = Counter(
            "kuberefit_receiver_payloads",
            "Payload offers by outcome (staged, duplicate, wait, obsolete, unknown_attempt, "
            "rejected).",
            ["result"],
            registry=reg,
        )
        preset(self.payloads, *PAYLOAD_RESULTS)
        self.dropped = Counter(
            "kuberefit_receiver_payloads_dropped",
            "Payloads dropped: late ones of obsolete or stopped attempts, queued ones of "
            "replaced or failed attempts.",
            ["reason"],
            registry=reg,
        )
        preset(self.dropped, *DROP_REASONS)
        self.applied = Counter(
            "kuberefit_receiver_applied_payloads", "Payloads applied.", registry=reg
        )
        self.apply_seconds = Histogram(
            "kuberefit_receiver_apply_seconds",
            "Time of one applier call (a group of payloads).",
            registry=reg,
            buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120),
        )
        self.stage_seconds = Histogram(
            "kuberefit_receiver_stage_seconds",
            "Per flushed attempt, time this node spent decoding payloads (decode), in applier "
            "calls (apply) and synchronizing the device at flush (sync).",
            ["stage"],
            registry=reg,
            buckets=SECONDS_BUCKETS,
        )
        preset(self.stage_seconds, *STAGES)
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
        self.gate_closed = Gauge(
            "kuberefit_receiver_gate_closed",
            "1 while the request gate is closed (the runtime serves no requests), else 0.",
            registry=reg,
        )
        self.gate_releases = Counter(
            "kuberefit_receiver_gate_releases",
            "Request gates reopened without a coordinator: an attempt that wrote nothing held "
            "the gate closed and no coordinator called for gate_release_s.",
            registry=reg,
        )
        self.last_commit_version = Gauge(
            "kuberefit_receiver_last_commit_version",
            "Version of the last commit notice or dense restore this node took (-1: none yet).",
            registry=reg,
        )
        self.last_commit_version.set(-1)
        self.last_commit_time = Gauge(
            "kuberefit_receiver_last_commit_timestamp_seconds",
            "Unix time of the last commit notice or dense restore this node took (0: none yet).",
            registry=reg,
        )
        self.attempts = Counter(
            "kuberefit_receiver_attempts",
            "Attempts by outcome (prepared, rejected, flushed, failed, stopped).",
            ["outcome"],
            registry=reg,
        )
        preset(self.attempts, *ATTEMPT_OUTCOMES)
        self.http = Counter(
            "kuberefit_receiver_http_requests",
            "Control-plane requests by route and HTTP status (401: a missing or wrong bearer "
            "token).",
            ["path", "code"],
            registry=reg,
        )

    def preset_routes(self, paths: list[str]) -> None:
        """Create the refused-token series of every route (`code="401"`) at 0."""
        preset(self.http, *((p, "401") for p in paths))
