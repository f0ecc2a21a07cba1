"""The receiver's control state machine (paper Appendix B.1, the rollout side of ❺–❼).

idle -> prepared -> streaming -> applying -> flushed, or failed / stopped. The coordinator
drives it through the HTTP plane: prewarm and restore (join), prepare (admission), gate,
open_apply, relay_flush (the tree's arrival barrier), flush (the completion ACK), stop, cleanup,
commit (the notice that the record names the attempt's version). Control calls are serialized
by one lock; the node's shared state is changed under its condition (`NodeState`), and applier
calls that may block run outside it.
"""

from __future__ import annotations

import threading
import time

import structlog
import torch

from refit_protocol.receiver_api import (
    CommitNotice,
    FlushRequest,
    FlushResponse,
    GateRequest,
    PrepareRequest,
    PrepareResponse,
    PrewarmRequest,
    PrewarmResponse,
    ReceiverStatus,
    RelayFlushRequest,
    RelayFlushResponse,
    RestoreRequest,
    StopResponse,
)
from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.receiver.admission import gate_refusal, prepare_refusal
from refit_sidecar.receiver.apply_loop import run_apply_loop
from refit_sidecar.receiver.config import ReceiverConfig
from refit_sidecar.receiver.errors import (
    BadRequestError,
    ObsoleteAttemptError,
    ReceiverError,
    UnknownAttemptError,
)
from refit_sidecar.receiver.intake import Intake
from refit_sidecar.receiver.node_state import NodeState
from refit_sidecar.receiver.state import ACTIVE, AttemptState, Phase
from refit_sidecar.transport.relay.node import RelayNode

log = structlog.get_logger("kuberefit.receiver")
_GATE_ERRORS = {
    "obsolete": ObsoleteAttemptError,
    "unknown_attempt": UnknownAttemptError,
    "conflict": ReceiverError,
}


class ReceiverControl:
    """The control calls of one node (thread-safe; the HTTP plane runs them on a pool)."""

    def __init__(self, node: NodeState, intake: Intake, config: ReceiverConfig) -> None:
        self.state = node
        self.intake = intake
        self.config = config
        self.relay: RelayNode | None = None  # set by the node once its relay is up
        # Serializes prepare/stop/cleanup/gate/commit/prewarm; reentrant for restore.
        self._lock = threading.RLock()

    # -- join: prewarm and dense restore --------------------------------------------------------
    def status(self) -> ReceiverStatus:
        s = self.state
        with s.cond:
            st = s.current
            return ReceiverStatus(
                node=s.node,
                held_version=None if s.dirty else s.held_version,
                attempt=st.attempt if st else None,
                phase=(st.phase if st else Phase.IDLE).value,
                staged=st.staged_total if st else 0,
                applied=st.applied if st else 0,
                gate_closed=s.gate_closed,
                errors=list(st.errors) if st else [],
                dirty=s.dirty,
                base_version=s.held_version,
                prewarmed=bool(s.metas),
                dropped=s.dropped,
            )

    def prewarm(self, req: PrewarmRequest) -> PrewarmResponse:
        s = self.state
        metas: dict[str, TensorMeta] = {}
        for m in req.metas:
            dtype = getattr(torch, m.dtype, None)
            if not isinstance(dtype, torch.dtype) or any(d < 0 for d in m.shape):
                raise BadRequestError(f"{m.name}: bad dtype {m.dtype!r} or shape {m.shape}")
            if m.name in metas:
                raise BadRequestError(f"{m.name}: listed twice")
            metas[m.name] = TensorMeta(m.name, tuple(m.shape), dtype)
        with self._lock:
            with s.cond:
                if s.current is not None and s.current.phase in ACTIVE:
                    if metas == s.metas and s.prewarmed is not None:
                        return s.prewarmed  # e.g. a new coordinator taking over
                    raise ReceiverError(f"attempt {s.current.attempt} is in progress")
            ranks = s.applier.prewarm(metas)
            answer = PrewarmResponse(node=s.node, ranks=ranks)
            with s.cond:
                s.metas = metas
                s.xor_incompatible = frozenset(answer.xor_incompatible)
                s.unsupported = answer.unsupported
                s.prewarmed = answer
        log.info(
            "receiver.prewarmed",
            node=s.node,
            tensors=len(metas),
            ranks=len(ranks),
            xor_incompatible=len(answer.xor_incompatible),
            unsupported=len(answer.unsupported),
        )
        return answer

    def restore(self, req: RestoreRequest) -> PrewarmResponse:
        """Join: load the committed version densely, prewarm, then hold that version.

        The request gate is closed for the load (no request sees half-loaded weights) and open
        afterwards: the node then holds a committed version and no attempt. Until the load
        succeeded, and every expected tensor was in the checkpoint, the node holds no known
        version, so no attempt admits it."""
        s = self.state
        with self._lock:
            with s.cond:
                if s.current is not None and s.current.phase in ACTIVE:
                    raise ReceiverError(f"attempt {s.current.attempt} is in progress")
                s.held_version = None
                s.set_held_metric()
            log.info("receiver.restoring", node=s.node, version=req.version, source=req.source)
            self._set_gate(closed=True)
            try:
                loaded = s.applier.restore(req.source)
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
            log.warning("receiver.gate_unreachable", node=self.state.node, error=str(exc))

    def _set_gate(self, *, closed: bool) -> None:
        self.state.applier.gate(closed)
        with self.state.cond:
            self.state.gate_closed = closed

    # -- an attempt ---------------------------------------------------------------------------
    def prepare(self, req: PrepareRequest) -> PrepareResponse:
        s = self.state
        with self._lock:
            with s.cond:
                cur = s.current
                if cur is not None and cur.attempt == req.attempt:
                    if cur.request == req and not cur.stopping:
                        return self._prepared(True)
                    return self._prepared(False, "attempt id already used on this node")
                relay = self.config.relay
                reason = prepare_refusal(
                    req,
                    obsolete=s.obsolete,
                    prewarmed=bool(s.metas),
                    held_version=s.held_version,
                    dirty=s.dirty,
                    relay_endpoint=relay.endpoint if relay is not None else None,
                )
                if reason:
                    s.metrics.attempts.labels("rejected").inc()
                    log.info(
                        "receiver.prepare_rejected", node=s.node, attempt=req.attempt, reason=reason
                    )
                    return self._prepared(False, reason)
                threads: list[threading.Thread] = []
                if cur is not None:
                    s.retire(cur, f"obsolete: replaced by attempt {req.attempt}")
                    threads = list(cur.threads)
            if not _join(threads, self.config.stop_timeout_s):
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
                target=run_apply_loop,
                args=(s, st, self.config.group_size),
                name=f"refit-apply-{req.attempt}",
                daemon=True,
            )
            st.threads.append(worker)
            with s.cond:
                s.current = st
                s.metrics.attempts.labels("prepared").inc()
            worker.start()
            log.info(
                "receiver.prepared",
                node=s.node,
                attempt=req.attempt,
                mode=req.mode,
                sync=req.sync,
                producers=list(st.producers),
                quota=quota,
            )
            return self._prepared(True)

    def _prepared(self, accepted: bool, reason: str = "") -> PrepareResponse:
        s = self.state
        return PrepareResponse(
            node=s.node,
            accepted=accepted,
            reason=reason,
            held_version=None if s.dirty else s.held_version,
        )

    def gate(self, req: GateRequest) -> ReceiverStatus:
        s = self.state
        with self._lock:
            with s.cond:
                refused = gate_refusal(s.current, s.obsolete, req.attempt, closed=req.closed)
                if refused is not None:
                    kind, message = refused
                    raise _GATE_ERRORS[kind](message)
            s.applier.gate(req.closed)
            with s.cond:
                s.gate_closed = req.closed
            log.info("receiver.gate", node=s.node, attempt=req.attempt, closed=req.closed)
        return self.status()

    def open_apply(self, attempt: str) -> ReceiverStatus:
        s = self.state
        with self._lock, s.cond:
            st = self._require(attempt)
            if st.failed or st.stopping:
                raise ReceiverError(f"attempt {attempt} already {st.phase.value}")
            if not s.gate_closed:
                raise ReceiverError("the request gate is open: close it before open_apply")
            if not st.opened:
                st.opened = True
                if not st.sync:
                    st.phase = Phase.APPLYING
                    decoder = threading.Thread(
                        target=self.intake.decode_loop,
                        args=(st,),
                        name=f"refit-decode-{attempt}",
                        daemon=True,
                    )
                    st.threads.append(decoder)
                    decoder.start()
                s.cond.notify_all()
        return self.status()

    def relay_flush(self, req: RelayFlushRequest) -> RelayFlushResponse:
        """Arrival barrier of the relay tree: every expected payload staged, forwards drained."""
        s = self.state
        timeout = req.timeout_s or self.config.relay_flush_timeout_s
        deadline = time.monotonic() + timeout
        with s.cond:
            st = self._require(req.attempt)
            errors = st.set_totals(req.expected)
            while not errors and not st.failed and not st.stopping:
                if not st.count_errors() or time.monotonic() >= deadline:
                    break
                s.cond.wait(min(0.2, max(deadline - time.monotonic(), 0.0)))
        if self.relay is not None:
            errors += self.relay.drain(req.attempt, max(deadline - time.monotonic(), 0.0))
        with s.cond:
            errors += st.count_errors()
            if st.failed or st.stopping:
                errors = list(st.errors) + errors or [f"attempt {st.phase.value}"]
            ok = not errors
            if not ok:
                s.fail(st, "relay flush: " + "; ".join(errors[:4]))
            return RelayFlushResponse(
                node=s.node, attempt=req.attempt, ok=ok, staged=st.staged_total, errors=errors
            )

    def flush(self, req: FlushRequest) -> FlushResponse:
        """Close the attempt: every expected payload applied in order, device synced."""
        s = self.state
        timeout = req.timeout_s or self.config.flush_timeout_s
        t0 = time.monotonic()
        deadline = t0 + timeout
        with s.cond:
            st = self._require(req.attempt)
            if st.flushed_ok:
                return self._flush_response(st, True, [], {})
            if not st.opened:
                return self._flush_response(st, False, ["flush before open_apply"], {})
            if req.check_samples and not st.check_samples:
                st.check_samples = req.check_samples  # payloads applied from now on
            errors = st.set_totals(req.expected)
            if errors:
                s.fail(st, "flush: " + "; ".join(errors))
            while not (st.failed or st.stopping or s.current is not st or st.all_applied()):
                if time.monotonic() >= deadline:
                    break
                s.cond.wait(min(0.5, max(deadline - time.monotonic(), 0.0)))
            if not (st.all_applied() and s.is_live(st)):
                if not st.failed and not st.stopping:
                    s.fail(
                        st,
                        f"flush timed out after {timeout:.1f}s: applied {st.applied} of "
                        f"{sum(st.totals.values())}; next missing {st.missing()}",
                    )
                return self._flush_response(st, False, list(st.errors), {})
            errors = st.count_errors()
        t1 = time.monotonic()
        if not errors:
            try:
                s.applier.sync()
            except Exception as exc:
                errors = [f"device sync failed: {exc!r}"]
        with s.cond:
            if errors:
                s.fail(st, "flush: " + "; ".join(errors))
                return self._flush_response(st, False, errors, {})
            st.phase = Phase.FLUSHED
            st.flushed_ok = True
            s.metrics.attempts.labels("flushed").inc()
            timings = {"wait_s": t1 - t0, "sync_s": time.monotonic() - t1, **st.timings}
            log.info(
                "receiver.flushed",
                node=s.node,
                attempt=st.attempt,
                applied=st.applied,
                checks=st.checks,
            )
            return self._flush_response(st, True, [], timings)

    def _flush_response(
        self, st: AttemptState, ok: bool, errors: list[str], timings: dict[str, float]
    ) -> FlushResponse:
        return FlushResponse(
            node=self.state.node,
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
        s = self.state
        with self._lock:
            with s.cond:
                st = s.current
                if st is None or st.attempt != attempt:
                    return StopResponse(node=s.node, attempt=attempt, drained=True)
                s.retire(st, "stopped by the coordinator")
                threads = list(st.threads)
            if self.relay is not None:
                self.relay.abort(attempt)
            drained = _join(threads, self.config.stop_timeout_s)
            log.info("receiver.stopped", node=s.node, attempt=attempt, drained=drained)
            with s.cond:
                return StopResponse(
                    node=s.node, attempt=attempt, drained=drained, errors=list(st.errors)
                )

    def cleanup(self, attempt: str) -> ReceiverStatus:
        s = self.state
        with self._lock:
            with s.cond:
                st = s.current
                if st is not None and st.attempt == attempt:
                    if st.phase in ACTIVE and not st.stopping:
                        s.retire(st, "cleaned up")
                    for entry in st.entries.values():
                        s.drop(entry, None)
                    st.entries.clear()
                    st.ready.clear()
                    st.compressed_bytes = 0
                    s.gauges(st)
            if self.relay is not None:
                self.relay.forget(attempt)
        return self.status()

    def commit(self, notice: CommitNotice) -> ReceiverStatus:
        s = self.state
        with self._lock, s.cond:
            st = s.current
            if notice.dense:
                if st is not None and st.phase in ACTIVE and not st.stopping:
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
            s.held_version = notice.version
            s.dirty = False
            s.set_held_metric()
            log.info(
                "receiver.committed",
                node=s.node,
                attempt=notice.attempt,
                version=notice.version,
                dense=notice.dense,
            )
        return self.status()

    def close(self) -> None:
        with self.state.cond:
            if self.state.current is not None:
                self.state.retire(self.state.current, "receiver shutting down")

    def _require(self, attempt: str) -> AttemptState:
        """The current attempt if it is `attempt` (under the lock)."""
        st = self.state.current
        if st is not None and st.attempt == attempt:
            return st
        if attempt in self.state.obsolete:
            raise ObsoleteAttemptError(f"attempt {attempt} is obsolete on this node")
        raise UnknownAttemptError(f"attempt {attempt} was not prepared on this node")


def _join(threads: list[threading.Thread], timeout: float) -> bool:
    """Join every thread within one shared deadline; True when none is left running."""
    deadline = time.monotonic() + timeout
    for th in threads:
        if th is not threading.current_thread():
            th.join(max(deadline - time.monotonic(), 0.0))
    return not any(th.is_alive() for th in threads)
