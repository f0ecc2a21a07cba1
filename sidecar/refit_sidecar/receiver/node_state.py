"""What one rollout node holds, shared by its parts under one condition variable.

The control state machine (`control`), the intake (`intake`) and the apply loop (`apply_loop`)
all read and change the same few things: the version the node's bits are, whether partial
writes happened since, the canonical metadata and its loader classification, the current
attempt, the ids of replaced attempts. They live here, with the changes every part makes the
same way (fail an attempt, retire it, drop a payload, settle a refusal), each called with
`cond` held. Applier calls (which may block) are never made under it, except `discard`.
"""

from __future__ import annotations

import threading

import structlog

from refit_protocol.receiver_api import PrewarmResponse
from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.receiver.admission import Refusal
from refit_sidecar.receiver.appliers.base import Applier
from refit_sidecar.receiver.errors import ObsoleteAttemptError, UnknownAttemptError
from refit_sidecar.receiver.metrics import ReceiverMetrics
from refit_sidecar.receiver.state import AttemptState, Entry, EntryState, ObsoleteSet, Phase
from refit_sidecar.transport.relay.frames import Verdict

log = structlog.get_logger("kuberefit.receiver")


class NodeState:
    """The node's shared state; every attribute is guarded by `cond` unless said otherwise."""

    def __init__(
        self, node: str, held_version: int | None, applier: Applier, metrics: ReceiverMetrics
    ) -> None:
        self.node = node
        self.applier = applier  # immutable reference; its calls are made outside `cond`
        self.metrics = metrics
        self.cond = threading.Condition()
        self.held_version = held_version
        self.dirty = False  # partial writes since held_version
        self._gate_closed = False
        self.metas: dict[str, TensorMeta] = {}
        self.xor_incompatible: frozenset[str] = frozenset()
        self.unsupported: dict[str, str] = {}
        self.prewarmed: PrewarmResponse | None = None  # the last prewarm's classification
        self.current: AttemptState | None = None
        self.obsolete = ObsoleteSet()
        self.dropped = 0
        #: Why the gate was reopened without a coordinator (`absence`), until the next prepare.
        self.gate_released: str | None = None
        self.set_held_metric()

    @property
    def gate_closed(self) -> bool:
        """Whether the runtime's request gate is closed (mirrored in the gate metric)."""
        return self._gate_closed

    @gate_closed.setter
    def gate_closed(self, closed: bool) -> None:
        self._gate_closed = closed
        self.metrics.gate_closed.set(1 if closed else 0)

    def require(self, attempt: str) -> AttemptState:
        """The current attempt if it is `attempt`; else a typed refusal (under `cond`)."""
        st = self.current
        if st is not None and st.attempt == attempt:
            return st
        if attempt in self.obsolete:
            raise ObsoleteAttemptError(f"attempt {attempt} is obsolete on this node")
        raise UnknownAttemptError(f"attempt {attempt} was not prepared on this node")

    def is_live(self, st: AttemptState) -> bool:
        """`st` is still the current attempt and neither stopping nor failed."""
        return st is self.current and not st.stopping and not st.failed

    # -- what every part changes the same way (under `cond`) ----------------------------------
    def settle(self, refusal: Refusal) -> Verdict:
        """Apply a refusal's side effects (metric, drop count, failing the attempt) and return
        the answer for the sender."""
        if refusal.drop is not None:
            self.count_drop(refusal.drop)
        else:
            self.metrics.payloads.labels(refusal.outcome).inc()
        if refusal.fails_attempt and self.current is not None:
            self.fail(self.current, refusal.reason)
        return (refusal.status, refusal.reason)

    def fail(self, st: AttemptState, reason: str) -> None:
        """The attempt fails on this node: nothing more is applied for it."""
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
        self.drop_queued(st, "failed")
        self.cond.notify_all()

    def retire(self, st: AttemptState, reason: str) -> None:
        """Obsolete or stop an attempt: drop what is queued, refuse the rest."""
        if not st.stopping:
            self.metrics.attempts.labels("stopped").inc()
        st.stopping = True
        if st.phase is not Phase.FLUSHED:
            st.phase = Phase.STOPPED
        self.obsolete.add(st.attempt)
        self.drop_queued(st, "replaced")
        log.info("receiver.retired", node=self.node, attempt=st.attempt, reason=reason)
        self.cond.notify_all()

    def drop_queued(self, st: AttemptState, reason: str) -> None:
        for entry in list(st.ready.values()):
            self.drop(entry, reason)
        st.ready.clear()
        for entry in st.entries.values():
            if entry.state is EntryState.STAGED:
                self.drop(entry, reason)
        st.compressed_bytes = 0
        self.gauges(st)

    def drop(self, entry: Entry, reason: str | None = "replaced") -> None:
        """Forget a payload that will not be applied (`reason` None: not counted)."""
        if entry.state in (EntryState.APPLIED, EntryState.DROPPED, EntryState.APPLYING):
            return
        if entry.staged is not None:
            self.applier.discard(entry.staged)
        entry.staged = None
        entry.body = entry.keep = None
        entry.state = EntryState.DROPPED
        if reason is not None:
            self.count_drop(reason)

    def count_drop(self, reason: str) -> None:
        self.dropped += 1
        self.metrics.dropped.labels(reason).inc()

    def gauges(self, st: AttemptState) -> None:
        self.metrics.queue_depth.set(len(st.ready))
        self.metrics.staged_bytes.set(st.compressed_bytes)

    def set_held_metric(self) -> None:
        self.metrics.held_version.set(-1 if self.held_version is None else self.held_version)
