"""The receiver core of one rollout node: admission, reception checks, dedup, declared-order
application through a bounded queue, flush (paper Appendix B.1, Appendix C "Rollout side").

Both transports feed the same core: the relay-tree node calls the `relay_*` methods (it is the
core's `RelaySink`), the HTTP manifest handler calls `offer_manifest` and the downloads feed the
same staging step. Nothing here knows how bytes travelled.

Threads: control calls come from the HTTP layer's executor; payloads are validated and decoded
on a small staging pool; one apply thread per attempt drains the queue in declared order; in
async RL one decoder thread feeds the queue from the compressed staging area after open_apply.
All shared state is guarded by one condition variable; applier calls run outside it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog
import torch

from refit_protocol.receiver_api import (
    CommitNotice,
    FlushRequest,
    FlushResponse,
    GateRequest,
    ManifestEntry,
    PrepareRequest,
    PrepareResponse,
    PrewarmRequest,
    PrewarmResponse,
    ReceiverStatus,
    RelayFlushRequest,
    RelayFlushResponse,
    RestoreRequest,
    StopResponse,
    StreamEnd,
)
from refit_sidecar.codec.errors import CodecError, DigestMismatch, HeaderMismatch
from refit_sidecar.codec.records import Op, TensorMeta
from refit_sidecar.codec.wire import DecodedPayload, decode_payload, peek_header
from refit_sidecar.receiver.appliers.base import Applier
from refit_sidecar.receiver.config import ReceiverConfig
from refit_sidecar.receiver.errors import (
    BadRequestError,
    ObsoleteAttemptError,
    ReceiverError,
    ReceptionError,
    UnknownAttemptError,
)
from refit_sidecar.receiver.metrics import ReceiverMetrics
from refit_sidecar.receiver.state import (
    AttemptState,
    Entry,
    EntryState,
    ObsoleteSet,
    PayloadIdent,
    Phase,
)
from refit_sidecar.transport.errors import PayloadRejectedError
from refit_sidecar.transport.relay.frames import AckStatus, FrameMeta, body_digest
from refit_sidecar.transport.relay.node import RelayServer, Verdict
from refit_sidecar.transport.s3 import S3Fetcher

log = structlog.get_logger("kuberefit.receiver")

_ACTIVE = (Phase.PREPARED, Phase.STREAMING, Phase.APPLYING)


class ReceiverCore:
    """One node's receiver state machine: idle -> prepared -> streaming -> applying -> flushed."""

    def __init__(
        self,
        config: ReceiverConfig,
        applier: Applier,
        *,
        metrics: ReceiverMetrics | None = None,
        fetcher: S3Fetcher | None = None,
    ) -> None:
        self.config = config
        self.node = config.node
        self.applier = applier
        self.metrics = metrics or ReceiverMetrics()
        self.fetcher = fetcher
        self.relay: RelayServer | None = None
        self.cond = threading.Condition()
        # Serializes prepare/stop/cleanup/gate/commit/prewarm; reentrant for restore.
        self._control = threading.RLock()
        self.held_version = config.held_version
        self._prewarmed: PrewarmResponse | None = None  # the last prewarm's classification
        self.dirty = False
        self.gate_closed = False
        self.metas: dict[str, TensorMeta] = {}
        self.xor_incompatible: frozenset[str] = frozenset()
        self.unsupported: dict[str, str] = {}
        self.current: AttemptState | None = None
        self.obsolete = ObsoleteSet()
        self.dropped = 0
        self._stage_pool = ThreadPoolExecutor(config.staging_workers, "refit-stage")
        self._download_pool = ThreadPoolExecutor(config.download_workers, "refit-download")
        self._set_held_metric()

    def close(self) -> None:
        with self.cond:
            if self.current is not None:
                self._retire(self.current, "receiver shutting down")
        self._stage_pool.shutdown(wait=False, cancel_futures=True)
        self._download_pool.shutdown(wait=False, cancel_futures=True)

    # ================================================================ control plane
    def status(self) -> ReceiverStatus:
        with self.cond:
            st = self.current
            return ReceiverStatus(
                node=self.node,
                held_version=None if self.dirty else self.held_version,
                attempt=st.attempt if st else None,
                phase=(st.phase if st else Phase.IDLE).value,
                staged=st.staged_total if st else 0,
                applied=st.applied if st else 0,
                gate_closed=self.gate_closed,
                errors=list(st.errors) if st else [],
                dirty=self.dirty,
                base_version=self.held_version,
                prewarmed=bool(self.metas),
                dropped=self.dropped,
            )

    def prewarm(self, req: PrewarmRequest) -> PrewarmResponse:
        metas: dict[str, TensorMeta] = {}
        for m in req.metas:
            dtype = getattr(torch, m.dtype, None)
            if not isinstance(dtype, torch.dtype) or any(d < 0 for d in m.shape):
                raise BadRequestError(f"{m.name}: bad dtype {m.dtype!r} or shape {m.shape}")
            if m.name in metas:
                raise BadRequestError(f"{m.name}: listed twice")
            metas[m.name] = TensorMeta(m.name, tuple(m.shape), dtype)
        with self._control:
            with self.cond:
                if self.current is not None and self.current.phase in _ACTIVE:
                    if metas == self.metas and self._prewarmed is not None:
                        return self._prewarmed  # e.g. a new coordinator taking over
                    raise ReceiverError(f"attempt {self.current.attempt} is in progress")
            ranks = self.applier.prewarm(metas)
            with self.cond:
                self.metas = metas
                self.xor_incompatible = frozenset(n for r in ranks for n in r.xor_incompatible)
                self.unsupported = {n: e for r in ranks for n, e in r.unsupported.items()}
                self._prewarmed = PrewarmResponse(node=self.node, ranks=ranks)
        log.info(
            "receiver.prewarmed",
            node=self.node,
            tensors=len(metas),
            ranks=len(ranks),
            xor_incompatible=len(self.xor_incompatible),
            unsupported=len(self.unsupported),
        )
        return self._prewarmed

    def restore(self, req: RestoreRequest) -> PrewarmResponse:
        """Join: load the committed version densely, prewarm, then hold that version.

        The request gate is closed for the load (no request sees half-loaded weights) and open
        afterwards: the node then holds a committed version and no attempt. Until the load
        succeeded, and every expected tensor was in the checkpoint, the node holds no known
        version, so no attempt admits it."""
        with self._control:
            with self.cond:
                if self.current is not None and self.current.phase in _ACTIVE:
                    raise ReceiverError(f"attempt {self.current.attempt} is in progress")
                self.held_version = None
                self._set_held_metric()
            log.info("receiver.restoring", node=self.node, version=req.version, source=req.source)
            self._set_gate(closed=True)
            try:
                loaded = self.applier.restore(req.source)
            except (OSError, RuntimeError, ValueError) as exc:
                raise ReceiverError(f"dense restore from {req.source} failed: {exc}") from exc
            missing = sorted({m.name for m in req.metas} - loaded)
            if missing:
                raise ReceiverError(
                    f"dense restore from {req.source}: {len(missing)} expected tensors are not "
                    f"in the checkpoint (first: {missing[:5]})"
                )
            answer = self.prewarm(PrewarmRequest(metas=req.metas))
            v = req.version
            self.commit(CommitNotice(attempt=f"restore-v{v}", version=v, dense=True))
            self._set_gate(closed=False)
        return answer

    def close_gate_for_unknown_bits(self) -> None:
        """At start-up without a known version: close the gate (best effort: the serving
        runtime may not be up yet, then the coordinator's restore closes it)."""
        try:
            self._set_gate(closed=True)
        except Exception as exc:
            log.warning("receiver.gate_unreachable", node=self.node, error=str(exc))

    def _set_gate(self, *, closed: bool) -> None:
        self.applier.gate(closed)
        with self.cond:
            self.gate_closed = closed

    def prepare(self, req: PrepareRequest) -> PrepareResponse:
        with self._control:
            with self.cond:
                cur = self.current
                if cur is not None and cur.attempt == req.attempt:
                    if cur.request == req and not cur.stopping:
                        return self._prepared(True)
                    return self._prepared(False, "attempt id already used on this node")
                reason = self._inadmissible(req)
                if reason:
                    self.metrics.attempts.labels("rejected").inc()
                    log.info(
                        "receiver.prepare_rejected",
                        node=self.node,
                        attempt=req.attempt,
                        reason=reason,
                    )
                    return self._prepared(False, reason)
                threads: list[Any] = []
                if cur is not None:
                    self._retire(cur, f"obsolete: replaced by attempt {req.attempt}")
                    threads = list(cur.threads)
            if not self._join(threads, self.config.stop_timeout_s):
                return self._prepared(
                    False, "the previous attempt's apply call is still running; retry"
                )
            if cur is not None and self.relay is not None:
                self.relay.abort(cur.attempt)
                self.relay.forget(cur.attempt)
            tree = list(req.relay_tree) or (
                list(self.config.relay.nodes) if self.config.relay else []
            )
            quota = max(1, self.config.queue_capacity // len(set(req.producers)))
            st = AttemptState(
                req,
                quota=quota,
                relay_tree=tree,
                check_samples=req.check_samples or self.config.check_samples,
            )
            worker = threading.Thread(
                target=self._apply_loop, args=(st,), name=f"refit-apply-{req.attempt}", daemon=True
            )
            st.threads.append(worker)
            with self.cond:
                self.current = st
                self.metrics.attempts.labels("prepared").inc()
            worker.start()
            log.info(
                "receiver.prepared",
                node=self.node,
                attempt=req.attempt,
                mode=req.mode,
                sync=req.sync,
                producers=list(st.producers),
                quota=quota,
            )
            return self._prepared(True)

    def _prepared(self, accepted: bool, reason: str = "") -> PrepareResponse:
        return PrepareResponse(
            node=self.node,
            accepted=accepted,
            reason=reason,
            held_version=None if self.dirty else self.held_version,
        )

    def _inadmissible(self, req: PrepareRequest) -> str:
        """Why `req` cannot be admitted here ('' if it can). Called under the lock."""
        if req.attempt in self.obsolete:
            return f"attempt {req.attempt} is obsolete on this node"
        if not self.metas:
            return "not prewarmed: call /v1/prewarm with the canonical metadata first"
        if not req.producers or len(set(req.producers)) != len(req.producers):
            return "producers must be a non-empty list of distinct ids"
        if any(p < 0 for p in req.producers):
            return "producer ids must be >= 0"
        if req.target_version <= req.from_version:
            return f"target v{req.target_version} is not after v{req.from_version}"
        relay = self.config.relay
        if relay is not None and req.relay_tree and relay.endpoint not in req.relay_tree:
            return f"this node's relay {relay.endpoint} is not in relay_tree"
        # Either mode carries only the elements changed since from_version, so it repairs a
        # node only if that node's bits are from_version (plus, for overwrite, partial writes
        # of the same transition).
        if self.held_version is None:
            return "holds no known version (a dense restore is needed)"
        if self.held_version != req.from_version:
            return (
                f"holds v{self.held_version}, the {req.mode} attempt starts from "
                f"v{req.from_version} (a dense restore is needed)"
            )
        if req.mode == "mixed" and self.dirty:
            return (
                f"partial writes since v{self.held_version}: only an overwrite attempt is "
                "admissible"
            )
        return ""

    def gate(self, req: GateRequest) -> ReceiverStatus:
        with self._control:
            with self.cond:
                self._check_gate_attempt(req.attempt)
                st = self.current
                if (
                    not req.closed
                    and st is not None
                    and st.phase in _ACTIVE
                    and not st.stopping
                    and (st.opened or st.wrote)
                ):
                    raise ReceiverError(
                        f"attempt {st.attempt} is applying: the gate stays closed until it "
                        "is flushed or stopped"
                    )
            self.applier.gate(req.closed)
            with self.cond:
                self.gate_closed = req.closed
            log.info("receiver.gate", node=self.node, attempt=req.attempt, closed=req.closed)
        return self.status()

    def _check_gate_attempt(self, attempt: str) -> None:
        if attempt in self.obsolete:
            raise ObsoleteAttemptError(f"attempt {attempt} is obsolete on this node")
        st = self.current
        if st is not None and st.attempt != attempt:
            raise UnknownAttemptError(f"attempt {attempt} is not this node's attempt")

    def open_apply(self, attempt: str) -> ReceiverStatus:
        with self._control, self.cond:
            st = self._require(attempt)
            if st.failed or st.stopping:
                raise ReceiverError(f"attempt {attempt} already {st.phase.value}")
            if not self.gate_closed:
                raise ReceiverError("the request gate is open: close it before open_apply")
            if not st.opened:
                st.opened = True
                if not st.sync:
                    st.phase = Phase.APPLYING
                    decoder = threading.Thread(
                        target=self._decode_loop,
                        args=(st,),
                        name=f"refit-decode-{attempt}",
                        daemon=True,
                    )
                    st.threads.append(decoder)
                    decoder.start()
                self.cond.notify_all()
        return self.status()

    def relay_flush(self, req: RelayFlushRequest) -> RelayFlushResponse:
        """Arrival barrier of the relay tree: every expected payload staged, forwards drained."""
        timeout = req.timeout_s or self.config.relay_flush_timeout_s
        deadline = time.monotonic() + timeout
        with self.cond:
            st = self._require(req.attempt)
            errors = st.set_totals(req.expected)
            while not errors and not st.failed and not st.stopping:
                if not st.count_errors() or time.monotonic() >= deadline:
                    break
                self.cond.wait(min(0.2, max(deadline - time.monotonic(), 0.0)))
        if self.relay is not None:
            errors += self.relay.drain(req.attempt, max(deadline - time.monotonic(), 0.0))
        with self.cond:
            errors += st.count_errors()
            if st.failed or st.stopping:
                errors = list(st.errors) + errors or [f"attempt {st.phase.value}"]
            ok = not errors
            if not ok:
                self._fail(st, "relay flush: " + "; ".join(errors[:4]))
            return RelayFlushResponse(
                node=self.node, attempt=req.attempt, ok=ok, staged=st.staged_total, errors=errors
            )

    def flush(self, req: FlushRequest) -> FlushResponse:
        """Close the attempt: every expected payload applied in order, device synced."""
        timeout = req.timeout_s or self.config.flush_timeout_s
        t0 = time.monotonic()
        deadline = t0 + timeout
        with self.cond:
            st = self._require(req.attempt)
            if st.flushed_ok:
                return self._flush_response(st, True, [], {})
            if not st.opened:
                return self._flush_response(st, False, ["flush before open_apply"], {})
            if req.check_samples and not st.check_samples:
                st.check_samples = req.check_samples  # payloads applied from now on
            errors = st.set_totals(req.expected)
            if errors:
                self._fail(st, "flush: " + "; ".join(errors))
            while not (st.failed or st.stopping or self.current is not st or st.all_applied()):
                if time.monotonic() >= deadline:
                    break
                self.cond.wait(min(0.5, max(deadline - time.monotonic(), 0.0)))
            done = st.all_applied() and not st.failed and not st.stopping and self.current is st
            if not done:
                if not st.failed and not st.stopping:
                    self._fail(
                        st,
                        f"flush timed out after {timeout:.1f}s: applied {st.applied} of "
                        f"{sum(st.totals.values())}; next missing {st.missing()}",
                    )
                return self._flush_response(st, False, list(st.errors), {})
            errors = st.count_errors()
        t1 = time.monotonic()
        if not errors:
            try:
                self.applier.sync()
            except Exception as exc:
                errors = [f"device sync failed: {exc!r}"]
        with self.cond:
            if errors:
                self._fail(st, "flush: " + "; ".join(errors))
                return self._flush_response(st, False, errors, {})
            st.phase = Phase.FLUSHED
            st.flushed_ok = True
            self.metrics.attempts.labels("flushed").inc()
            timings = {"wait_s": t1 - t0, "sync_s": time.monotonic() - t1, **st.timings}
            log.info(
                "receiver.flushed",
                node=self.node,
                attempt=st.attempt,
                applied=st.applied,
                checks=st.checks,
            )
            return self._flush_response(st, True, [], timings)

    def _flush_response(
        self, st: AttemptState, ok: bool, errors: list[str], timings: dict[str, float]
    ) -> FlushResponse:
        return FlushResponse(
            node=self.node,
            attempt=st.attempt,
            ok=ok,
            applied=st.applied,
            staged=st.staged_total,
            checks=st.checks,
            errors=errors,
            timings=dict(timings),
        )

    def stop(self, attempt: str) -> StopResponse:
        """stop_and_wait on this node: no more payloads or applies for the attempt."""
        with self._control:
            with self.cond:
                st = self.current
                if st is None or st.attempt != attempt:
                    return StopResponse(node=self.node, attempt=attempt, drained=True)
                self._retire(st, "stopped by the coordinator")
                threads = list(st.threads)
            if self.relay is not None:
                self.relay.abort(attempt)
            drained = self._join(threads, self.config.stop_timeout_s)
            log.info("receiver.stopped", node=self.node, attempt=attempt, drained=drained)
            with self.cond:
                return StopResponse(
                    node=self.node, attempt=attempt, drained=drained, errors=list(st.errors)
                )

    def cleanup(self, attempt: str) -> ReceiverStatus:
        with self._control:
            with self.cond:
                st = self.current
                if st is not None and st.attempt == attempt:
                    if st.phase in _ACTIVE and not st.stopping:
                        self._retire(st, "cleaned up")
                    for entry in st.entries.values():
                        self._drop(entry, None)
                    st.entries.clear()
                    st.ready.clear()
                    st.compressed_bytes = 0
                    self._gauges(st)
            if self.relay is not None:
                self.relay.forget(attempt)
        return self.status()

    def commit(self, notice: CommitNotice) -> ReceiverStatus:
        with self._control, self.cond:
            st = self.current
            if notice.dense:
                if st is not None and st.phase in _ACTIVE and not st.stopping:
                    raise ReceiverError(f"attempt {st.attempt} is in progress")
            else:
                if st is None or st.attempt != notice.attempt or not st.flushed_ok:
                    raise ReceiverError(
                        f"attempt {notice.attempt} was not flushed on this node; its bits are "
                        f"not known to be version {notice.version}"
                    )
                if st.request.target_version != notice.version:
                    raise ReceiverError(
                        f"attempt {notice.attempt} targets v{st.request.target_version}, "
                        f"notice says v{notice.version}"
                    )
            self.held_version = notice.version
            self.dirty = False
            self._set_held_metric()
            log.info(
                "receiver.committed",
                node=self.node,
                attempt=notice.attempt,
                version=notice.version,
                dense=notice.dense,
            )
        return self.status()

    def stream_end(self, req: StreamEnd) -> Verdict:
        with self.cond:
            verdict = self._attempt_verdict(req.attempt)
            if verdict is not None:
                return verdict
            st = self.current
            assert st is not None
            err = st.set_total(req.producer, req.total)
            if err:
                self._fail(st, err)
                return (AckStatus.REJECTED, err)
            self.cond.notify_all()
            return (AckStatus.STAGED, "")

    # ================================================================ data plane (RelaySink)
    def relay_tree(self, attempt: str) -> list[str]:
        with self.cond:
            st = self.current
            return st.relay_tree if st is not None and st.attempt == attempt else []

    def relay_check(self, meta: FrameMeta, *, probe: bool) -> Verdict | None:
        ident = PayloadIdent.from_frame(meta)
        with self.cond:
            verdict = self._offer_verdict(ident)
            if verdict is not None:
                return verdict
            return (AckStatus.READY, "") if probe else None

    def relay_stage(
        self, meta: FrameMeta, body: memoryview, keep: object, children: int
    ) -> Verdict:
        ident = PayloadIdent.from_frame(meta)
        with self.cond:
            verdict = self._offer_verdict(ident)
            if verdict is not None:
                return verdict
            st = self.current
            assert st is not None
            entry = st.register(ident, children)
            entry.keep = keep
            self.metrics.payloads.labels("staged").inc()
        self._stage_pool.submit(self._stage_local, st, entry, body, verified=True)
        return (AckStatus.STAGED, "")

    def relay_release(self, meta: FrameMeta, error: str | None) -> None:
        with self.cond:
            st = self.current
            if st is None or st.attempt != meta.attempt:
                return
            entry = st.entries.get((meta.producer, meta.payload_id))
            if entry is not None:
                st.release(entry)
            self.cond.notify_all()

    def relay_end(self, meta: FrameMeta) -> Verdict:
        if meta.total is None:
            return (AckStatus.REJECTED, "END without a total")
        return self.stream_end(
            StreamEnd(attempt=meta.attempt, producer=meta.producer, total=meta.total)
        )

    def relay_fail(self, attempt: str, reason: str) -> None:
        with self.cond:
            st = self.current
            if st is not None and st.attempt == attempt:
                self._fail(st, reason)

    def offer_manifest(self, m: ManifestEntry) -> Verdict:
        """Register an object-storage payload and queue its download (S3 transport)."""
        if self.fetcher is None:
            return (AckStatus.REJECTED, "this node has no object storage configured")
        try:
            ident = PayloadIdent.from_manifest(m)
        except ValueError as exc:
            return (AckStatus.REJECTED, str(exc))
        with self.cond:
            verdict = self._offer_verdict(ident)
            if verdict is not None:
                return verdict
            st = self.current
            assert st is not None
            entry = st.register(ident, 0)
            self.metrics.payloads.labels("staged").inc()
        self._download_pool.submit(self._download, st, entry, m)
        return (AckStatus.STAGED, "")

    # ================================================================ internals
    def _require(self, attempt: str) -> AttemptState:
        st = self.current
        if st is not None and st.attempt == attempt:
            return st
        if attempt in self.obsolete:
            raise ObsoleteAttemptError(f"attempt {attempt} is obsolete on this node")
        raise UnknownAttemptError(f"attempt {attempt} was not prepared on this node")

    def _attempt_verdict(self, attempt: str) -> Verdict | None:
        """Drop/answer payloads that do not belong to the live current attempt (under lock)."""
        st = self.current
        if st is None or st.attempt != attempt:
            if attempt in self.obsolete:
                self._count_drop("obsolete")
                return (AckStatus.OBSOLETE, f"attempt {attempt} was replaced by a later prepare")
            self.metrics.payloads.labels("unknown_attempt").inc()
            return (AckStatus.UNKNOWN_ATTEMPT, f"attempt {attempt} is not prepared here")
        if st.failed:
            self.metrics.payloads.labels("rejected").inc()
            return (AckStatus.REJECTED, f"attempt failed on {self.node}: {st.errors[0]}")
        if st.stopping:
            self._count_drop("stopped")
            return (AckStatus.OBSOLETE, f"attempt {attempt} was stopped")
        return None

    def _offer_verdict(self, ident: PayloadIdent) -> Verdict | None:
        """Attempt, producer, dedup, order and admission checks (under lock)."""
        verdict = self._attempt_verdict(ident.attempt)
        if verdict is not None:
            return verdict
        st = self.current
        assert st is not None
        reason = ""
        entry = st.entries.get((ident.producer, ident.payload_id))
        if ident.producer not in st.producers:
            reason = f"producer {ident.producer} is not part of the attempt"
        elif entry is not None:
            if entry.ident.digest == ident.digest and entry.ident.order == ident.order:
                self.metrics.payloads.labels("duplicate").inc()
                return (AckStatus.DUPLICATE, "")
            reason = f"payload {ident.label()} reused with other bytes"
        elif (ident.producer, ident.order) in st.by_order:
            reason = f"payload {ident.label()}: order already taken by another payload"
        elif ident.producer in st.totals and ident.order >= st.totals[ident.producer]:
            reason = (
                f"payload {ident.label()} beyond the producer's total {st.totals[ident.producer]}"
            )
        elif not st.sync and st.compressed_bytes + ident.size > self.config.async_staging_max_bytes:
            reason = (
                f"async staging would exceed {self.config.async_staging_max_bytes} bytes "
                "(raise async_staging_max_bytes or use sync mode)"
            )
        if reason:
            self._fail(st, reason)
            self.metrics.payloads.labels("rejected").inc()
            return (AckStatus.REJECTED, reason)
        if not st.admissible(ident):
            self.metrics.payloads.labels("wait").inc()
            return (AckStatus.WAIT, "queue full")
        return None

    def _download(self, st: AttemptState, entry: Entry, m: ManifestEntry) -> None:
        assert self.fetcher is not None
        last: Exception | None = None
        for i in range(self.config.download_retries + 1):
            with self.cond:
                if st is not self.current or st.stopping or st.failed:
                    self._drop(entry)
                    return
            try:
                data = self.fetcher.fetch(m.bucket, m.key, m.size)
                break
            except PayloadRejectedError as exc:  # wrong bucket or size: retrying cannot help
                with self.cond:
                    self._fail(st, f"download of {entry.ident.label()} ({m.key}): {exc}")
                return
            except Exception as exc:  # network, 404 before consistency
                last = exc
                time.sleep(min(0.1 * 2**i, 2.0))
        else:
            with self.cond:
                self._fail(st, f"download of {entry.ident.label()} ({m.key}) failed: {last!r}")
            return
        self._stage_local(st, entry, data, verified=False)

    def _stage_local(
        self, st: AttemptState, entry: Entry, body: bytes | memoryview, *, verified: bool
    ) -> None:
        """Validate and stage one registered payload (staging pool thread)."""
        ident = entry.ident
        try:
            header = peek_header(body)
            if (header.attempt, header.producer, header.payload_id, header.order) != (
                ident.attempt,
                ident.producer,
                ident.payload_id,
                ident.order,
            ):
                raise HeaderMismatch("payload header differs from its announced identity")
            if st.sync:
                t0 = time.perf_counter()
                decoded = decode_payload(body, expected_digest=ident.digest, known=self.metas)
                self._classify(decoded)
                staged = self.applier.stage(body, decoded)
                with self.cond:
                    st.timings["decode_s"] += time.perf_counter() - t0
                    st.pending_local -= 1
                    if st is not self.current or st.stopping or st.failed:
                        self.applier.discard(staged)
                        self._drop(entry)
                        return
                    entry.staged, entry.state, entry.keep = staged, EntryState.READY, None
                    st.ready[(ident.order, ident.producer)] = entry
                    self._gauges(st)
                    self.cond.notify_all()
            else:
                if not verified and body_digest(body) != ident.digest:
                    raise DigestMismatch("payload body does not match the manifest digest")
                with self.cond:
                    st.pending_local -= 1
                    if st is not self.current or st.stopping or st.failed:
                        self._drop(entry)
                        return
                    entry.body, entry.state = body, EntryState.STAGED
                    st.compressed_bytes += ident.size
                    st.release_local(entry)
                    self._gauges(st)
                    self.cond.notify_all()
        except (CodecError, ReceptionError) as exc:
            with self.cond:
                self._fail(st, f"payload {ident.label()}: {type(exc).__name__}: {exc}")
        except Exception as exc:
            log.exception("receiver.stage_failed", node=self.node, payload=ident.label())
            with self.cond:
                self._fail(st, f"payload {ident.label()}: staging failed: {exc!r}")

    def _classify(self, decoded: DecodedPayload) -> None:
        """Loader classification from prewarm: fail closed on unsupported names, XOR misuse."""
        for item in decoded.items:
            name = item.meta.name
            if name in self.unsupported:
                raise ReceptionError(
                    f"{name}: the native loader cannot take it here ({self.unsupported[name]})"
                )
            if item.op is Op.XOR and name in self.xor_incompatible:
                raise ReceptionError(
                    f"{name}: XOR item for a tensor prewarm found XOR-incompatible"
                )

    def _decode_loop(self, st: AttemptState) -> None:
        """Async RL: feed the bounded queue from compressed staging, in declared order."""
        cap = self.config.queue_capacity
        while True:
            with self.cond:
                while True:
                    if st.stopping or st.failed or self.current is not st:
                        return
                    key = st.next_key(st.decode_cursor)
                    if key is None:
                        return
                    entry = st.entry_at(key)
                    if (
                        entry is not None
                        and entry.state is EntryState.STAGED
                        and len(st.ready) + st.decoding < cap
                    ):
                        break
                    self.cond.wait(1.0)
                st.decode_cursor[key[1]] = key[0] + 1
                st.decoding += 1
                body = entry.body
            assert body is not None
            try:
                t0 = time.perf_counter()
                decoded = decode_payload(body, expected_digest=entry.ident.digest, known=self.metas)
                self._classify(decoded)
                staged = self.applier.stage(body, decoded)
            except (CodecError, ReceptionError) as exc:
                with self.cond:
                    st.decoding -= 1
                    self._fail(st, f"payload {entry.ident.label()}: {type(exc).__name__}: {exc}")
                return
            except Exception as exc:
                with self.cond:
                    st.decoding -= 1
                    self._fail(st, f"payload {entry.ident.label()}: decode failed: {exc!r}")
                return
            with self.cond:
                st.decoding -= 1
                st.timings["decode_s"] += time.perf_counter() - t0
                st.compressed_bytes -= entry.ident.size
                entry.body = entry.keep = None
                if st.stopping or st.failed or self.current is not st:
                    self.applier.discard(staged)
                    return
                entry.staged, entry.state = staged, EntryState.READY
                st.ready[key] = entry
                self._gauges(st)
                self.cond.notify_all()

    def _apply_loop(self, st: AttemptState) -> None:
        """Drain the queue in declared order, one group of up to `group_size` per call."""
        group = self.config.group_size
        while True:
            with self.cond:
                while True:
                    if st.stopping or st.failed or self.current is not st:
                        return
                    key = st.next_key(st.apply_cursor) if st.opened else None
                    if st.opened and key is None:
                        return  # every stream complete and applied
                    if key is not None and key in st.ready:
                        break
                    self.cond.wait(1.0)
                batch: list[Entry] = []
                while key is not None and key in st.ready and len(batch) < group:
                    entry = st.ready.pop(key)
                    entry.state = EntryState.APPLYING
                    batch.append(entry)
                    st.apply_cursor[key[1]] = key[0] + 1
                    key = st.next_key(st.apply_cursor)
                st.applying = len(batch)
                st.wrote = True
                self.dirty = True
                st.phase = Phase.APPLYING
                check = st.check_samples
                self._gauges(st)
            t0 = time.perf_counter()
            try:
                staged = [e.staged for e in batch if e.staged is not None]
                report = self.applier.apply(staged, check)
            except Exception as exc:
                with self.cond:
                    st.applying = 0
                    labels = ", ".join(e.ident.label() for e in batch)
                    self._fail(
                        st, f"apply of payloads {labels} failed: {type(exc).__name__}: {exc}"
                    )
                return
            elapsed = time.perf_counter() - t0
            self.metrics.apply_seconds.observe(elapsed)
            self.metrics.applied.inc(len(batch))
            with self.cond:
                st.applying = 0
                st.applied += len(batch)
                st.checks += report.checks
                st.timings["apply_s"] += elapsed
                for entry in batch:
                    entry.state, entry.staged = EntryState.APPLIED, None
                    st.release_local(entry)
                self._gauges(st)
                self.cond.notify_all()

    def _fail(self, st: AttemptState, reason: str) -> None:
        """The attempt fails on this node (under lock): nothing more is applied for it."""
        if not st.failed:
            log.warning(
                "receiver.attempt_failed", node=self.node, attempt=st.attempt, reason=reason
            )
            self.metrics.attempts.labels("failed").inc()
        st.failed = True
        if st.phase is not Phase.STOPPED:
            st.phase = Phase.FAILED
        if reason not in st.errors:
            st.errors.append(reason)
        self._drop_queued(st, "failed")
        self.cond.notify_all()

    def _retire(self, st: AttemptState, reason: str) -> None:
        """Obsolete or stop an attempt (under lock): drop what is queued, refuse the rest."""
        if not st.stopping:
            self.metrics.attempts.labels("stopped").inc()
        st.stopping = True
        if st.phase is not Phase.FLUSHED:
            st.phase = Phase.STOPPED
        self.obsolete.add(st.attempt)
        self._drop_queued(st, "replaced")
        log.info("receiver.retired", node=self.node, attempt=st.attempt, reason=reason)
        self.cond.notify_all()

    def _drop_queued(self, st: AttemptState, reason: str) -> None:
        for entry in list(st.ready.values()):
            self._drop(entry, reason)
        st.ready.clear()
        for entry in st.entries.values():
            if entry.state is EntryState.STAGED:
                self._drop(entry, reason)
        st.compressed_bytes = 0
        self._gauges(st)

    def _drop(self, entry: Entry, reason: str | None = "replaced") -> None:
        if entry.state in (EntryState.APPLIED, EntryState.DROPPED, EntryState.APPLYING):
            return
        if entry.staged is not None:
            self.applier.discard(entry.staged)
        entry.staged = None
        entry.body = entry.keep = None
        entry.state = EntryState.DROPPED
        if reason is not None:
            self._count_drop(reason)

    def _count_drop(self, reason: str) -> None:
        self.dropped += 1
        self.metrics.dropped.labels(reason).inc()

    def _gauges(self, st: AttemptState) -> None:
        self.metrics.queue_depth.set(len(st.ready))
        self.metrics.staged_bytes.set(st.compressed_bytes)

    def _set_held_metric(self) -> None:
        self.metrics.held_version.set(-1 if self.held_version is None else self.held_version)

    @staticmethod
    def _join(threads: list[Any], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for th in threads:
            if isinstance(th, threading.Thread) and th is not threading.current_thread():
                th.join(max(deadline - time.monotonic(), 0.0))
        return not any(isinstance(th, threading.Thread) and th.is_alive() for th in threads)
