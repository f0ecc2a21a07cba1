"""The trainer side of `kuberefit bench refit`: one producer process in the trainer namespace.

`python -m refit_tools.bench.refit_producer --config producer.json` builds the synthetic
checkpoint, loads it as the file-backed source baseline, and serves the real producer (the
`ProducerService` with its pipeline and ZeroMQ transport) on the producer HTTP control plane the
coordinator calls. Bench-only routes under /v1/bench (same bearer token):

- `stage`: change injection, outside the timed window: a new candidate version with a uniform
  element change rate, handed to the producer as the trainer's export;
- `timings`: the timed window's ends as this process saw them (first `start` of the version's
  first attempt, end of its baseline update) and every payload's transport interval;
- `verify`: digests of the candidate's bits and of the baseline's committed bits;
- `reference`: the transport-only full-checkpoint reference: H bytes of overwrite payloads
  through the same transport to the same relay tree (built before the clock starts).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import structlog
import torch
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from refit_protocol.commit import CommitRecord
from refit_protocol.logs import configure_logging
from refit_protocol.producer_api import AttemptPlan, SentReport
from refit_sidecar.baseline.chunks import chunk_export
from refit_sidecar.baseline.source import BaselineConfig, SourceBaseline
from refit_sidecar.codec.records import Item, Op
from refit_sidecar.codec.wire import CODEC_VERSION, EncodedPayload, PayloadHeader, encode_payload
from refit_sidecar.fingerprint import named_tensors_digest
from refit_sidecar.pipeline.config import PipelineConfig
from refit_sidecar.producer.http import create_producer_app
from refit_sidecar.producer.service import ProducerService
from refit_sidecar.transport.base import SendInterval, Transport
from refit_sidecar.transport.relay.transport import RelayTransport, RelayTransportConfig
from refit_tools.bench.refit_workload import Workload, reference_plan
from refit_tools.bench.synthetic import perturb

log = structlog.get_logger("kuberefit.bench.refit")
INITIAL = CommitRecord(0, "g-initial")
Tensors = list[tuple[str, torch.Tensor]]
M = TypeVar("M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ProducerProcessConfig(BaseModel):
    """Everything the producer process needs; written by the driver as JSON."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field(default="0.0.0.0", description="HTTP bind address.")  # noqa: S104
    port: int = Field(ge=1, le=65535, description="HTTP port of the control plane.")
    token: SecretStr = Field(description="Bearer token (HTTP and ZeroMQ frames).")
    workdir: Path = Field(description="Where the file-backed baseline lives.")
    workload: Workload = Field(default_factory=Workload)
    relay_root: str = Field(description="Root relay endpoint when a plan names no relay tree.")
    export_chunk_bytes: int = Field(default=32 << 20, ge=1, description="Export chunk limit.")
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    transport: RelayTransportConfig | None = Field(
        default=None,
        description="Transport settings without root/token (filled in here); None: defaults.",
    )


@dataclass
class _Window:
    """One version's timed window as this producer saw it."""

    t_start: float | None = None
    t_baseline: float | None = None
    attempts: list[str] = field(default_factory=list)
    sent: SentReport | None = None


class TimedProducerService(ProducerService):
    """The real producer, with the two clock readings of the timed window around its calls."""

    def __init__(
        self,
        baseline: SourceBaseline,
        transport: Callable[[AttemptPlan], Transport],
        config: PipelineConfig,
    ) -> None:
        super().__init__(baseline, transport, config, committed=INITIAL)
        self.windows: dict[int, _Window] = {}

    async def start(self, plan: AttemptPlan) -> None:
        w = self.windows.setdefault(plan.target_version, _Window())
        if w.t_start is None:
            w.t_start = time.monotonic()  # t0: the owner begins delta construction
        w.attempts.append(plan.attempt)
        await super().start(plan)

    async def wait_sent(self, attempt: str) -> SentReport:
        report = await super().wait_sent(attempt)
        for w in self.windows.values():
            if attempt in w.attempts:
                w.sent = report
        return report

    async def update_baseline(self, attempt: str, record: CommitRecord) -> None:
        await super().update_baseline(attempt, record)
        w = self.windows.get(record.version)
        if w is not None and w.t_baseline is None:
            w.t_baseline = time.monotonic()  # t1: the owner finished its baseline update


class StageRequest(BaseModel):
    version: int = Field(ge=1)
    rate: float = Field(gt=0, lt=1)
    seed: int = Field(ge=0)


class VersionRequest(BaseModel):
    version: int = Field(ge=1)


class ReferenceRequest(BaseModel):
    attempt: str
    relay_root: str
    payload_bytes: int = Field(ge=1 << 10)


class ProducerBench:
    """The producer process's state: checkpoint versions, baseline, service, transports."""

    def __init__(self, cfg: ProducerProcessConfig) -> None:
        self.cfg = cfg
        t0 = time.perf_counter()
        self.committed: Tensors = list(cfg.workload.tensors())
        self.candidate: tuple[int, Tensors] | None = None
        self.baseline = SourceBaseline(
            producer=0,
            producers=1,
            config=BaselineConfig(directory=cfg.workdir, export_chunk_bytes=cfg.export_chunk_bytes),
        )
        self.baseline.load_initial(chunk_export(self.committed, cfg.export_chunk_bytes))
        self.intervals: list[SendInterval] = []
        self._lock = threading.Lock()
        self._transports: dict[str, RelayTransport] = {}
        self.service = TimedProducerService(self.baseline, self._transport_for, cfg.pipeline)
        log.info("bench.producer_ready", seconds=time.perf_counter() - t0)

    def _observe(self, interval: SendInterval) -> None:
        with self._lock:
            self.intervals.append(interval)

    def transport(self, root: str) -> RelayTransport:
        """One transport per root relay, shared by attempts and the reference."""
        with self._lock:
            if root not in self._transports:
                base = self.cfg.transport or RelayTransportConfig(root=root)
                config = base.model_copy(
                    update={"root": root, "token": self.cfg.token, "producer": 0}
                )
                self._transports[root] = RelayTransport(config, observer=self._observe)
            return self._transports[root]

    def _transport_for(self, plan: AttemptPlan) -> Transport:
        return self.transport(plan.relay_tree[0] if plan.relay_tree else self.cfg.relay_root)

    # -- bench routes --------------------------------------------------------------------------
    def stage(self, req: StageRequest) -> dict[str, object]:
        """Change injection (untimed): perturb the committed version into the next candidate."""
        if self.candidate is not None and self.service.committed.version == self.candidate[0]:
            self.committed = self.candidate[1]  # the last candidate was committed
        t0 = time.perf_counter()
        new, changed = perturb(self.committed, req.rate, seed=req.seed)
        self.candidate = (req.version, new)
        chunk = self.cfg.export_chunk_bytes
        self.service.stage_candidate(req.version, lambda: chunk_export(new, chunk))
        total = sum(t.numel() for _, t in new)
        return {
            "version": req.version,
            "changed_elements": changed,
            "total_elements": total,
            "seconds": time.perf_counter() - t0,
        }

    def timings(self, req: VersionRequest) -> dict[str, object]:
        w = self.service.windows.get(req.version)
        if w is None or w.t_start is None or w.t_baseline is None:
            raise ValueError(f"no complete timed window for v{req.version}")
        with self._lock:
            spans = [
                [i.submitted, i.settled, i.size, i.ok]
                for i in self.intervals
                if i.attempt in w.attempts
            ]
        sent = w.sent
        return {
            "t_start": w.t_start,
            "t_baseline": w.t_baseline,
            "attempts": w.attempts,
            "intervals": spans,
            "pipeline": dict(sent.timings) if sent else {},
        }

    def verify(self, req: VersionRequest) -> dict[str, object]:
        """Digests of the target bits (the candidate export) and of the committed baseline."""
        if self.candidate is None or self.candidate[0] != req.version:
            raise ValueError(f"v{req.version} is not the last candidate")
        target = named_tensors_digest(self.candidate[1])
        baseline = named_tensors_digest(
            (name, torch.from_numpy(np.array(bits)).view(t.dtype).reshape(t.shape))
            for name, t in self.candidate[1]
            for bits in [self.baseline.stored_bits(name)]
        )
        return {"target": target, "baseline": baseline}

    def reference(self, req: ReferenceRequest) -> dict[str, object]:
        """Send H bytes of incompressible overwrite payloads; time from the first send until
        the root relay acknowledged the last one (receivers' relay flushes time the rest)."""
        payloads = _reference_payloads(req.attempt, self.cfg.workload, req.payload_bytes)
        transport = self.transport(req.relay_root)
        t_start = time.monotonic()
        try:
            for p in payloads:
                transport.send(req.attempt, p)
            summary = transport.stop_and_wait(req.attempt)
            t_acked = time.monotonic()
        finally:
            transport.cleanup(req.attempt)
        return {
            "t_start": t_start,
            "t_acked": t_acked,
            "payloads": len(payloads),
            "wire_bytes": sum(p.size for p in payloads),
            "acknowledged": summary.payloads_acknowledged,
            "errors": list(summary.errors),
        }

    def close(self) -> None:
        for t in self._transports.values():
            t.close()
        self.baseline.close()


def _reference_payloads(
    attempt: str, workload: Workload, payload_bytes: int
) -> list[EncodedPayload]:
    """Every element of the checkpoint once, as overwrite runs with random (incompressible)
    values: a file transfer moves H bytes, and zstd would shrink real BF16 weights."""
    rng = np.random.default_rng(0)
    out = []
    for i, runs in enumerate(reference_plan(workload.metas(), payload_bytes)):
        items = []
        for meta, start, count in runs:
            values = torch.from_numpy(rng.integers(-(2**15), 2**15, size=count, dtype=np.int16))
            items.append(Item(meta, Op.OVERWRITE, start, None, values))
        out.append(encode_payload(PayloadHeader(CODEC_VERSION, attempt, 0, i, i), items))
    return out


def create_app(bench: ProducerBench) -> web.Application:
    """The producer's control plane plus the /v1/bench routes (all behind the token)."""
    app = create_producer_app(bench.service, token=bench.cfg.token.get_secret_value())

    def route(model: type[M], fn: Callable[[M], dict[str, object]]) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            req = model.model_validate_json(await request.read())
            return web.json_response(await asyncio.to_thread(fn, req))

        return handler

    app.router.add_post("/v1/bench/stage", route(StageRequest, bench.stage))
    app.router.add_post("/v1/bench/timings", route(VersionRequest, bench.timings))
    app.router.add_post("/v1/bench/verify", route(VersionRequest, bench.verify))
    app.router.add_post("/v1/bench/reference", route(ReferenceRequest, bench.reference))
    return app


async def serve(cfg: ProducerProcessConfig) -> None:
    """Build the state (before listening: healthy means ready), serve until SIGTERM/SIGINT."""
    bench = await asyncio.to_thread(ProducerBench, cfg)
    runner = web.AppRunner(create_app(bench), access_log=None, handle_signals=False)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await runner.setup()
        await web.TCPSite(runner, cfg.host, cfg.port).start()
        log.info("bench.producer_serving", port=cfg.port)
        await stop.wait()
    finally:
        await runner.cleanup()
        bench.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m refit_tools.bench.refit_producer")
    parser.add_argument("--config", type=Path, required=True, help="ProducerProcessConfig JSON.")
    args = parser.parse_args(argv)
    configure_logging()
    cfg = ProducerProcessConfig.model_validate_json(args.config.read_text())
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
