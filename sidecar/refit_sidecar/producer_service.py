"""The trainer sidecar's producer: one owner's side of every attempt (paper steps 1-4, 7).

It holds the source baseline, the candidate export of the next version (handed over by the
trainer), the producer pipeline and a transport, and answers the coordinator's calls (the
`ProducerClient` port): start an attempt, report what was sent, stop, clean up, and update the
baseline once the commit record names the attempt's version. A mixed attempt compares the
candidate with the baseline; every overwrite retry is rebuilt from the pending delta, so the
trainer never exports the same version twice.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future

import structlog

from refit_operator.commit_store import CommitRecord
from refit_operator.ports import AttemptPlan, EndpointError, SentReport
from refit_sidecar.baseline.chunks import ExportChunk
from refit_sidecar.baseline.source import SourceBaseline
from refit_sidecar.codec.records import Mode
from refit_sidecar.pipeline.config import PipelineConfig
from refit_sidecar.pipeline.metrics import PipelineMetrics
from refit_sidecar.pipeline.producer import ProducerPipeline
from refit_sidecar.transport.base import Transport

log = structlog.get_logger("kuberefit.producer")

ExportFactory = Callable[[], Iterable[ExportChunk]]
TransportFactory = Callable[[AttemptPlan], Transport]


class ProducerService:
    """In-process producer; `refit_sidecar.producer_http` serves it to a remote coordinator."""

    def __init__(
        self,
        baseline: SourceBaseline,
        transport: Transport | TransportFactory,
        config: PipelineConfig | None = None,
        committed: CommitRecord | None = None,
    ) -> None:
        """`transport` is one transport, or a factory choosing it per attempt (e.g. the relay
        tree's root for this producer, which can change when membership does)."""
        self.baseline = baseline
        if isinstance(transport, Transport):
            fixed = transport
            self._transport_for: TransportFactory = lambda _plan: fixed
        else:
            self._transport_for = transport
        self.config = config
        self.committed = committed or CommitRecord(0, "initial")
        self._candidate: tuple[int, ExportFactory] | None = None
        self._runs: dict[str, Future[PipelineMetrics]] = {}
        self._transports: dict[str, Transport] = {}
        self._lock = threading.Lock()

    @property
    def producer(self) -> int:
        return self.baseline.producer

    @property
    def candidate_version(self) -> int | None:
        return self._candidate[0] if self._candidate else None

    def stage_candidate(self, version: int, export: ExportFactory) -> None:
        """The trainer's export of `version` (re-iterable: compares may restart from it)."""
        if version != self.committed.version + 1:
            raise ValueError(
                f"candidate version {version} is not the next one after {self.committed.version}"
            )
        self._candidate = (version, export)

    # -- ProducerClient ---------------------------------------------------------------------------
    async def start(self, plan: AttemptPlan) -> None:
        if self._candidate is None or self._candidate[0] != plan.target_version:
            raise EndpointError(
                f"producer {self.producer} has no candidate export of v{plan.target_version}"
            )
        export = self._candidate[1]
        pending = self.baseline.pending_attempt
        transport = self._transport_for(plan)
        pipeline = ProducerPipeline(self.baseline, transport, self.config)
        fut: Future[PipelineMetrics] = Future()

        def run() -> None:
            try:
                if plan.mode == "overwrite" and pending is not None:
                    try:
                        metrics = pipeline.run_retry(pending, plan.attempt)
                    except Exception:  # incomplete pending delta: compare again, all-overwrite
                        self.baseline.discard(pending)
                        metrics = pipeline.run(plan.attempt, export(), mode=Mode.OVERWRITE)
                else:
                    if pending is not None:
                        self.baseline.discard(pending)
                    metrics = pipeline.run(
                        plan.attempt,
                        export(),
                        mode=Mode(plan.mode),
                        xor_incompatible=plan.xor_incompatible,
                    )
                # Wait for the last staged ACKs; the transport also marks the stream's end with
                # this producer's total, so receivers need not wait for flush to learn it.
                summary = transport.stop_and_wait(plan.attempt)
                if summary.errors:
                    raise EndpointError(f"transport: {'; '.join(summary.errors)}")
                fut.set_result(metrics)
            except BaseException as exc:
                fut.set_exception(exc)

        with self._lock:
            self._runs[plan.attempt] = fut
            self._transports[plan.attempt] = transport
        threading.Thread(target=run, name=f"producer-{plan.attempt}", daemon=True).start()

    async def wait_sent(self, attempt: str) -> SentReport:
        fut = self._runs.get(attempt)
        if fut is None:
            raise EndpointError(f"producer {self.producer}: unknown attempt {attempt}")
        try:
            m = await asyncio.wrap_future(fut)
        except Exception as exc:
            raise EndpointError(f"producer {self.producer}: {exc}") from exc
        return SentReport(
            producer=self.producer,
            payloads=m.payloads,
            wire_bytes=m.payload_bytes,
            changed_elements=m.changed_elements,
            total_elements=m.total_elements,
            timings={"wall_s": m.wall_s, **{k: v.busy_s for k, v in m.stages.items()}},
        )

    async def stop_and_wait(self, attempt: str) -> None:
        transport = self._transports.get(attempt)
        if transport is not None:
            await asyncio.to_thread(transport.stop_and_wait, attempt)
        fut = self._runs.get(attempt)
        if fut is not None:
            try:
                await asyncio.wrap_future(fut)
            except Exception as exc:  # the stopped run fails; that is the point
                log.info("producer.stopped", attempt=attempt, error=str(exc))

    async def cleanup(self, attempt: str) -> None:
        with self._lock:
            self._runs.pop(attempt, None)
            transport = self._transports.pop(attempt, None)
        if transport is not None:
            await asyncio.to_thread(transport.cleanup, attempt)

    async def update_baseline(self, attempt: str, record: CommitRecord) -> None:
        """Commit the pending bits named by `record`; repeating it is a no-op."""
        if record == self.committed:
            return
        if self.baseline.pending_attempt != attempt:
            raise EndpointError(
                f"producer {self.producer} has no pending delta of {attempt} "
                f"(pending: {self.baseline.pending_attempt}); its baseline needs re-initialization"
            )
        await asyncio.wrap_future(self.baseline.commit(attempt))
        self.committed = record
        self._candidate = None
        log.info("producer.baseline_updated", producer=self.producer, version=record.version)
