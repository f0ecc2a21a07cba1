"""Admission verdicts (paper ❺, Appendix B.1): pure functions of what a node knows.

Whether a prepare can be admitted, and what to answer a payload offer (a relay frame, a probe,
an S3 manifest entry), are decided here without I/O, locks or side effects, so every rule can be
read and tested on its own. The caller holds the node's lock, passes what it read, and applies
the verdict (`NodeState.settle`).
"""

from __future__ import annotations

from dataclasses import dataclass

from refit_protocol.receiver_api import PrepareRequest
from refit_sidecar.receiver.state import ACTIVE, AttemptState, ObsoleteSet
from refit_sidecar.transport.inbound import AckStatus, PayloadIdent


@dataclass(frozen=True)
class Refusal:
    """A payload offer that is not taken, and what the node does about it."""

    status: AckStatus
    reason: str
    outcome: str = ""  # label of kuberefit_receiver_payloads
    drop: str | None = None  # instead: counted as a payload dropped for this reason
    fails_attempt: bool = False


def prepare_refusal(
    req: PrepareRequest,
    *,
    obsolete: ObsoleteSet,
    prewarmed: bool,
    held_version: int | None,
    dirty: bool,
) -> str:
    """Why `req` cannot be admitted on this node ('' if it can)."""
    if req.attempt in obsolete:
        return f"attempt {req.attempt} is obsolete on this node"
    if not prewarmed:
        return "not prewarmed: call /v1/prewarm with the canonical metadata first"
    if not req.producers or len(set(req.producers)) != len(req.producers):
        return "producers must be a non-empty list of distinct ids"
    if any(p < 0 for p in req.producers):
        return "producer ids must be >= 0"
    if req.target_version <= req.from_version:
        return f"target v{req.target_version} is not after v{req.from_version}"
    # Either mode carries only the elements changed since from_version, so it repairs a node
    # only if that node's bits are from_version (plus, for overwrite, partial writes of the
    # same transition).
    if held_version is None:
        return "holds no known version (a dense restore is needed)"
    if held_version != req.from_version:
        return (
            f"holds v{held_version}, the {req.mode} attempt starts from "
            f"v{req.from_version} (a dense restore is needed)"
        )
    if req.mode == "mixed" and dirty:
        return f"partial writes since v{held_version}: only an overwrite attempt is admissible"
    return ""


def attempt_refusal(
    current: AttemptState | None, obsolete: ObsoleteSet, attempt: str, node: str
) -> Refusal | None:
    """Refuse payloads that do not belong to the live current attempt (None: they do)."""
    if current is None or current.attempt != attempt:
        if attempt in obsolete:
            reason = f"attempt {attempt} was replaced by a later prepare"
            return Refusal(AckStatus.OBSOLETE, reason, drop="obsolete")
        reason = f"attempt {attempt} is not prepared here"
        return Refusal(AckStatus.UNKNOWN_ATTEMPT, reason, outcome="unknown_attempt")
    if current.failed:
        reason = f"attempt failed on {node}: {current.errors[0]}"
        return Refusal(AckStatus.REJECTED, reason, outcome="rejected")
    if current.stopping:
        return Refusal(AckStatus.OBSOLETE, f"attempt {attempt} was stopped", drop="stopped")
    return None


def offer_refusal(
    current: AttemptState | None,
    obsolete: ObsoleteSet,
    ident: PayloadIdent,
    *,
    node: str,
    async_staging_max_bytes: int,
) -> Refusal | None:
    """Attempt, producer, dedup, order and queue checks of one payload (None: take it).

    A duplicate (same id, digest and order) is acknowledged again; the same id with other bytes
    or another order, an order already taken, an order beyond the producer's announced total, a
    producer outside the attempt, or async staging beyond its byte cap fail the attempt; a full
    queue answers WAIT (backpressure)."""
    refusal = attempt_refusal(current, obsolete, ident.attempt, node)
    if refusal is not None or current is None:
        return refusal
    st = current
    entry = st.entries.get((ident.producer, ident.payload_id))
    reason = ""
    if ident.producer not in st.producers:
        reason = f"producer {ident.producer} is not part of the attempt"
    elif entry is not None:
        if entry.ident.digest == ident.digest and entry.ident.order == ident.order:
            return Refusal(AckStatus.DUPLICATE, "", outcome="duplicate")
        reason = f"payload {ident.label()} reused with other bytes"
    elif (ident.producer, ident.order) in st.by_order:
        reason = f"payload {ident.label()}: order already taken by another payload"
    elif ident.producer in st.totals and ident.order >= st.totals[ident.producer]:
        reason = f"payload {ident.label()} beyond the producer's total {st.totals[ident.producer]}"
    elif not st.sync and st.compressed_bytes + ident.size > async_staging_max_bytes:
        reason = (
            f"async staging would exceed {async_staging_max_bytes} bytes "
            "(raise async_staging_max_bytes or use sync mode)"
        )
    if reason:
        return Refusal(AckStatus.REJECTED, reason, outcome="rejected", fails_attempt=True)
    if not st.admissible(ident):
        return Refusal(AckStatus.WAIT, "queue full", outcome="wait")
    return None


def gate_refusal(
    current: AttemptState | None, obsolete: ObsoleteSet, attempt: str, *, closed: bool
) -> tuple[str, str] | None:
    """(kind, message) when a gate request for `attempt` must be refused; kind is "obsolete",
    "unknown_attempt" or "conflict" (an applying attempt keeps the gate closed)."""
    if attempt in obsolete:
        return ("obsolete", f"attempt {attempt} is obsolete on this node")
    if current is not None and current.attempt != attempt:
        return ("unknown_attempt", f"attempt {attempt} is not this node's attempt")
    if (
        not closed
        and current is not None
        and current.phase in ACTIVE
        and not current.stopping
        and (current.opened or current.wrote)
    ):
        return (
            "conflict",
            f"attempt {current.attempt} is applying: the gate stays closed until it is flushed "
            "or stopped",
        )
    return None
