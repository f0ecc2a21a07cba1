"""The receiver's control state machine (paper Appendix B.1, the rollout side of ❺–❼).

idle -> prepared -> streaming -> applying -> flushed, or failed / stopped. The coordinator
drives it through the HTTP plane: prewarm and restore (join), prepare (admission), gate,
open_apply, relay_flush (the tree's arrival barrier), flush (the completion ACK), stop, cleanup,
commit (the notice that the record names the attempt's version). Control calls are serialized
by one lock; the node's shared state is changed under its condition (`NodeState`), and applier
calls that may block run outside it.

A restore or an audit reads a checkpoint under the control lock (nothing may write the weights
meanwhile), which can take minutes: a prepare, restore or audit arriving then is refused at once
(retry later) instead of queueing behind the read. What they read is checked where it is opened
(`apply.checkpoint`): a file that is not a regular, valid safetensors file is a typed refusal
(`BadCheckpointError`, HTTP 422), never a 500 and never a read that blocks.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Literal

import structlog

from refit_protocol.receiver_api import (
    ApplyProgress,
    AuditRequest,
    AuditResponse,
    CommitNotice,
    FlushRequest,
    FlushResponse,
    GateRequest,
    PrepareRequest,
    PrepareResponse,
    PrewarmRequest,
    PrewarmResponse,
    RankAudit,
    ReceiverStatus,
    RelayFlushRequest,
    RelayFlushResponse,
    RestoreRequest,
    StopResponse,
)
from refit_sidecar.apply.checkpoint import CheckpointError
from refit_sidecar.apply.errors import ScratchAllocationError
from refit_sidecar.codec.dtypes import dtype_from_name
from refit_sidecar.codec.errors import SchemaError
from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.receiver import flush
from refit_sidecar.receiver.absence import (
    CoordinatorContact,
    Held,
    may_release,
    release_message,
    stranded,
)
from refit_sidecar.receiver.admission import gate_refusal, prepare_refusal
from refit_sidecar.receiver.apply_loop import run_apply_loop
from refit_sidecar.receiver.config import ReceiverConfig
from refit_sidecar.receiver.errors import (
    BadCheckpointError,
    BadRequestError,
    ObsoleteAttemptError,
    ReceiverError,
    UnknownAttemptError,
)
from refit_sidecar.receiver.intake import Intake
from refit_sidecar.receiver.node_state import NodeState
from refit_sidecar.receiver.state import ACTIVE, AttemptState, Phase
from refit_sidecar.transport.inbound import Inbound

log = structlog.get_logger("kuberefit.receiver")
_GATE_ERRORS = {
    "obsolete": ObsoleteAttemptError,
    "unknown_attempt": UnknownAttemptError,
    "conflict": ReceiverError,
}
#: How often a call waiting for the control lock looks whether a checkpoint read holds it.
_BUSY_POLL_S = 0.05


class ReceiverControl:
    """The control calls of one node (thread-safe; the HTTP plane runs them on a pool)."""

    def __init__(
        self,
        node: NodeState,
        intake: Intake,
        config: ReceiverConfig,
        inbounds: list[Inbound] | None = None,
    ) -> None:
        self.state = node
        self.intake = intake
        self.config = config
        #: The node's transports' receiving sides (shared with `ReceiverCore`, which makes them).
        self.inbounds: list[Inbound] = inbounds if inbounds is not None else []
        # Serializes prepare/stop/cleanup/gate/commit/prewarm; reentrant for restore.
        self._lock = threading.RLock()
        # What holds the lock to read a checkpoint ("an audit of v3 against DIR"), else None.
        self._reading: str | None = None
        #: Calls from a coordinator (the HTTP plane marks them; `absence`).
        self.contact = CoordinatorContact()

    @contextlib.contextmanager
    def _unless_reading(self) -> Iterator[str | None]:
        """Hold the control lock, yielding None; or, while a checkpoint read holds it, yield
        what is reading without taking it (the caller refuses at once: the read may last
        minutes). Other holders are short, and are waited for."""
        while not self._lock.acquire(timeout=_BUSY_POLL_S):
            reading = self._reading
            if reading is not None:
                yield reading
                return
        try:
            yield None
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def _read_checkpoint(self, reading: str, failed: str) -> Iterator[None]:
        """Mark the lock as held by a checkpoint read (`reading`) for its duration, and turn
        every failure of the read into a typed refusal starting with `failed`: a bad checkpoint
        is a 422 naming the file and why, anything else the runtime's loader raised a 409
        (never a 500)."""
        self._reading = reading
        try:
            yield
        except CheckpointError as exc:
            raise BadCheckpointError(f"{failed}: {exc}") from exc
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            log.warning("receiver.checkpoint_read_failed", node=self.state.node, error=error)
            raise ReceiverError(f"{failed}: {error}") from exc
        finally:
            self._reading = None

    # -- join: prewarm and dense restore --------------------------------------------------------
    def _server_role(self) -> Literal["leader", "host"] | None:
        if self.config.server is None:
            return None
        return "host" if self.config.applier.server_host else "leader"

    def progress(self) -> ApplyProgress:
        """The current attempt's apply count, for the other hosts of this node's server."""
        s = self.state
        with s.cond:
            st = s.current
            return ApplyProgress(
                node=s.node,
                attempt=st.attempt if st else None,
                phase=(st.phase if st else Phase.IDLE).value,
                applied=st.applied if st else 0,
            )

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
                gate_released=s.gate_released,
                server=self.config.server,
                server_role=self._server_role(),
            )

    # -- operator absence (`absence`) ------------------------------------------------------------
    def _held(self) -> Held:
        s = self.state
        st = s.current
        return Held(s.gate_closed, s.held_version, s.dirty, st.attempt if st else None)

    def release_stale_gate(self) -> str | None:
        """Reopen a gate closed by an attempt that wrote nothing once no coordinator called for
        `gate_release_s` (the attempt is retired: a returning coordinator retries it). Returns
        what the node says, or None when nothing was done. Skipped while a control call holds
        the lock (something is happening)."""
        s, limit = self.state, self.config.gate_release_s
        silent = self.contact.silent_for()
        if not self._lock.acquire(blocking=False):
            return None
        try:
            with s.cond:
                held = self._held()
                if not may_release(held, silent, limit):
                    return None
                if s.current is not None and s.current.phase in ACTIVE:
                    s.retire(s.current, f"no coordinator call for {silent:.0f} s")
            self._set_gate(closed=False)
            message = release_message(held, silent)
            with s.cond:
                s.gate_released = message
            s.metrics.gate_releases.inc()
            log.warning("receiver.gate_released", node=s.node, attempt=held.attempt, why=message)
            return message
        finally:
            self._lock.release()

    def absence(self) -> tuple[bool, str] | None:
        """The readiness line of operator absence: (False, why) for a node holding partial
        writes that no coordinator attends to, (True, what happened) after a gate release,
        None otherwise."""
        s = self.state
        with s.cond:
            held, released = self._held(), s.gate_released
        why = stranded(held, self.contact.silent_for(), self.config.gate_release_s)
        if why is not None:
            return False, why
        if released is not None:
            return True, released
        return None

    def prewarmed(self) -> PrewarmResponse | None:
        """The last prewarm's answer, without asking the runtime again (None if never
        prewarmed): a coordinator that restarted relearns the loaders' classification."""
        with self.state.cond:
            return self.state.prewarmed if self.state.metas else None

    def prewarm(self, req: PrewarmRequest) -> PrewarmResponse:
        s = self.state
        metas: dict[str, TensorMeta] = {}
        for m in req.metas:
            try:
                dtype = dtype_from_name(m.dtype)
            except SchemaError as exc:
                raise BadRequestError(f"{m.name}: {exc}") from exc
            if m.name in metas:
                raise BadRequestError(f"{m.name}: listed twice")
            metas[m.name] = TensorMeta(m.name, tuple(m.shape), dtype)
        with self._lock:
            with s.cond:
                if s.current is not None and s.current.phase in ACTIVE:
                    if metas == s.metas and s.prewarmed is not None:
                        return s.prewarmed  # e.g. a new coordinator taking over
                    raise ReceiverError(f"attempt {s.current.attempt} is in progress")
            try:
                ranks = s.applier.prewarm(metas)
            except ScratchAllocationError as exc:
                # A declared tensor the loader takes is too large for this device: refused,
                # the node keeps its previous classification.
                raise BadRequestError(str(exc)) from exc
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
        with self._unless_reading() as reading:
            if reading is not None:
                raise ReceiverError(f"{reading} is in progress; retry when it has finished")
            with s.cond:
                if s.current is not None and s.current.phase in ACTIVE:
                    raise ReceiverError(f"attempt {s.current.attempt} is in progress")
                s.held_version = None
                s.set_held_metric()
            log.info("receiver.restoring", node=s.node, version=req.version, source=req.source)
            self._set_gate(closed=True)
            with self._read_checkpoint(
                f"a dense restore of v{req.version} from {req.source}",
                f"dense restore from {req.source} failed",
            ):
                loaded = s.applier.restore(req.source)
            missing = [] if loaded is None else sorted({m.name for m in req.metas} - loaded)
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

    def audit(self, req: AuditRequest) -> AuditResponse:
        """Prove the node holds exactly a dense load of `req.checkpoint` (`apply.audit`).

        The node holds its version while it verifies: the audit runs under the control lock,
        so a prepare arriving meanwhile is refused (retry); an attempt already in progress
        refuses the audit. A mismatch means unknown bits: the node then holds no known version
        and closes its gate, so it is restored densely before it serves or takes the next one.
        A checkpoint that cannot be read is a `BadCheckpointError` (422) and changes nothing."""
        s = self.state
        t0 = time.perf_counter()
        with self._unless_reading() as reading:
            if reading is not None:
                raise ReceiverError(f"{reading} is in progress; retry when it has finished")
            with s.cond:
                cur = s.current
                if cur is not None and (
                    cur.phase in ACTIVE or any(t.is_alive() for t in cur.threads)
                ):
                    raise ReceiverError(f"attempt {cur.attempt} is in progress")
                # Partial writes since the held version (a failed attempt awaiting its
                # overwrite retry, or flushed but not yet committed): not that version.
                held = None if s.dirty else s.held_version
            if held == req.version and self.config.applier.server_host:
                return AuditResponse(
                    node=s.node,
                    version=req.version,
                    held_version=held,
                    version_moved=False,
                    ok=True,
                    seconds=time.perf_counter() - t0,
                    audited_by_leader=True,
                )
            if held != req.version:
                return AuditResponse(
                    node=s.node,
                    version=req.version,
                    held_version=held,
                    version_moved=True,
                    ok=False,
                    seconds=time.perf_counter() - t0,
                )
            with self._read_checkpoint(
                f"an audit of v{req.version} against {req.checkpoint}",
                f"audit against {req.checkpoint} failed",
            ):
                ranks = [RankAudit.model_validate(r) for r in s.applier.audit(req.checkpoint)]
            ok = bool(ranks) and all(r.ok for r in ranks)
            if not ok:
                log.error(
                    "receiver.audit_mismatch",
                    node=s.node,
                    version=req.version,
                    tensors=sorted({m.name for r in ranks for m in r.mismatches})[:10],
                )
                with s.cond:
                    s.held_version = None  # unknown bits: restored densely before serving
                    s.set_held_metric()
                self._set_gate(closed=True)
            return AuditResponse(
                node=s.node,
                version=req.version,
                held_version=s.held_version,
                version_moved=False,
                ok=ok,
                seconds=time.perf_counter() - t0,
                ranks=ranks,
            )

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
        with self._unless_reading() as reading:
            if reading is not None:
                return self._prepared(
                    False, f"{reading} is in progress; retry when it has finished"
                )
            with s.cond:
                cur = s.current
                if cur is not None and cur.attempt == req.attempt:
                    if cur.request == req and not cur.stopping:
                        return self._prepared(True)
                    return self._prepared(False, "attempt id already used on this node")
                reason = prepare_refusal(
                    req,
                    obsolete=s.obsolete,
                    prewarmed=bool(s.metas),
                    held_version=s.held_version,
                    dirty=s.dirty,
                ) or next((r for ib in self.inbounds if (r := ib.refusal(req))), "")
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
            if cur is not None:
                for ib in self.inbounds:
                    ib.abort(cur.attempt)
                    ib.forget(cur.attempt)
            quota = max(1, self.config.queue_capacity // len(set(req.producers)))
            st = AttemptState(
                req,
                quota=quota,
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
                s.gate_released = None
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
            st = s.require(attempt)
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
        """Arrival barrier of the attempt's delivery (`flush.relay_flush`)."""
        return flush.relay_flush(self.state, self.inbounds, req, self.config.relay_flush_timeout_s)

    def flush(self, req: FlushRequest) -> FlushResponse:
        """Close the attempt: the completion ACK (`flush.flush`)."""
        return flush.flush(self.state, req, self.config.flush_timeout_s)

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
            for ib in self.inbounds:
                ib.abort(attempt)
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
            for ib in self.inbounds:
                ib.forget(attempt)
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
            s.metrics.last_commit_version.set(notice.version)
            s.metrics.last_commit_time.set(time.time())
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


def _join(threads: list[threading.Thread], timeout: float) -> bool:
    """Join every thread within one shared deadline; True when none is left running."""
    deadline = time.monotonic() + timeout
    for th in threads:
        if th is not threading.current_thread():
            th.join(max(deadline - time.monotonic(), 0.0))
    return not any(th.is_alive() for th in threads)
