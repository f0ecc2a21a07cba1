"""The coordinator as a long-running process (`kuberefit coordinator serve --config FILE`).

It holds no state of its own: everything it needs to continue lives in the commit store (the
commit record and the active attempt), in the producers (candidate, pending delta) and in the
receivers. So a coordinator can be SIGKILLed at any point and a new one takes over: it acquires
the store (a newer epoch fences the old one), finishes a transition whose commit took effect
(`Coordinator.recover`), or takes over an admitted one in overwrite mode (Algorithm B.2), and
then runs a transition whenever every producer has staged the next version.

It refuses to start (one line) when the committed version's checkpoint is missing (version 0's
at the first start: joining receivers are restored from it). With `metrics_port` it serves
`/healthz`, `/readyz` and `/metrics` (`coordinator_http`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp
import structlog
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator

from refit_operator.commit_store.sqlite import SqliteCommitStore
from refit_operator.coordinator import Coordinator
from refit_operator.coordinator_http import (
    CoordinatorReadiness,
    checkpoint_problem,
    coordinator_app,
    serve_http,
)
from refit_operator.http_membership import HttpMembership, NodeEndpoint
from refit_operator.metrics import CoordinatorMetrics
from refit_operator.ports import TransitionProgress
from refit_operator.producer_client import HttpProducerClient, all_staged
from refit_operator.transition_types import CoordinatorConfig, TransitionResult
from refit_protocol.commit import CommitRecord
from refit_protocol.errors import ConfigurationError, PeerAuthenticationError
from refit_protocol.kit.auth import open_ring
from refit_protocol.kit.cli import mark_started
from refit_protocol.kit.config_files import ConfigPath, resolve_relative
from refit_protocol.kit.tokens import TokenRing

log = structlog.get_logger("kuberefit.coordinator_service")

#: Exit codes of `serve` (and of `kuberefit coordinator serve`).
EXIT_DONE, EXIT_ABORTED, EXIT_CONFLICT = 0, 3, 4


class NodeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Node name (as its receiver reports it).", examples=["rollout-0"])
    url: str = Field(
        description="Receiver control-plane URL, e.g. http://10.0.0.5:8470.",
        examples=["http://127.0.0.1:8470"],
    )
    relay_endpoint: str = Field("", description="Relay-tree endpoint (ZeroMQ), if any.")
    relay_mac_endpoint: str = Field(
        "",
        description="The node's MAC-only relay endpoint (its relay's `mac_bind`), if any: the "
        "other relays forward to it over a plain, tagged link (docs/security.md).",
    )


class CoordinatorServiceConfig(BaseModel):
    """Everything one coordinator process needs (one policy, static membership)."""

    model_config = ConfigDict(extra="forbid")

    policy: str = Field(description="Policy name (the commit record's key).", examples=["policy-a"])
    name: str | None = Field(None, description="This coordinator's name (default: random).")
    store_path: ConfigPath = Field(
        description="SQLite commit store file (shared by every coordinator).",
        examples=["commits.db"],
    )
    initial_baseline_id: str = Field(
        "g-initial", description="Baseline id of version 0 if the store is new."
    )
    producers: list[str] = Field(
        description="Producer control URLs, in producer-index order.",
        examples=[["http://127.0.0.1:8471"]],
    )
    nodes: list[NodeConfig] = Field(
        description="Rollout nodes (receivers).",
        examples=[
            [
                {
                    "name": "rollout-0",
                    "url": "http://127.0.0.1:8470",
                    "relay_endpoint": "tcp://127.0.0.1:5701",
                }
            ]
        ],
    )
    token: SecretStr | None = Field(None, description="Bearer token of every control plane.")
    token_file: ConfigPath | None = Field(None, description="File holding the token.")
    checkpoint_template: str = Field(
        description="Where committed version N's checkpoint lies, with {version}, e.g. "
        "/ckpt/v{version}; joining receivers restore from it. Version 0's must exist at "
        "start. A relative template is relative to the settings file.",
        examples=["checkpoints/v{version}"],
    )
    until_version: int | None = Field(
        None, ge=1, description="Exit after this version is committed (default: run forever)."
    )
    poll_s: float = Field(0.2, gt=0, description="How often to look for a staged candidate.")
    rejected_backoff_s: float = Field(
        5.0,
        gt=0,
        description="Wait after a rejected transition (a receiver not on the committed version) "
        "before trying again; the next try restores such receivers first.",
    )
    progress_file: ConfigPath | None = Field(
        None, description="Append every progress update and result as a JSON line here."
    )
    metrics_host: str = Field(
        "127.0.0.1",
        description="Bind address of /healthz, /readyz and /metrics (beyond loopback only with "
        "a token: /metrics requires it, the probes do not).",
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Port of /healthz, /readyz and /metrics. None (the default): no HTTP "
        "server; 0: any free port (logged as coordinator.http).",
    )
    coordinator: CoordinatorConfig = Field(
        default_factory=CoordinatorConfig,
        description="How transitions run (the RefitPolicy spec's settings and defaults).",
    )

    @field_validator("checkpoint_template")
    @classmethod
    def _relative_to_file(cls, value: str, info: ValidationInfo) -> str:
        return str(resolve_relative(Path(value), info))

    def bearer(self) -> TokenRing:
        """The token: `token`, else `token_file` (followed across rotations), else
        $KUBEREFIT_TOKEN (as every sidecar)."""
        return open_ring(self.token, self.token_file)


class JsonLinesSink:
    """ProgressSink that appends each update as one JSON line (and logs it)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    async def update(self, progress: TransitionProgress) -> None:
        self.write({"event": "progress", **asdict(progress)})

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        with self.path.open("a") as fh:
            fh.write(json.dumps({"time": time.time(), **record}, default=str) + "\n")
            fh.flush()


async def serve(config: CoordinatorServiceConfig) -> int:
    """Run transitions until `until_version` is committed (or forever); returns an exit code.
    A sidecar refusing the coordinator's token is a configuration error (one line, exit 2),
    not an absent node to wait for."""
    try:
        return await _serve(config)
    except PeerAuthenticationError as exc:
        raise ConfigurationError(
            f"{exc} - the coordinator's token differs from that sidecar's: give both the same "
            "token (token, token_file or $KUBEREFIT_TOKEN)"
        ) from exc


async def _serve(config: CoordinatorServiceConfig) -> int:
    """Start-up checks (the committed version's checkpoint must be there: ValueError, one
    line), the optional HTTP surface (`coordinator_http`), then the transitions."""
    token = config.bearer()
    store = SqliteCommitStore(config.store_path, config.policy)
    await store.initialize(CommitRecord(0, config.initial_baseline_id))
    committed = (await store.read()).record.version
    problem = checkpoint_problem(config.checkpoint_template.format(version=committed), committed)
    if problem is not None:
        raise ValueError(problem)
    metrics = CoordinatorMetrics()
    metrics.committed(committed)
    readiness = CoordinatorReadiness(
        store, lambda v: config.checkpoint_template.format(version=v), str(config.store_path)
    )
    http = None
    if config.metrics_port is not None:
        app = coordinator_app(metrics, readiness, token)
        http = await serve_http(app, config.metrics_host, config.metrics_port, token)
    try:
        return await _run(config, store, token, metrics, readiness)
    finally:
        if http is not None:
            await http.close()


async def _run(
    config: CoordinatorServiceConfig,
    store: SqliteCommitStore,
    token: TokenRing,
    metrics: CoordinatorMetrics,
    readiness: CoordinatorReadiness,
) -> int:
    sink = JsonLinesSink(config.progress_file)
    async with aiohttp.ClientSession() as session:
        producers = [
            HttpProducerClient(i, url, token=token, session=session)
            for i, url in enumerate(config.producers)
        ]
        membership = HttpMembership(
            [
                NodeEndpoint(n.name, n.url, n.relay_endpoint, n.relay_mac_endpoint)
                for n in config.nodes
            ],
            session,
            token=token,
            checkpoint_of=lambda v: config.checkpoint_template.format(version=v),
        )
        coordinator = Coordinator(
            config.policy,
            store,
            producers,
            membership,
            sink,
            config.coordinator,
            name=config.name,
        )
        await coordinator.start()
        mark_started()  # from here, only a ConfigurationError is a one-line exit 2
        sink.write({"event": "started", "name": coordinator.name, "epoch": coordinator.epoch})
        await coordinator.recover()
        await membership.prewarm((await store.read()).record.version)
        readiness.active = f"{coordinator.name} coordinates at epoch {coordinator.epoch}"
        while True:
            kv = (await store.read()).record
            metrics.committed(kv.version)
            if config.until_version is not None and kv.version >= config.until_version:
                return EXIT_DONE
            if not await all_staged(producers, kv.version + 1):
                await asyncio.sleep(config.poll_s)
                continue
            result = await coordinator.run_transition(frozenset(membership.incompatible))
            _report(sink, result)
            metrics.record(result)
            if result.outcome == "rejected":
                await asyncio.sleep(config.rejected_backoff_s)
            if result.outcome == "aborted":
                return EXIT_ABORTED
            if result.outcome == "conflict":
                return EXIT_CONFLICT


def _report(sink: JsonLinesSink, result: TransitionResult) -> None:
    p = result.progress
    log.info("transition.done", **result.summary())
    sink.write(
        {
            "event": "result",
            "outcome": result.outcome,
            "version": result.version,
            "attempts": result.attempts,
            "modes": list(result.modes),
            "retired": list(result.retired),
            "message": result.message,
            "latency_s": result.latency_s,
            "finalization_s": result.finalization_s,
            "wire_bytes": p.wire_bytes if p else 0,
            "changed_elements": p.changed_elements if p else 0,
            "total_elements": p.total_elements if p else 0,
        }
    )
