"""❺ intake: payloads in, checked, deduplicated and staged for the apply queue.

The one transport-neutral sink (`transport.inbound.PayloadSink`) every transport's inbound
delivers into: the relay-tree node claims and stages a received frame at once, the S3 inbound
claims a manifest entry, downloads it and stages the bytes. Nothing here knows how bytes
travelled or how they are applied.

Threads: payloads are validated and decoded on a small staging pool; in async RL one decoder
thread (`decode_loop`, started by open_apply) feeds the queue from the compressed staging area
in declared order. Verdicts are `admission`'s; shared state is the node's (`NodeState`),
changed only with its condition held.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog

from refit_protocol.keys import payload_mac_key
from refit_protocol.kit.tokens import TokenRing
from refit_protocol.receiver_api import PrepareRequest
from refit_sidecar.codec.decode import raw_bound, verify_mac
from refit_sidecar.codec.errors import CodecError, DigestMismatch
from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.codec.wire import body_digest
from refit_sidecar.receiver.admission import attempt_refusal, offer_refusal
from refit_sidecar.receiver.appliers.base import StagedPayload
from refit_sidecar.receiver.config import ReceiverConfig
from refit_sidecar.receiver.errors import ReceptionError
from refit_sidecar.receiver.node_state import NodeState
from refit_sidecar.receiver.state import AttemptState, Entry, EntryState
from refit_sidecar.receiver.validate import check_identity, decode_and_stage
from refit_sidecar.transport.inbound import AckStatus, Claim, PayloadIdent, Verdict

log = structlog.get_logger("kuberefit.receiver")


class Intake:
    """One node's payload intake: the `PayloadSink` of every inbound on the node."""

    def __init__(self, node: NodeState, config: ReceiverConfig) -> None:
        self.state = node
        self.node = node.node  # the name in every answer
        self.config = config
        #: The node's token(s) (set by `ReceiverNode`): payloads must carry a MAC made with the
        #: key of an accepted token. Without a token (in-process tests) any payload is taken.
        self.tokens: TokenRing = TokenRing(None)
        self._raw_bound: tuple[Mapping[str, TensorMeta], int] | None = None
        self._stage_pool = ThreadPoolExecutor(config.staging_workers, "refit-stage")

    def mac_keys(self) -> list[bytes]:
        """The payload MAC keys accepted now (the sending token's first)."""
        return [payload_mac_key(t) for t in self.tokens.accepted()]

    def close(self) -> None:
        self._stage_pool.shutdown(wait=False, cancel_futures=True)

    # -- offers ---------------------------------------------------------------------------------
    def _offer(self, ident: PayloadIdent) -> Verdict | AttemptState:
        """The verdict on a payload offer, or the attempt that takes it (under the lock)."""
        s = self.state
        refusal = offer_refusal(
            s.current,
            s.obsolete,
            ident,
            node=s.node,
            async_staging_max_bytes=self.config.async_staging_max_bytes,
        )
        if refusal is not None:
            return s.settle(refusal)
        assert s.current is not None
        return s.current

    # -- PayloadSink --------------------------------------------------------------------------
    def attempt_request(self, attempt: str) -> PrepareRequest | None:
        with self.state.cond:
            st = self.state.current
            return st.request if st is not None and st.attempt == attempt else None

    def check(self, ident: PayloadIdent, *, probe: bool) -> Verdict | None:
        with self.state.cond:
            offer = self._offer(ident)
        if isinstance(offer, tuple):
            return offer
        return (AckStatus.READY, "") if probe else None

    def claim(self, ident: PayloadIdent, *, forwards: int = 0) -> Verdict | Claim:
        with self.state.cond:
            offer = self._offer(ident)
            if isinstance(offer, tuple):
                return offer
            entry = offer.register(ident, forwards)
            self.state.metrics.payloads.labels("staged").inc()
        return _Claim(ident, offer, entry)

    def stage(
        self, claim: Claim, body: bytes | memoryview, *, verified: bool, keep: object = None
    ) -> None:
        c = _own(claim)
        if keep is not None:
            with self.state.cond:
                c.entry.keep = keep
        self._stage_pool.submit(self._stage_local, c.attempt, c.entry, body, verified=verified)

    def live(self, claim: Claim) -> bool:
        with self.state.cond:
            return self.state.is_live(_own(claim).attempt)

    def withdraw(self, claim: Claim, reason: str | None) -> None:
        c = _own(claim)
        with self.state.cond:
            if reason is None or not self.state.is_live(c.attempt):
                self.state.drop(c.entry)
            else:
                self.state.fail(c.attempt, f"payload {c.ident.label()}: {reason}")

    def forwarded(self, ident: PayloadIdent, error: str | None) -> None:
        with self.state.cond:
            st = self.state.current
            if st is None or st.attempt != ident.attempt:
                return
            entry = st.entries.get((ident.producer, ident.payload_id))
            if entry is not None:
                st.release(entry)
            self.state.cond.notify_all()

    def end(self, attempt: str, producer: int, total: int) -> Verdict:
        s = self.state
        with s.cond:
            refusal = attempt_refusal(s.current, s.obsolete, attempt, s.node)
            if refusal is not None:
                return s.settle(refusal)
            st = s.current
            assert st is not None
            err = st.set_total(producer, total)
            if err:
                s.fail(st, err)
                return (AckStatus.REJECTED, err)
            s.cond.notify_all()
            return (AckStatus.STAGED, "")

    def fail(self, attempt: str, reason: str) -> None:
        with self.state.cond:
            st = self.state.current
            if st is not None and st.attempt == attempt:
                self.state.fail(st, reason)

    # -- staging --------------------------------------------------------------------------------
    def _stage_local(
        self, st: AttemptState, entry: Entry, body: bytes | memoryview, *, verified: bool
    ) -> None:
        """Validate one registered payload; sync RL: decode and queue it for the apply loop,
        async RL: keep its compressed bytes until the gate closes (staging pool thread).
        `verified`: the inbound already checked the bytes' identity, size and MAC or digest
        against what was announced (the relay's `verify_body`); otherwise they are checked
        here."""
        s = self.state
        ident = entry.ident
        try:
            if not verified:
                check_identity(body, ident)
            if st.sync:
                t0 = time.perf_counter()
                staged = self._decode(body, ident, hashed=verified)
                with s.cond:
                    st.timings["decode_s"] += time.perf_counter() - t0
                    st.pending_local -= 1
                    self._ready(st, entry, staged, (ident.order, ident.producer))
                return
            if not verified:
                # Bytes held until the gate closes are authenticated first.
                keys = self.mac_keys()
                if keys:
                    verify_mac(body, keys)
                if body_digest(body) != ident.digest:
                    raise DigestMismatch("payload body does not match the manifest digest")
            with s.cond:
                st.pending_local -= 1
                if not s.is_live(st):
                    s.drop(entry)
                    return
                entry.body, entry.state = body, EntryState.STAGED
                st.compressed_bytes += ident.size
                st.release_local(entry)
                s.gauges(st)
                s.cond.notify_all()
        except Exception as exc:
            if not isinstance(exc, CodecError | ReceptionError):
                log.exception("receiver.stage_failed", node=s.node, payload=ident.label())
            with s.cond:
                s.fail(st, _failure(ident, exc, "staging"))

    def decode_loop(self, st: AttemptState) -> None:
        """Async RL: feed the bounded queue from compressed staging, in declared order."""
        s = self.state
        cap = self.config.queue_capacity
        while True:
            with s.cond:
                while True:
                    if not s.is_live(st):
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
                    s.cond.wait(1.0)
                st.decode_cursor[key[1]] = key[0] + 1
                st.decoding += 1
                body = entry.body
            assert body is not None
            t0 = time.perf_counter()
            try:
                staged = self._decode(body, entry.ident, hashed=True)  # hashed when staged
            except Exception as exc:
                with s.cond:
                    st.decoding -= 1
                    s.fail(st, _failure(entry.ident, exc, "decode"))
                return
            with s.cond:
                st.decoding -= 1
                st.timings["decode_s"] += time.perf_counter() - t0
                st.compressed_bytes -= entry.ident.size
                entry.body = entry.keep = None
                if not self._ready(st, entry, staged, key):
                    return

    def _decode(
        self, body: bytes | memoryview, ident: PayloadIdent, *, hashed: bool
    ) -> StagedPayload:
        s = self.state
        with s.cond:  # a consistent snapshot of the prewarm classification
            metas, xor_incompatible, unsupported = s.metas, s.xor_incompatible, s.unsupported
        bound = self._raw_bound
        if bound is None or bound[0] is not metas:  # once per prewarm, not per payload
            bound = self._raw_bound = (metas, raw_bound(metas))
        return decode_and_stage(
            body,
            ident,
            metas=metas,
            xor_incompatible=xor_incompatible,
            unsupported=unsupported,
            applier=s.applier,
            hashed=hashed,
            mac_key=self.mac_keys(),
            raw_limit=bound[1],
        )

    def _ready(
        self, st: AttemptState, entry: Entry, staged: StagedPayload, key: tuple[int, int]
    ) -> bool:
        """Queue a staged payload for the apply loop (under the lock); False (and the payload
        discarded) when its attempt is no longer live."""
        s = self.state
        if not s.is_live(st):
            s.applier.discard(staged)
            s.drop(entry)
            return False
        entry.staged, entry.state, entry.keep = staged, EntryState.READY, None
        st.ready[key] = entry
        s.gauges(st)
        s.cond.notify_all()
        return True


def _failure(ident: PayloadIdent, exc: Exception, doing: str) -> str:
    """Why a payload fails its attempt: the check it failed, or the unexpected error."""
    if isinstance(exc, CodecError | ReceptionError):
        return f"payload {ident.label()}: {type(exc).__name__}: {exc}"
    return f"payload {ident.label()}: {doing} failed: {exc!r}"


@dataclass(frozen=True)
class _Claim:
    """A registered payload: its identity, the attempt that took it and its entry there."""

    ident: PayloadIdent
    attempt: AttemptState
    entry: Entry


def _own(claim: Claim) -> _Claim:
    if not isinstance(claim, _Claim):
        raise TypeError(f"not a claim of this intake: {claim!r}")
    return claim
