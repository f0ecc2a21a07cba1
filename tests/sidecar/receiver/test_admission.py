"""The receiver's admission verdicts, one rule at a time, as pure functions of what a node knows
(no lock, no thread, no I/O): every refusal path is taken once, and what it does (answer,
metric, failing the attempt) is what the rule says."""

from __future__ import annotations

import pytest

from refit_protocol.receiver_api import PrepareRequest
from refit_sidecar.receiver.admission import (
    Refusal,
    attempt_refusal,
    gate_refusal,
    offer_refusal,
    prepare_refusal,
)
from refit_sidecar.receiver.state import AttemptState, ObsoleteSet, Phase
from refit_sidecar.transport.inbound import PayloadIdent
from refit_sidecar.transport.relay.frames import AckStatus

DIGEST = bytes(range(16))


def request(**kw: object) -> PrepareRequest:
    fields: dict[str, object] = {
        "attempt": "a1",
        "from_version": 3,
        "target_version": 4,
        "mode": "mixed",
        "producers": [0, 1],
    }
    fields.update(kw)
    return PrepareRequest.model_validate(fields)


def attempt(**kw: object) -> AttemptState:
    quota = kw.pop("quota", 2)
    return AttemptState(request(**kw), quota=quota, check_samples=0)  # type: ignore[arg-type]


def ident(producer: int = 0, payload_id: int = 0, order: int = 0, **kw: object) -> PayloadIdent:
    digest = kw.get("digest", DIGEST)
    size = kw.get("size", 100)
    return PayloadIdent("a1", producer, payload_id, order, digest, size)  # type: ignore[arg-type]


def offer(st: AttemptState | None, i: PayloadIdent, cap: int = 1 << 30):  # type: ignore[no-untyped-def]
    return offer_refusal(st, ObsoleteSet(), i, node="n0", async_staging_max_bytes=cap)


# -- prepare ------------------------------------------------------------------------------------
def admit(req: PrepareRequest, **kw: object) -> str:
    state: dict[str, object] = {
        "obsolete": ObsoleteSet(),
        "prewarmed": True,
        "held_version": 3,
        "dirty": False,
    }
    state.update(kw)
    return prepare_refusal(req, **state)  # type: ignore[arg-type]


def test_prepare_admits_a_clean_node_on_the_base_version() -> None:
    assert admit(request()) == ""
    assert admit(request(mode="overwrite"), dirty=True) == ""  # overwrite repairs partial writes


@pytest.mark.parametrize(
    ("req", "state", "reason"),
    [
        (
            {},
            {"prewarmed": False},
            "not prewarmed: call /v1/prewarm with the canonical metadata first",
        ),
        ({"producers": []}, {}, "producers must be a non-empty list of distinct ids"),
        ({"producers": [1, 1]}, {}, "producers must be a non-empty list of distinct ids"),
        ({"producers": [-1]}, {}, "producer ids must be >= 0"),
        ({"target_version": 3}, {}, "target v3 is not after v3"),
        ({}, {"held_version": None}, "holds no known version (a dense restore is needed)"),
        (
            {},
            {"held_version": 2},
            "holds v2, the mixed attempt starts from v3 (a dense restore is needed)",
        ),
        (
            {"mode": "overwrite"},
            {"held_version": 2},
            "holds v2, the overwrite attempt starts from v3 (a dense restore is needed)",
        ),
        (
            {},
            {"dirty": True},
            "partial writes since v3: only an overwrite attempt is admissible",
        ),
    ],
)
def test_prepare_refusals(req: dict[str, object], state: dict[str, object], reason: str) -> None:
    """The whole message: it is what the coordinator reports for the node."""
    assert admit(request(**req), **state) == reason


def test_an_obsolete_attempt_is_never_admitted_again() -> None:
    obsolete = ObsoleteSet()
    obsolete.add("a1")
    assert admit(request(), obsolete=obsolete) == "attempt a1 is obsolete on this node"


# -- payload offers -------------------------------------------------------------------------
def test_a_new_payload_of_the_live_attempt_is_taken() -> None:
    assert offer(attempt(), ident()) is None


def test_unknown_obsolete_failed_and_stopped_attempts() -> None:
    # Whole verdicts, messages included: they are what the producer and the logs are told.
    assert attempt_refusal(None, ObsoleteSet(), "a1", "n0") == Refusal(
        AckStatus.UNKNOWN_ATTEMPT, "attempt a1 is not prepared here", outcome="unknown_attempt"
    )
    obsolete = ObsoleteSet()
    obsolete.add("a0")
    assert attempt_refusal(attempt(), obsolete, "a0", "n0") == Refusal(
        AckStatus.OBSOLETE, "attempt a0 was replaced by a later prepare", drop="obsolete"
    )
    failed = attempt()
    failed.failed, failed.errors = True, ["digest mismatch", "later"]
    assert offer(failed, ident()) == Refusal(  # already failed: nothing more to do
        AckStatus.REJECTED, "attempt failed on n0: digest mismatch", outcome="rejected"
    )
    stopped = attempt()
    stopped.stopping = True
    assert offer(stopped, ident()) == Refusal(
        AckStatus.OBSOLETE, "attempt a1 was stopped", drop="stopped"
    )


def test_a_duplicate_is_acknowledged_again_without_harm() -> None:
    st = attempt()
    st.register(ident(), 0)
    assert offer(st, ident()) == Refusal(AckStatus.DUPLICATE, "", outcome="duplicate")


@pytest.mark.parametrize(
    ("registered", "offered", "reason"),
    [
        (None, ident(producer=7), "producer 7 is not part of the attempt"),
        (ident(), ident(digest=bytes(16)), "payload 0/0 (order 0) reused with other bytes"),
        (ident(), ident(order=1), "payload 0/0 (order 1) reused with other bytes"),
        (
            ident(payload_id=0, order=0),
            ident(payload_id=1, order=0),
            "payload 0/1 (order 0): order already taken by another payload",
        ),
    ],
)
def test_offers_that_fail_the_attempt(
    registered: PayloadIdent | None, offered: PayloadIdent, reason: str
) -> None:
    st = attempt()
    if registered is not None:
        st.register(registered, 0)
    assert offer(st, offered) == Refusal(
        AckStatus.REJECTED, reason, outcome="rejected", fails_attempt=True
    )


def test_an_order_beyond_the_announced_total_fails_the_attempt() -> None:
    st = attempt()
    assert st.set_total(0, 2) is None
    assert offer(st, ident(payload_id=5, order=2)) == Refusal(
        AckStatus.REJECTED,
        "payload 0/5 (order 2) beyond the producer's total 2",
        outcome="rejected",
        fails_attempt=True,
    )
    assert offer(st, ident(payload_id=5, order=1)) is None


def test_async_staging_beyond_its_byte_cap_fails_the_attempt() -> None:
    st = attempt(sync=False)
    st.compressed_bytes = 900
    assert offer(st, ident(size=100), cap=1000) is None
    assert offer(st, ident(size=101), cap=1000) == Refusal(
        AckStatus.REJECTED,
        "async staging would exceed 1000 bytes (raise async_staging_max_bytes or use sync mode)",
        outcome="rejected",
        fails_attempt=True,
    )
    assert offer(attempt(sync=True), ident(size=10**9), cap=1000) is None  # sync: not staged


def test_a_full_quota_waits_except_for_the_lowest_unreleased_order() -> None:
    st = attempt(quota=2)
    st.register(ident(payload_id=1, order=1), 0)
    st.register(ident(payload_id=2, order=2), 0)
    assert offer(st, ident(payload_id=3, order=3)) == Refusal(
        AckStatus.WAIT, "queue full", outcome="wait"
    )
    assert offer(st, ident(payload_id=0, order=0)) is None  # the reserved slot: no deadlock


# -- gate ---------------------------------------------------------------------------------------
def test_gate_requests() -> None:
    obsolete = ObsoleteSet()
    obsolete.add("a0")
    st = attempt()
    assert gate_refusal(st, obsolete, "a1", closed=True) is None
    assert gate_refusal(st, obsolete, "a1", closed=False) is None  # nothing applied yet
    assert gate_refusal(st, obsolete, "a0", closed=True) == (
        "obsolete",
        "attempt a0 is obsolete on this node",
    )
    assert gate_refusal(st, obsolete, "a2", closed=True) == (
        "unknown_attempt",
        "attempt a2 is not this node's attempt",
    )
    st.opened = True
    assert gate_refusal(st, obsolete, "a1", closed=False) == (
        "conflict",
        "attempt a1 is applying: the gate stays closed until it is flushed or stopped",
    )
    st.phase = Phase.FLUSHED
    assert gate_refusal(st, obsolete, "a1", closed=False) is None  # flushed: may reopen
