"""The trainer sidecar's producer: one owner's side of every attempt (❶–❹, and its side of ❼).

It holds the source baseline, the candidate export of the next version (handed over by the
trainer), the producer pipeline and a transport, and answers the coordinator's calls (the
`ProducerClient` port): start an attempt, report what was sent, stop, clean up, and update the
baseline once the commit record names the attempt's version. A mixed attempt compares the
candidate with the baseline; every overwrite retry is rebuilt from the pending delta, so the
trainer never exports the same version twice.

The trainer process hands its exports over as chunk files (`refit_sidecar.trainer.publisher`):
`ingest_chunk` takes each owned chunk out of the shared-memory inbox, `stage` checks the whole
export against the baseline and stages it as the candidate of the next version, or, for the
first export, builds the baseline after checking the resume rules (`producer.resume`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Protocol

import structlog

from refit_protocol.commit import CommitRecord
from refit_protocol.errors import EndpointError
from refit_protocol.producer_api import (
    AttemptPlan,
    CandidateChunkAck,
    CandidateChunkRequest,
    CandidateStaged,
    CandidateStageRequest,
    SentReport,
    StagePurpose,
    StreamSettings,
)
from refit_sidecar.baseline.chunks import ExportChunk, owner_of, plan_chunks
from refit_sidecar.baseline.errors import BaselineError
from refit_sidecar.baseline.source import SourceBaseline
from refit_sidecar.codec.records import Mode, TensorMeta
from refit_sidecar.pipeline.config import PipelineConfig
from refit_sidecar.pipeline.metrics import PipelineMetrics
from refit_sidecar.pipeline.producer import ProducerPipeline
from refit_sidecar.producer import resume
from refit_sidecar.producer.metrics import ProducerMetrics
from refit_sidecar.producer.readiness import staging_checks
from refit_sidecar.producer.staging import CandidateStaging, StagingConfig, meta_chunk
from refit_sidecar.trainer.errors import (
    CandidateMismatchError,
    StagingStateError,
    VersionMismatchError,
)
from refit_sidecar.trainer.manifest import from_wire, require_same_layout
from refit_sidecar.transport.base import AbandoningTransport, Transport, TransportMedium

log = structlog.get_logger("kuberefit.producer")

ExportFactory = Callable[[], Iterable[ExportChunk]]
TransportFactory = Callable[[AttemptPlan], Transport]


class ProducerObserver(Protocol):
    """Told when the calls that bound a transition happen on this producer (the refit bench
    reads its timed window from them). Called on the event loop: keep it short."""

    def started(self, plan: AttemptPlan) -> None:
        """`start` was called: the owner begins delta construction for `plan`."""
        ...

    def sent(self, attempt: str, report: SentReport) -> None:
        """The attempt's last payload was sent (what `wait_sent` reports)."""
        ...

    def baseline_updated(self, attempt: str, record: CommitRecord) -> None:
        """The baseline now holds `record`'s bits (not called for a repeated update)."""
        ...


class ProducerService:
    """In-process producer; `refit_sidecar.producer.http` serves it to a remote coordinator."""

    def __init__(
        self,
        baseline: SourceBaseline,
        transport: Transport | TransportFactory,
        config: PipelineConfig | None = None,
        committed: CommitRecord | None = None,
        staging: StagingConfig | None = None,
        observer: ProducerObserver | None = None,
        mac_key: bytes | Callable[[], bytes | None] | None = None,
        metrics: ProducerMetrics | None = None,
        medium: TransportMedium | None = None,
    ) -> None:
        """`transport` is one transport, or a factory choosing it per attempt (e.g. the relay
        tree's root for this producer, which can change when membership does). `staging`
        enables the trainer handoff (`ingest_chunk`/`stage`); `baseline` may then still be
        uninitialized: the trainer's first export builds it. `observer` is told of start,
        sent and baseline update (timing). `mac_key`: payloads carry a MAC made with it
        (`refit_protocol.keys.payload_mac_key` of the policy's token), or with what it returns
        when an attempt starts (the sending token's key, which a rotation changes).
        `metrics`: where attempts, bytes and stage times are counted (default: a registry of
        its own, served on `/metrics`). `medium`: the transport kind's checks and cleanup
        beyond one attempt (`TransportSelector`)."""
        self.baseline = baseline
        if isinstance(transport, Transport):
            fixed = transport
            self._transport_for: TransportFactory = lambda _plan: fixed
        else:
            self._transport_for = transport
        self.config = config
        self.medium = medium
        #: The stream settings of the last attempt (`settings`), once one was started.
        self._last_settings: StreamSettings | None = None
        self.committed = committed or CommitRecord(0, "initial")
        self._candidate: tuple[int, ExportFactory] | None = None
        self._runs: dict[str, Future[PipelineMetrics]] = {}
        self._transports: dict[str, Transport] = {}
        self._lock = threading.Lock()
        self._staging = CandidateStaging(staging) if staging is not None else None
        self._stage_lock = threading.Lock()
        self.observer = observer
        self.mac_key = mac_key
        self.baseline_fingerprint: str | None = None
        self._layout_cache: tuple[list[tuple[TensorMeta, ...]], dict[str, TensorMeta]] | None = None
        self.metrics = metrics if metrics is not None else ProducerMetrics()
        self.metrics.follow(
            lambda: self.committed.version if self.baseline_ready else -1,
            lambda: -1 if self.candidate_version is None else self.candidate_version,
        )

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
        if self.observer is not None:
            self.observer.started(plan)
        if self._candidate is None or self._candidate[0] != plan.target_version:
            self.metrics.attempts.labels(plan.mode, "refused").inc()
            raise EndpointError(
                f"producer {self.producer} has no candidate export of v{plan.target_version}"
            )
        export = self._candidate[1]
        pending = self.baseline.pending_attempt
        transport = self._transport_for(plan)
        mac_key = self.mac_key() if callable(self.mac_key) else self.mac_key
        config = self._config_for(plan.settings)
        pipeline = ProducerPipeline(self.baseline, transport, config, mac_key=mac_key)
        fut: Future[PipelineMetrics] = Future()

        def run() -> None:
            try:
                if plan.mode == "overwrite" and pending is not None:
                    if self.baseline.pending_complete(pending):
                        # A failure while sending is this attempt's failure, with its own cause
                        # (the delta then belongs to this attempt, for the next retry).
                        metrics = pipeline.run_retry(pending, plan.attempt)
                    else:  # an incomplete pending delta: compare again, all-overwrite
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
                self.metrics.sent(plan.mode, metrics)
                fut.set_result(metrics)
            except BaseException as exc:
                self.metrics.attempts.labels(plan.mode, "failed").inc()
                fut.set_exception(exc)

        with self._lock:
            self._runs[plan.attempt] = fut
            self._transports[plan.attempt] = transport
        threading.Thread(target=run, name=f"producer-{plan.attempt}", daemon=True).start()

    @property
    def settings(self) -> StreamSettings:
        """The stream settings in effect: the last plan's, or this producer's own before one."""
        if self._last_settings is not None:
            return self._last_settings
        config = self.config or PipelineConfig()
        return StreamSettings(
            zstd_level=config.codec.zstd_level,
            shuffle=config.codec.shuffle,
            bucket_bytes=config.bucket_bytes,
        )

    def _config_for(self, settings: StreamSettings | None) -> PipelineConfig | None:
        """The pipeline settings of one attempt: this producer's, with the plan's stream
        settings (the policy's current ones) in place of what it was configured with."""
        if settings is None:  # an in-process producer: its own configuration
            self._last_settings = None
            return self.config
        if settings != self.settings:
            log.info(
                "producer.settings_changed",
                producer=self.producer,
                was=self.settings.model_dump(),
                now=settings.model_dump(),
            )
        self._last_settings = settings
        config = self.config or PipelineConfig()
        codec = config.codec.model_copy(
            update={"zstd_level": settings.zstd_level, "shuffle": settings.shuffle}
        )
        return config.model_copy(update={"bucket_bytes": settings.bucket_bytes, "codec": codec})

    async def wait_sent(self, attempt: str) -> SentReport:
        fut = self._runs.get(attempt)
        if fut is None:
            raise EndpointError(f"producer {self.producer}: unknown attempt {attempt}")
        try:
            m = await asyncio.wrap_future(fut)
        except Exception as exc:
            raise EndpointError(f"producer {self.producer}: {exc}") from exc
        report = SentReport(
            producer=self.producer,
            payloads=m.payloads,
            wire_bytes=m.payload_bytes,
            changed_elements=m.changed_elements,
            total_elements=m.total_elements,
            timings={"wall_s": m.wall_s, **{k: v.busy_s for k, v in m.stages.items()}},
        )
        if self.observer is not None:
            self.observer.sent(attempt, report)
        return report

    async def stop_and_wait(self, attempt: str) -> None:
        """The coordinator stops only attempts it marked obsolete: abandon what is in flight
        where the transport can, instead of waiting for ACKs that may never come."""
        transport = self._transports.get(attempt)
        if transport is not None:
            if isinstance(transport, AbandoningTransport):
                transport.abandon(attempt)
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
        elif self.medium is not None:  # restarted since the attempt: its objects may remain
            await asyncio.to_thread(self.medium.leftovers, attempt)

    def transport_problem(self) -> str:
        """Why this producer could not send now ("" : nothing known), for its status."""
        return self.medium.problem() if self.medium is not None else ""

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
        self.metrics.last_commit_time.set(time.time())
        self._candidate = None
        if self._staging is not None:
            self._staging.drop_except(set())
        log.info("producer.baseline_updated", producer=self.producer, version=record.version)
        if self.observer is not None:
            self.observer.baseline_updated(attempt, record)

    def learn_committed(self, record: CommitRecord) -> None:
        """Take the committed record from the coordinator while there is no baseline yet (a
        restarted sidecar): the trainer's initial export must then be of that version. With a
        baseline, only the record it already holds is accepted."""
        if self.baseline_ready:
            if record != self.committed:
                raise EndpointError(
                    f"producer {self.producer} holds a baseline of v{self.committed.version} "
                    f"({self.committed.baseline_id}), not {record}"
                )
            return
        if record != self.committed:
            log.info(
                "producer.committed_learned",
                producer=self.producer,
                version=record.version,
                was=self.committed.version,
            )
        self.committed = record

    def readiness(self) -> list[tuple[str, bool, str]]:
        """What `/readyz` reports: the inbox and reference checkpoint (`producer.readiness`)."""
        return staging_checks(self._staging.config if self._staging is not None else None)

    # -- candidate staging (the trainer's handoff) -----------------------------------------------
    @property
    def baseline_ready(self) -> bool:
        try:
            return self.baseline.chunk_count >= 0
        except BaselineError:
            return False

    def _require_staging(self, version: int, purpose: StagePurpose) -> CandidateStaging:
        if self._staging is None:
            raise StagingStateError(
                f"producer {self.producer} has no candidate staging configured (StagingConfig)"
            )
        committed = self.committed.version
        if purpose == "initial":
            if version != committed:
                raise VersionMismatchError(
                    f"the first export must be of the committed version v{committed} (the "
                    f"weights the rollout holds), got v{version}: resume the trainer from the "
                    f"checkpoint of v{committed}, or restart the rollout from v{version}'s"
                )
            return self._staging
        if not self.baseline_ready:
            raise StagingStateError(
                f"producer {self.producer} has no baseline yet: publish the first export "
                f"(Publisher.initialize) before v{version}"
            )
        if version != committed + 1:
            raise VersionMismatchError(
                f"v{version} is not the next version: producer {self.producer} committed "
                f"v{committed}, the next is v{committed + 1}"
            )
        if self.candidate_version == version:
            raise StagingStateError(f"v{version} is already staged; wait for its transition")
        return self._staging

    def _layout(
        self, purpose: StagePurpose
    ) -> tuple[list[tuple[TensorMeta, ...]], dict[str, TensorMeta]] | None:
        """The baseline's chunk plan and metadata (None before the first export built them);
        computed once: the layout never changes after the first export."""
        if purpose == "initial" and not self.baseline_ready:
            return None
        if self._layout_cache is None:
            metas = self.baseline.metadata
            plan = plan_chunks(list(metas.values()), self.baseline.chunk_bytes)
            self._layout_cache = (plan, metas)
        return self._layout_cache

    def ingest_chunk(self, req: CandidateChunkRequest) -> CandidateChunkAck:
        """Take one owned chunk file out of the inbox (checked against the baseline's plan)."""
        with self._stage_lock:
            staging = self._require_staging(req.version, req.purpose)
            layout = self._layout(req.purpose)
        plan, known = layout if layout is not None else (None, None)
        owner = owner_of(req.index, self.baseline.producers)
        if owner != self.producer:
            raise CandidateMismatchError(
                f"chunk {req.index} belongs to producer {owner}, not {self.producer}: the "
                f"trainer must chunk with {self.baseline.producers} producers"
            )
        if plan is not None and req.index >= len(plan):
            raise CandidateMismatchError(
                f"chunk {req.index}: the baseline's export has only {len(plan)} chunks"
            )
        expected = plan[req.index] if plan is not None else None
        staged = staging.accept(
            req.version,
            req.index,
            req.file,
            req.names,
            expected,
            known,
            changed=req.changed,
            # changes apply to the committed baseline; the first export sends whole tensors
            committed=self.baseline.stored_bits if req.purpose == "next" else None,
        )
        return CandidateChunkAck(index=req.index, nbytes=staged.nbytes)

    def close_staging(self) -> None:
        """Delete every staged file and the candidate directory (at shutdown)."""
        if self._staging is not None:
            self._staging.close()

    def abort_staging(self, version: int) -> None:
        """Forget a partly staged version (a failed publish); a staged candidate stays."""
        with self._stage_lock:
            if self._staging is not None and self.candidate_version != version:
                self._staging.drop(version)

    def stage(self, req: CandidateStageRequest) -> CandidateStaged:
        """Check the complete export and stage it (next) or build/check the baseline (initial)."""
        with self._stage_lock:
            staging = self._require_staging(req.version, req.purpose)
            try:
                return self._stage(staging, req)
            except BaseException:
                staging.drop(req.version)
                raise

    def _stage(self, staging: CandidateStaging, req: CandidateStageRequest) -> CandidateStaged:
        manifest = from_wire(req.manifest)
        if self.baseline_ready:
            require_same_layout(
                manifest, list(self.baseline.metadata.values()), "the baseline's export"
            )
        plan = plan_chunks(manifest, self.baseline.chunk_bytes)
        owned = [
            i for i in range(len(plan)) if owner_of(i, self.baseline.producers) == self.producer
        ]
        got = staging.chunks(req.version)
        if sorted(req.chunks) != owned or sorted(got) != owned:
            missing = sorted(set(owned) - set(got))
            extra = sorted(set(got) - set(owned))
            raise CandidateMismatchError(
                f"producer {self.producer} owns {len(owned)} chunks of this export; "
                f"missing {missing[:10]}, unexpected {extra[:10]} (first 10)"
            )
        for i in owned:
            if got[i].metas != plan[i]:
                raise CandidateMismatchError(f"chunk {i} does not match the export's chunk plan")
        nbytes = sum(got[i].nbytes for i in owned)
        fingerprint = None
        if req.purpose == "initial":
            fingerprint = self._initialize(staging, req.version, plan, owned)
        else:
            self.stage_candidate(req.version, lambda: staging.export(req.version))
        self.metrics.candidates.labels(req.purpose).inc()
        self.metrics.staged_bytes.inc(nbytes)
        log.info(
            "producer.staged",
            producer=self.producer,
            version=req.version,
            purpose=req.purpose,
            chunks=len(owned),
            nbytes=nbytes,
        )
        return CandidateStaged(
            version=req.version,
            purpose=req.purpose,
            producer=self.producer,
            chunks=len(owned),
            nbytes=nbytes,
            fingerprint=fingerprint,
        )

    def _initialize(
        self,
        staging: CandidateStaging,
        version: int,
        plan: list[tuple[TensorMeta, ...]],
        owned: list[int],
    ) -> str:
        """Resume rules, then the baseline from the first export (no dense sync)."""
        chunks = staging.chunks(version)
        digests = {
            name: resume.tensor_digest(name, tensor)
            for i in owned
            for name, tensor in chunks[i].load().tensors
        }
        reference = staging.config.reference_checkpoint
        if self.baseline_ready:  # the trainer restarted, this sidecar kept its baseline
            stored = {
                m.name: resume.bits_digest(m, self.baseline.stored_bits(m.name))
                for i in owned
                for m in plan[i]
            }
            what = f"producer {self.producer}'s baseline of v{version}"
            resume.require_same(digests, stored, what=what, version=version)
        else:
            if reference is not None:
                theirs = resume.checkpoint_digests(reference, digests)
                what = f"the rollout's checkpoint {reference}"
                resume.require_same(digests, theirs, what=what, version=version)
            else:
                log.warning(
                    "producer.fresh_start_unchecked",
                    producer=self.producer,
                    reason="no reference_checkpoint configured",
                )

            def export() -> Iterator[ExportChunk]:
                for i, metas in enumerate(plan):
                    yield chunks[i].load() if i in chunks else meta_chunk(i, metas)

            self.baseline.load_initial(export())
        staging.drop(version)
        self.baseline_fingerprint = resume.combined(digests)
        return self.baseline_fingerprint
