"""Prometheus metrics of one trainer sidecar's producer (its own registry, served on its
`/metrics`). Names follow `refit_protocol.kit.metrics`: `_total` counters, units in names, no
`_created` series, labelled series created at 0."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from refit_protocol.kit.metrics import FRACTION_BUCKETS, SECONDS_BUCKETS, add_build_info, preset
from refit_sidecar.pipeline.metrics import STAGES, PipelineMetrics

#: How an attempt ended on this producer: every payload sent and acknowledged (sent), the
#: pipeline or transport failed or was stopped (failed), or `start` was refused (refused: no
#: candidate of the plan's version).
ATTEMPT_OUTCOMES = ("sent", "failed", "refused")
MODES = ("mixed", "overwrite")
PURPOSES = ("initial", "next")


class ProducerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self.build_info = add_build_info(reg, "producer")
        self.attempts = Counter(
            "kuberefit_producer_attempts",
            "Attempts by mode and outcome (sent, failed, refused).",
            ["mode", "outcome"],
            registry=reg,
        )
        preset(self.attempts, *((m, o) for m in MODES for o in ATTEMPT_OUTCOMES))
        self.wire_bytes = Counter(
            "kuberefit_producer_wire_bytes",
            "Payload bytes this producer sent (compressed, as on the wire), by attempts that "
            "sent every payload.",
            registry=reg,
        )
        self.payloads = Counter(
            "kuberefit_producer_payloads", "Payloads sent by attempts that sent all.", registry=reg
        )
        self.changed_fraction = Histogram(
            "kuberefit_producer_changed_fraction",
            "Per attempt that sent every payload: changed elements / compared elements of this "
            "producer's share.",
            registry=reg,
            buckets=FRACTION_BUCKETS,
        )
        self.last_changed_fraction = Gauge(
            "kuberefit_producer_last_changed_fraction",
            "Changed / compared elements of the last attempt that sent every payload.",
            registry=reg,
        )
        self.attempt_seconds = Histogram(
            "kuberefit_producer_attempt_seconds",
            "Wall time of an attempt's pipeline on this producer: first chunk in to last "
            "payload acknowledged (delta construction, encoding and sending overlap).",
            registry=reg,
            buckets=SECONDS_BUCKETS,
        )
        self.stage_seconds = Histogram(
            "kuberefit_producer_stage_seconds",
            "Per attempt, busy time of each pipeline stage: intake (chunks in), compare (delta "
            "construction), coalesce, compress (encoding), send.",
            ["stage"],
            registry=reg,
            buckets=SECONDS_BUCKETS,
        )
        preset(self.stage_seconds, *STAGES)
        self.candidates = Counter(
            "kuberefit_producer_candidates_staged",
            "Exports the trainer handed over and this sidecar staged, by purpose (initial: "
            "the first export, which builds the baseline; next: a candidate version).",
            ["purpose"],
            registry=reg,
        )
        preset(self.candidates, *PURPOSES)
        self.staged_bytes = Counter(
            "kuberefit_producer_staged_bytes",
            "Bytes of this producer's owned chunks staged from the trainer's exports.",
            registry=reg,
        )
        self.baseline_version = Gauge(
            "kuberefit_producer_baseline_version",
            "Committed version whose bits the source baseline holds (-1: no baseline yet).",
            registry=reg,
        )
        self.baseline_version.set(-1)
        self.candidate_version = Gauge(
            "kuberefit_producer_candidate_version",
            "Version of the staged candidate (-1: none).",
            registry=reg,
        )
        self.candidate_version.set(-1)
        self.last_commit_time = Gauge(
            "kuberefit_producer_last_commit_timestamp_seconds",
            "Unix time the baseline last took a committed version (0: not since start).",
            registry=reg,
        )
        self.http = Counter(
            "kuberefit_producer_http_requests",
            "Control-plane requests by route and HTTP status (401: a missing or wrong bearer "
            "token).",
            ["path", "code"],
            registry=reg,
        )

    def follow(
        self, baseline_version: Callable[[], float], candidate_version: Callable[[], float]
    ) -> None:
        """Read the version gauges from the service at each scrape."""
        self.baseline_version.set_function(baseline_version)
        self.candidate_version.set_function(candidate_version)

    def sent(self, mode: str, m: PipelineMetrics) -> None:
        """An attempt sent every payload."""
        self.attempts.labels(mode, "sent").inc()
        self.wire_bytes.inc(m.payload_bytes)
        self.payloads.inc(m.payloads)
        if m.total_elements:
            self.changed_fraction.observe(m.change_rate)
            self.last_changed_fraction.set(m.change_rate)
        self.attempt_seconds.observe(m.wall_s)
        for stage, stats in m.stages.items():
            self.stage_seconds.labels(stage).observe(stats.busy_s)

    def preset_routes(self, paths: list[str]) -> None:
        """Create the refused-token series of every route (`code="401"`) at 0."""
        preset(self.http, *((p, "401") for p in paths))
