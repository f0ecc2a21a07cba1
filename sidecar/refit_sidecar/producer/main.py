"""The trainer sidecar as a process: `kuberefit producer serve --config FILE`
(or `python -m refit_sidecar.producer --config FILE`, the same command).

It serves the producer's control plane (`producer.http`: the coordinator's calls and the
trainer's candidate handoff), keeps the source baseline in `baseline.directory`, takes the
trainer's chunk files from the shared-memory inbox (`staging.inbox`), and streams each attempt
over the ZeroMQ relay tree whose root the coordinator names in the attempt plan. The baseline
is built from the trainer's first export (`Publisher.initialize`): no dense sync at start.
`build` assembles the same process for tools that drive it differently (the refit bench).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from refit_protocol.commit import CommitRecord
from refit_protocol.errors import listen_error
from refit_protocol.keys import payload_mac_key
from refit_protocol.kit.auth import open_ring, require_token_or_loopback
from refit_protocol.kit.cli import mark_started
from refit_protocol.kit.config_files import ConfigPath
from refit_protocol.kit.logs import configure_logging, log_settings
from refit_protocol.kit.tokens import DEFAULT_ROTATION_GRACE_S, TokenRing
from refit_sidecar.baseline.config import BaselineConfig
from refit_sidecar.baseline.sizing import resolve_sizes
from refit_sidecar.baseline.source import SourceBaseline
from refit_sidecar.pipeline.config import PipelineConfig
from refit_sidecar.producer.http import create_producer_app, producer_status
from refit_sidecar.producer.readiness import reference_problem, startup_problem
from refit_sidecar.producer.resume import checkpoint_nbytes
from refit_sidecar.producer.service import ProducerObserver, ProducerService
from refit_sidecar.producer.staging import StagingConfig
from refit_sidecar.producer.trainer_exit import ExitWithTrainer, wait_for_trainer_exit
from refit_sidecar.transport import SenderSettings
from refit_sidecar.transport.base import SendObserver
from refit_sidecar.transport.relay.transport import RelayTransportConfig
from refit_sidecar.transport.selector import TransportSelector

log = structlog.get_logger("kuberefit.producer")


class ProducerProcessConfig(BaseModel):
    """One trainer sidecar (one producer of `producers`)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Control-plane bind address.")
    port: int = Field(8471, ge=1, le=65535, description="Control-plane port.")
    token: SecretStr | None = Field(None, description="Bearer token (control plane and relay).")
    token_file: ConfigPath | None = Field(
        None,
        description="File holding the token (a mounted Secret: followed, so a rotated token is "
        "taken without a restart).",
    )
    token_rotation_grace_s: float = Field(
        DEFAULT_ROTATION_GRACE_S,
        gt=0,
        description="After the token file changes: seconds the previous token is still sent "
        "(and twice that, accepted); longer than the Secret's propagation to every pod.",
    )
    allow_insecure: bool = Field(
        False,
        description="Serve without a token on a non-loopback address (never in production).",
    )
    producer: int = Field(0, ge=0, description="This producer's index.")
    producers: int = Field(1, ge=1, description="Number of producers (chunk ownership).")
    committed_version: int = Field(
        0, ge=0, description="The committed version the rollout holds when this sidecar starts."
    )
    committed_baseline_id: str = Field(
        "g-initial", description="Its baseline id (the commit record's)."
    )
    baseline: BaselineConfig = Field(
        default_factory=BaselineConfig, description="The source baseline and export chunking."
    )
    staging: StagingConfig | None = Field(
        description="The trainer's shared-memory inbox (None only for tools that stage "
        "candidates in process, like the refit bench)."
    )
    pipeline: PipelineConfig = Field(
        default_factory=PipelineConfig,
        description="Compare, encode and send stages (bounded; they bound its memory).",
    )
    exit_with_trainer: ExitWithTrainer = Field(
        "no",
        description="Exit (code 0) after the trainer process, so a Job's pod completes where "
        "the sidecar is a regular container: `when_gone` once the trainer is gone however it "
        "ended (restartPolicy Never), `when_done` once it is gone after closing its publisher "
        "(OnFailure: a crashed trainer is restarted), then once nothing it published is "
        "pending. Injection sets it for such pods where the API server has no native sidecars.",
    )
    exit_grace_s: float = Field(
        600.0,
        gt=0,
        description="With exit_with_trainer: how long a version the trainer published may still "
        "be pending (staged, or its transition running) before the sidecar exits anyway.",
    )
    transport: SenderSettings = Field(
        default_factory=lambda: RelayTransportConfig(root="", stop_timeout_s=30.0),
        description="Transport settings; `kind` picks the transport (`zmq`, the default: the "
        "relay tree, whose `root` is the fallback when an attempt plan names no tree, empty: "
        "such plans fail; `s3`: object storage, announced to each plan's `receiver_urls`). "
        "`token` and `producer` are this process's.",
    )


def mac_key_of(tokens: TokenRing) -> bytes | None:
    """The key payloads are sealed with now: the sending token's (None without a token)."""
    token = tokens.sending()
    return payload_mac_key(token) if token else None


@dataclass
class ProducerProcess:
    """The assembled sidecar: baseline, service and its per-attempt transports."""

    baseline: SourceBaseline
    service: ProducerService
    transports: TransportSelector
    tokens: TokenRing

    def close(self) -> None:
        self.transports.close()
        self.service.close_staging()
        self.baseline.close()


def build(
    config: ProducerProcessConfig,
    *,
    observer: ProducerObserver | None = None,
    send_observer: SendObserver | None = None,
    total_bytes: int | None = None,
) -> ProducerProcess:
    """The sidecar's parts, not yet serving (refuses a non-loopback bind without a token).

    `total_bytes`: the checkpoint's size H, which `auto` chunk and bucket sizes derive from;
    by default read from `staging.reference_checkpoint` (the same on every producer)."""
    tokens = open_ring(config.token, config.token_file, grace_s=config.token_rotation_grace_s)
    require_token_or_loopback(
        f"producer {config.producer}",
        [config.host],
        tokens.sending(),
        allow_insecure=config.allow_insecure,
    )
    if total_bytes is None and config.staging is not None:
        reference = config.staging.reference_checkpoint
        problem = None if reference is None else reference_problem(reference)
        if reference is not None and problem is None:
            total_bytes = checkpoint_nbytes(reference)
        elif problem is not None:  # `serve` refuses to start on it; say why sizes fell back
            log.warning("producer.sizes_without_reference", problem=problem)
    baseline = SourceBaseline(
        producer=config.producer,
        producers=config.producers,
        config=config.baseline,
        total_bytes=total_bytes,
    )
    sizes = resolve_sizes(
        config.baseline.export_chunk_bytes,
        config.pipeline.bucket_bytes,
        total_bytes=total_bytes,
        producers=config.producers,
        split=config.pipeline.split_bytes,
    )
    log.info(
        "producer.sizes",
        producer=config.producer,
        export_chunk_bytes=sizes.chunk_bytes,
        bucket_bytes=sizes.bucket_bytes,
        split_bytes=sizes.split_bytes,
        rule=sizes.rule,
    )
    template = config.transport.model_copy(update={"producer": config.producer})
    transports = TransportSelector(template, observer=send_observer, tokens=tokens)
    service = ProducerService(
        baseline,
        transports,
        config.pipeline,
        committed=CommitRecord(config.committed_version, config.committed_baseline_id),
        staging=config.staging,
        observer=observer,
        mac_key=lambda: mac_key_of(tokens),  # the sending token's, when an attempt starts
        medium=transports,
    )
    transports.problem()  # the first check of the medium starts now, in the background
    return ProducerProcess(baseline, service, transports, tokens)


async def run_app(
    app: web.Application,
    host: str,
    port: int,
    *,
    on_close: Callable[[], None],
    settings: BaseModel | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve `app` until SIGTERM/SIGINT (or `stop` is set), then clean up and call `on_close`;
    once listening, log the `settings` in effect."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            raise listen_error("host/port", f"{host}:{port}", exc) from exc
        log.info("producer.serving", host=host, port=port)
        mark_started()
        if settings is not None:
            log_settings("producer", settings)
        await stop.wait()
    finally:
        await runner.cleanup()
        on_close()


async def serve(config: ProducerProcessConfig) -> None:
    """Serve until SIGTERM/SIGINT."""
    if config.staging is None:
        raise ValueError("a trainer sidecar needs `staging` (the trainer's inbox)")
    problem = startup_problem(config.staging)  # the inbox is `/readyz`'s (producer.readiness)
    if problem is not None:
        raise ValueError(problem)
    process = await asyncio.to_thread(build, config)
    app = create_producer_app(process.service, token=process.tokens)
    stop = asyncio.Event()
    inbox = Path(config.staging.inbox)

    async def exit_with_trainer() -> None:
        reason = await wait_for_trainer_exit(
            inbox,
            config.exit_with_trainer,
            lambda: producer_status(process.service),
            grace_s=config.exit_grace_s,
        )
        log.info("producer.exiting", reason=reason)
        stop.set()

    watcher = asyncio.create_task(exit_with_trainer())
    try:
        await run_app(
            app, config.host, config.port, on_close=process.close, settings=config, stop=stop
        )
    finally:
        watcher.cancel()


def serve_forever(config: ProducerProcessConfig) -> None:
    """Run the sidecar until SIGTERM (`kuberefit producer serve`)."""
    configure_logging()
    asyncio.run(serve(config))
