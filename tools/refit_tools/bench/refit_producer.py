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
  through the same transport to the same relay tree (built before the clock starts);
- `save`: the candidate as a servable HF directory (`--engine vllm`: what the reference vLLM
  server loads densely), after its transition.
"""

from __future__ import annotations

import argparse
import asyncio
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
from pydantic import BaseModel, ConfigDict, Field

from refit_protocol.commit import CommitRecord
from refit_protocol.kit.logs import configure_logging
from refit_protocol.producer_api import AttemptPlan, SentReport
from refit_sidecar.baseline.chunks import chunk_export
from refit_sidecar.codec.encode import encode_payload
from refit_sidecar.codec.records import Item, Op
from refit_sidecar.codec.wire import CODEC_VERSION, EncodedPayload, PayloadHeader
from refit_sidecar.fingerprint import named_tensors_digest
from refit_sidecar.producer.http import create_producer_app
from refit_sidecar.producer.main import ProducerProcessConfig, build, mac_key_of, run_app
from refit_sidecar.transport.base import SendInterval
from refit_tools.bench.refit_workload import Workload, reference_plan
from refit_tools.bench.synthetic import perturb

log = structlog.get_logger("kuberefit.bench.refit")
INITIAL = CommitRecord(0, "g-initial")
Tensors = list[tuple[str, torch.Tensor]]
M = TypeVar("M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RefitProducerConfig(BaseModel):
    """The bench's producer process: the product's own config plus the synthetic workload;
    written by the driver as JSON."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    producer: ProducerProcessConfig = Field(
        description="The trainer sidecar's settings (host, port, token, baseline, pipeline, "
        "transport with its fallback root); `staging` stays null: candidates are staged here."
    )
    workload: Workload = Field(default_factory=Workload)


@dataclass
class _Window:
    """One version's timed window as this producer saw it."""

    t_start: float | None = None
    t_baseline: float | None = None
    attempts: list[str] = field(default_factory=list)
    sent: SentReport | None = None


class TimedWindows:
    """`ProducerObserver`: the two clock readings of each version's timed window."""

    def __init__(self) -> None:
        self.windows: dict[int, _Window] = {}

    def started(self, plan: AttemptPlan) -> None:
        w = self.windows.setdefault(plan.target_version, _Window())
        if w.t_start is None:
            w.t_start = time.monotonic()  # t0: the owner begins delta construction
        w.attempts.append(plan.attempt)

    def sent(self, attempt: str, report: SentReport) -> None:
        for w in self.windows.values():
            if attempt in w.attempts:
                w.sent = report

    def baseline_updated(self, attempt: str, record: CommitRecord) -> None:
        w = self.windows.get(record.version)
        if w is not None and w.t_baseline is None:
            w.t_baseline = time.monotonic()  # t1: the owner finished its baseline update


class StageRequest(BaseModel):
    version: int = Field(ge=1)
    rate: float = Field(gt=0, lt=1)
    seed: int = Field(ge=0)


class VersionRequest(BaseModel):
    version: int = Field(ge=1)


class SaveRequest(BaseModel):
    version: int = Field(ge=1)
    directory: Path


class ReferenceRequest(BaseModel):
    attempt: str
    relay_root: str
    payload_bytes: int = Field(ge=1 << 10)


class ProducerBench:
    """The producer process's state: checkpoint versions, baseline, service, transports."""

    def __init__(self, cfg: RefitProducerConfig) -> None:
        self.cfg = cfg
        t0 = time.perf_counter()
        self.committed: Tensors = list(cfg.workload.tensors())
        self.candidate: tuple[int, Tensors] | None = None
        self.intervals: list[SendInterval] = []
        self._lock = threading.Lock()
        self.timed = TimedWindows()
        # The product's own sidecar, with the bench's clock readings and send intervals.
        self.process = build(
            cfg.producer,
            observer=self.timed,
            send_observer=self._observe,
            total_bytes=cfg.workload.nbytes,
        )
        self.service = self.process.service
        self.baseline = self.process.baseline
        self.chunk_bytes = self.baseline.chunk_bytes
        self.baseline.load_initial(chunk_export(self.committed, self.chunk_bytes))
        log.info("bench.producer_ready", seconds=time.perf_counter() - t0)

    def _observe(self, interval: SendInterval) -> None:
        with self._lock:
            self.intervals.append(interval)

    # -- bench routes --------------------------------------------------------------------------
    def stage(self, req: StageRequest) -> dict[str, object]:
        """Change injection (untimed): perturb the committed version into the next candidate."""
        if self.candidate is not None and self.service.committed.version == self.candidate[0]:
            self.committed = self.candidate[1]  # the last candidate was committed
        t0 = time.perf_counter()
        new, changed = perturb(self.committed, req.rate, seed=req.seed)
        self.candidate = (req.version, new)
        chunk = self.chunk_bytes
        self.service.stage_candidate(req.version, lambda: chunk_export(new, chunk))
        total = sum(t.numel() for _, t in new)
        return {
            "version": req.version,
            "changed_elements": changed,
            "total_elements": total,
            "seconds": time.perf_counter() - t0,
        }

    def timings(self, req: VersionRequest) -> dict[str, object]:
        w = self.timed.windows.get(req.version)
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

    def save(self, req: SaveRequest) -> dict[str, object]:
        """Write the candidate's tensors and the workload's config.json to `directory`."""
        from refit_tools.bench.refit_engines import write_version

        if self.candidate is None or self.candidate[0] != req.version:
            raise ValueError(f"v{req.version} is not the last candidate")
        t0 = time.perf_counter()
        write_version(self.cfg.workload, self.candidate[1], req.directory)
        return {"directory": str(req.directory), "seconds": time.perf_counter() - t0}

    def reference(self, req: ReferenceRequest) -> dict[str, object]:
        """Send H bytes of incompressible overwrite payloads; time from the first send until
        the root relay acknowledged the last one (receivers' relay flushes time the rest)."""
        key = mac_key_of(self.process.tokens)
        payloads = _reference_payloads(req.attempt, self.cfg.workload, req.payload_bytes, key)
        transport = self.process.transports.to(req.relay_root)
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
        self.process.close()


def _reference_payloads(
    attempt: str, workload: Workload, payload_bytes: int, mac_key: bytes | None
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
        header = PayloadHeader(CODEC_VERSION, attempt, 0, i, i)
        out.append(encode_payload(header, items, mac_key=mac_key))
    return out


def create_app(bench: ProducerBench) -> web.Application:
    """The producer's control plane plus the /v1/bench routes (all behind the token)."""
    app = create_producer_app(bench.service, token=bench.process.tokens)

    def route(model: type[M], fn: Callable[[M], dict[str, object]]) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            req = model.model_validate_json(await request.read())
            return web.json_response(await asyncio.to_thread(fn, req))

        return handler

    app.router.add_post("/v1/bench/stage", route(StageRequest, bench.stage))
    app.router.add_post("/v1/bench/timings", route(VersionRequest, bench.timings))
    app.router.add_post("/v1/bench/verify", route(VersionRequest, bench.verify))
    app.router.add_post("/v1/bench/reference", route(ReferenceRequest, bench.reference))
    app.router.add_post("/v1/bench/save", route(SaveRequest, bench.save))
    return app


async def serve(cfg: RefitProducerConfig) -> None:
    """Build the state (before listening: healthy means ready), serve until SIGTERM/SIGINT."""
    bench = await asyncio.to_thread(ProducerBench, cfg)
    await run_app(create_app(bench), cfg.producer.host, cfg.producer.port, on_close=bench.close)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m refit_tools.bench.refit_producer")
    parser.add_argument("--config", type=Path, required=True, help="RefitProducerConfig JSON.")
    args = parser.parse_args(argv)
    configure_logging()
    cfg = RefitProducerConfig.model_validate_json(args.config.read_text())
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
