"""The trainer sidecar as a process: `python -m refit_sidecar.producer.main --config FILE`.

It serves the producer's control plane (`producer_http`: the coordinator's calls and the
trainer's candidate handoff), keeps the source baseline in `baseline.directory`, takes the
trainer's chunk files from the shared-memory inbox (`staging.inbox`), and streams each attempt
over the ZeroMQ relay tree whose root the coordinator names in the attempt plan. The baseline
is built from the trainer's first export (`Publisher.initialize`): no dense sync at start.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path

import structlog
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from refit_protocol.auth import resolve_token
from refit_protocol.commit import CommitRecord
from refit_protocol.logs import configure_logging
from refit_protocol.producer_api import AttemptPlan
from refit_sidecar.baseline.source import BaselineConfig, SourceBaseline
from refit_sidecar.pipeline.config import PipelineConfig
from refit_sidecar.producer.http import create_producer_app
from refit_sidecar.producer.service import ProducerService
from refit_sidecar.producer.staging import StagingConfig
from refit_sidecar.transport.base import Transport
from refit_sidecar.transport.relay.transport import RelayTransport, RelayTransportConfig

log = structlog.get_logger("kuberefit.producer_main")


class ProducerProcessConfig(BaseModel):
    """One trainer sidecar (one producer of `producers`)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Control-plane bind address.")
    port: int = Field(8471, ge=1, le=65535, description="Control-plane port.")
    token: SecretStr | None = Field(None, description="Bearer token (control plane and relay).")
    token_file: Path | None = Field(None, description="File holding the token.")
    producer: int = Field(0, ge=0, description="This producer's index.")
    producers: int = Field(1, ge=1, description="Number of producers (chunk ownership).")
    committed_version: int = Field(
        0, ge=0, description="The committed version the rollout holds when this sidecar starts."
    )
    committed_baseline_id: str = Field(
        "g-initial", description="Its baseline id (the commit record's)."
    )
    baseline: BaselineConfig = Field(default_factory=BaselineConfig)
    staging: StagingConfig = Field(description="The trainer's shared-memory inbox.")
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    stop_timeout_s: float = Field(30.0, gt=0, description="Relay stop_and_wait timeout.")


async def serve(config: ProducerProcessConfig) -> None:
    """Serve until SIGTERM/SIGINT."""
    token = resolve_token(config.token, config.token_file)
    if token is None and config.host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError("refusing to serve beyond loopback without a token")
    baseline = SourceBaseline(
        producer=config.producer, producers=config.producers, config=config.baseline
    )
    transports: dict[str, RelayTransport] = {}

    def transport_for(plan: AttemptPlan) -> Transport:
        if not plan.relay_tree:
            raise ValueError(f"attempt {plan.attempt} names no relay tree")
        root = plan.relay_tree[0]
        if root not in transports:
            transports[root] = RelayTransport(
                RelayTransportConfig(
                    root=root,
                    token=token,
                    producer=config.producer,
                    stop_timeout_s=config.stop_timeout_s,
                )
            )
        return transports[root]

    service = ProducerService(
        baseline,
        transport_for,
        config.pipeline,
        committed=CommitRecord(config.committed_version, config.committed_baseline_id),
        staging=config.staging,
    )
    runner = web.AppRunner(create_producer_app(service, token=token))
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    log.info("producer.serving", port=config.port, producer=config.producer)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        for t in transports.values():
            t.close()
        service.close_staging()
        baseline.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m refit_sidecar.producer.main")
    parser.add_argument("--config", required=True, type=Path, help="ProducerProcessConfig JSON")
    args = parser.parse_args(argv)
    configure_logging()
    asyncio.run(serve(ProducerProcessConfig.model_validate_json(args.config.read_text())))


if __name__ == "__main__":
    main()
