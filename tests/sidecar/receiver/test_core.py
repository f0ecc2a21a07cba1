"""ReceiverCore in process with the real in-process applier: admission, reception checks, dedup,
declared order, quotas, async staging, flush and commit. Payloads enter through the same sink
calls the relay's inbound makes (`check`, `claim`, `stage`)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

from refit_protocol.receiver_api import (
    AuditRequest,
    CommitNotice,
    FlushRequest,
    GateRequest,
    PrepareRequest,
    PrewarmRequest,
    RelayFlushRequest,
)
from refit_sidecar.codec import CodecError
from refit_sidecar.codec.records import Op, TensorMeta
from refit_sidecar.codec.wire import EncodedPayload
from refit_sidecar.fingerprint import module_fingerprint
from refit_sidecar.receiver.config import ReceiverConfig
from refit_sidecar.receiver.core import ReceiverCore
from refit_sidecar.receiver.errors import ReceiverError
from refit_sidecar.receiver.state import EntryState
from refit_sidecar.transport.relay.frames import AckStatus, FrameMeta, verify_body
from refit_sidecar.transport.relay.inbound import ident_of
from tests.harness.operator_env import wait_for
from tests.sidecar.receiver.models import (
    RecordingApplier,
    TinyModel,
    canonical,
    fingerprint,
    metas,
    overwrite_payload,
    payloads,
    perturb,
    read_applied,
)

V0 = canonical(0)
V1 = perturb(V0, 1)


@pytest.fixture
def node(tmp_path: Path) -> ReceiverCore:
    return make_core(tmp_path)


def make_core(tmp_path: Path, **cfg: object) -> ReceiverCore:
    applier = RecordingApplier(TinyModel(V0), str(tmp_path / "applied.jsonl"))
    cfg.setdefault("held_version", 0)
    core = ReceiverCore(ReceiverConfig(node="n0", **cfg), applier)  # type: ignore[arg-type]
    core.control.prewarm(PrewarmRequest(metas=metas(V0)))
    return core


def prep(
    core: ReceiverCore,
    attempt: str,
    *,
    mode: str = "mixed",
    sync: bool = True,
    producers: tuple[int, ...] = (0,),
    open_apply: bool = True,
) -> None:
    resp = core.control.prepare(
        PrepareRequest(
            attempt=attempt,
            from_version=0,
            target_version=1,
            mode=mode,  # type: ignore[arg-type]
            sync=sync,
            producers=list(producers),
        )
    )
    assert resp.accepted, resp.reason
    if open_apply:
        core.control.gate(GateRequest(attempt=attempt, closed=True))
        core.control.open_apply(attempt)


def offer(core: ReceiverCore, p: EncodedPayload, body: bytes | None = None) -> AckStatus:
    meta = FrameMeta.of(p)
    # What a relay node does with a DATA frame: check, verify the bytes, then stage them.
    ident = ident_of(meta)
    verdict = core.intake.check(ident, probe=False)
    if verdict is not None:
        return verdict[0]
    data = memoryview(body if body is not None else p.body)
    try:
        verify_body(meta, data)
    except CodecError as exc:
        core.intake.fail(meta.attempt, f"{type(exc).__name__}: {exc}")
        return AckStatus.REJECTED
    claim = core.intake.claim(ident)
    if isinstance(claim, tuple):
        return claim[0]
    core.intake.stage(claim, data, verified=True)
    return AckStatus.STAGED


def flush(core: ReceiverCore, attempt: str, expected: dict[int, int], timeout: float = 10.0):  # type: ignore[no-untyped-def]
    return core.control.flush(FlushRequest(attempt=attempt, expected=expected, timeout_s=timeout))


def entries_in(node: ReceiverCore, *states: EntryState) -> int:
    """How many payloads of the current attempt are in one of `states` (decoded and queued:
    READY; applied: APPLIED)."""
    st = node.state.current
    with node.state.cond:
        return 0 if st is None else sum(e.state in states for e in st.entries.values())


def applied(tmp_path: Path) -> list[tuple[int, int]]:
    return [(r["producer"], r["order"]) for r in read_applied(tmp_path / "applied.jsonl")]


def test_out_of_order_arrival_is_applied_in_declared_order(
    node: ReceiverCore, tmp_path: Path
) -> None:
    prep(node, "a1", open_apply=False)
    ps = payloads("a1", 0, V0, V1)
    shuffled = ps[:]
    random.Random(3).shuffle(shuffled)
    assert [offer(node, p) for p in shuffled] == [AckStatus.STAGED] * len(ps)
    wait_for("every payload decoded", lambda: entries_in(node, EntryState.READY) == len(ps))
    assert applied(tmp_path) == []  # sync RL: nothing applies before open_apply
    node.control.gate(GateRequest(attempt="a1", closed=True))
    node.control.open_apply("a1")
    ack = flush(node, "a1", {0: len(ps)})
    assert ack.ok, ack.errors
    assert ack.applied == ack.staged == len(ps)
    assert applied(tmp_path) == [(0, i) for i in range(len(ps))]
    assert module_fingerprint(node.applier.model) == fingerprint(V1)  # type: ignore[attr-defined]


def test_two_producers_interleave_by_order_then_producer(
    node: ReceiverCore, tmp_path: Path
) -> None:
    prep(node, "a1", producers=(0, 1))
    names = list(V0)
    p0 = payloads("a1", 0, V0, V1, names=names[:3])
    p1 = payloads("a1", 1, V0, V1, names=names[3:])
    for p in [*p1[::-1], *p0]:
        assert offer(node, p) is AckStatus.STAGED
    ack = flush(node, "a1", {0: 3, 1: 5})
    assert ack.ok, ack.errors
    assert applied(tmp_path) == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (1, 3), (1, 4)]


def test_stream_end_lets_apply_finish_before_flush(node: ReceiverCore, tmp_path: Path) -> None:
    prep(node, "a1", producers=(0, 1))
    names = list(V0)
    p0 = payloads("a1", 0, V0, V1, names=names[:1])
    p1 = payloads("a1", 1, V0, V1, names=names[1:])
    for p in [*p0, *p1]:
        offer(node, p)
    wait_for("(0,0) and (1,0) applied", lambda: len(applied(tmp_path)) >= 2)
    wait_for("nothing left to decode", lambda: entries_in(node, EntryState.REGISTERED) == 0)
    assert len(applied(tmp_path)) == 2  # (0,0), (1,0); (1,1) waits for producer 0's (1,0)
    assert node.intake.end("a1", producer=0, total=1)[0] is AckStatus.STAGED
    wait_for("all 8 applied", lambda: len(applied(tmp_path)) == 8)
    extra = payloads("a1", 0, V0, V1, names=names[1:2])[0]
    late = overwrite_payload(
        "a1",
        0,
        5,
        1,
        TensorMeta("t1.weight", (4096,), torch.float32),
        V1["t1.weight"].view(torch.int32),
    )
    assert extra.header.order == 0
    assert offer(node, late) is AckStatus.REJECTED  # order 1 is beyond producer 0's total
    assert not flush(node, "a1", {0: 1, 1: 7}).ok


def test_duplicates_are_ignored_and_id_reuse_fails(node: ReceiverCore, tmp_path: Path) -> None:
    prep(node, "a1")
    ps = payloads("a1", 0, V0, V1)
    assert offer(node, ps[0]) is AckStatus.STAGED
    assert offer(node, ps[0]) is AckStatus.DUPLICATE
    for p in ps[1:]:
        offer(node, p)
    assert offer(node, ps[3]) is AckStatus.DUPLICATE
    ack = flush(node, "a1", {0: len(ps)})
    assert ack.ok
    assert ack.applied == len(ps)
    assert module_fingerprint(node.applier.model) == fingerprint(V1)  # type: ignore[attr-defined]

    # Same id, other bytes: the attempt fails before anything else is applied.
    prep(node, "a2", mode="overwrite")
    q = payloads("a2", 0, V0, V1, op=Op.OVERWRITE)
    other = payloads("a2", 0, V0, perturb(V0, 7), op=Op.OVERWRITE)
    assert offer(node, q[0]) is AckStatus.STAGED
    assert offer(node, other[0]) is AckStatus.REJECTED
    status = node.control.status()
    assert status.phase == "failed"
    assert "reused with other bytes" in status.errors[0]
    assert offer(node, q[1]) is AckStatus.REJECTED
    assert not flush(node, "a2", {0: len(q)}).ok


def test_corrupted_body_fails_the_attempt(node: ReceiverCore) -> None:
    prep(node, "a1", open_apply=False)
    p = payloads("a1", 0, V0, V1)[0]
    bad = bytearray(p.body)
    bad[-5] ^= 0xFF
    assert offer(node, p, bytes(bad)) is AckStatus.REJECTED  # the relay's digest check
    wait_for("the attempt failed", lambda: node.control.status().phase == "failed")
    status = node.control.status()
    assert status.phase == "failed"
    assert "DigestMismatch" in status.errors[0]
    assert status.applied == 0


def test_obsolete_attempt_payloads_are_dropped(node: ReceiverCore, tmp_path: Path) -> None:
    prep(node, "a1", open_apply=False)
    old = payloads("a1", 0, V0, V1)
    offer(node, old[0])
    offer(node, old[1])
    wait_for("both decoded and queued", lambda: entries_in(node, EntryState.READY) == 2)
    prep(node, "a2", mode="overwrite", open_apply=False)
    before = node.control.status().dropped
    assert offer(node, old[2]) is AckStatus.OBSOLETE
    assert node.control.status().dropped == before + 1
    assert before >= 2  # a1's queued payloads were dropped at the second prepare
    new = payloads("a2", 0, V0, V1, op=Op.OVERWRITE)
    for p in new:
        assert offer(node, p) is AckStatus.STAGED
    node.control.gate(GateRequest(attempt="a2", closed=True))
    node.control.open_apply("a2")
    assert flush(node, "a2", {0: len(new)}).ok
    assert {r["attempt"] for r in read_applied(tmp_path / "applied.jsonl")} == {"a2"}
    with pytest.raises(ReceiverError):
        node.control.open_apply("a1")


def test_admission_tracks_held_version_and_partial_writes(tmp_path: Path) -> None:
    core = make_core(tmp_path)
    bad = core.control.prepare(
        PrepareRequest(attempt="x", from_version=3, target_version=4, mode="mixed", producers=[0])
    )
    assert not bad.accepted
    assert "holds v0" in bad.reason
    prep(core, "a1")
    ps = payloads("a1", 0, V0, V1)
    for p in ps[:3]:
        offer(core, p)
    wait_for("partial writes", lambda: entries_in(core, EntryState.APPLIED) >= 1)
    # A rejected prepare leaves the running attempt alone.
    rejected = core.control.prepare(
        PrepareRequest(attempt="x2", from_version=3, target_version=4, mode="mixed", producers=[0])
    )
    assert not rejected.accepted
    assert core.control.status().attempt == "a1"
    core.control.stop("a1")
    status = core.control.status()
    assert status.dirty
    assert status.held_version is None
    # Partial writes since v0: an audit of v0 compares nothing and changes nothing.
    moved = core.control.audit(AuditRequest(checkpoint=str(tmp_path), version=0))
    assert (moved.version_moved, moved.ok, moved.held_version) == (True, False, None)
    assert core.control.status() == status
    mixed = core.control.prepare(
        PrepareRequest(attempt="a2", from_version=0, target_version=1, mode="mixed", producers=[0])
    )
    assert not mixed.accepted
    assert "only an overwrite" in mixed.reason
    prep(core, "a3", mode="overwrite")
    for p in payloads("a3", 0, V0, V1, op=Op.OVERWRITE):
        offer(core, p)
    assert flush(core, "a3", {0: 8}).ok
    with pytest.raises(ReceiverError):
        core.control.commit(CommitNotice(attempt="a3", version=2))  # not the attempt's target
    core.control.commit(CommitNotice(attempt="a3", version=1))
    status = core.control.status()
    assert status.held_version == 1
    assert not status.dirty
    assert module_fingerprint(core.applier.model) == fingerprint(V1)  # type: ignore[attr-defined]


def test_overwrite_attempts_also_need_the_base_version(tmp_path: Path) -> None:
    """An overwrite carries only the elements changed since from_version: a node with unknown
    bits, or bits of another version, cannot be repaired by it and must be restored."""
    unknown = make_core(tmp_path, held_version=None)
    assert unknown.control.status().base_version is None
    answer = unknown.control.prepare(
        PrepareRequest(
            attempt="o1", from_version=0, target_version=1, mode="overwrite", producers=[0]
        )
    )
    assert not answer.accepted
    assert "no known version" in answer.reason
    other = make_core(tmp_path)
    answer = other.control.prepare(
        PrepareRequest(
            attempt="o2", from_version=3, target_version=4, mode="overwrite", producers=[0]
        )
    )
    assert not answer.accepted
    assert "holds v0" in answer.reason
    assert other.control.status().prewarmed


def test_open_apply_needs_the_gate_closed(node: ReceiverCore) -> None:
    prep(node, "a1", open_apply=False)
    with pytest.raises(ReceiverError, match="gate is open"):
        node.control.open_apply("a1")
    node.control.gate(GateRequest(attempt="a1", closed=True))
    node.control.open_apply("a1")
    offer(node, payloads("a1", 0, V0, V1)[0])
    wait_for("applying", lambda: node.control.status().applied >= 1)
    with pytest.raises(ReceiverError, match="applying"):
        node.control.gate(GateRequest(attempt="a1", closed=False))


def test_async_mode_stages_compressed_and_applies_after_open(
    node: ReceiverCore, tmp_path: Path
) -> None:
    prep(node, "a1", sync=False, open_apply=False)
    ps = payloads("a1", 0, V0, V1)
    for p in reversed(ps):
        assert offer(node, p) is AckStatus.STAGED
    rf = node.control.relay_flush(
        RelayFlushRequest(attempt="a1", expected={0: len(ps)}, timeout_s=5)
    )
    assert rf.ok
    assert rf.staged == len(ps)
    wait_for("every payload held", lambda: entries_in(node, EntryState.STAGED) == len(ps))
    assert applied(tmp_path) == []  # serving v0 while staged
    assert node.metrics.staged_bytes._value.get() == sum(p.size for p in ps)  # type: ignore[attr-defined]
    node.control.gate(GateRequest(attempt="a1", closed=True))
    node.control.open_apply("a1")
    ack = flush(node, "a1", {0: len(ps)})
    assert ack.ok, ack.errors
    assert applied(tmp_path) == [(0, i) for i in range(len(ps))]
    assert module_fingerprint(node.applier.model) == fingerprint(V1)  # type: ignore[attr-defined]


def test_full_queue_answers_wait_but_reserves_the_next_slot(tmp_path: Path) -> None:
    core = make_core(tmp_path, queue_groups=1, group_size=1)  # capacity 2
    prep(core, "a1", open_apply=False)
    ps = payloads("a1", 0, V0, V1)
    assert offer(core, ps[1]) is AckStatus.STAGED
    assert offer(core, ps[2]) is AckStatus.STAGED
    assert offer(core, ps[3]) is AckStatus.WAIT  # full
    assert offer(core, ps[0]) is AckStatus.STAGED  # the next to apply always has a slot
    core.control.gate(GateRequest(attempt="a1", closed=True))
    core.control.open_apply("a1")
    for p in ps[3:]:
        deadline = time.monotonic() + 5
        while (v := offer(core, p)) is AckStatus.WAIT and time.monotonic() < deadline:
            time.sleep(0.01)
        assert v is AckStatus.STAGED
    assert flush(core, "a1", {0: len(ps)}).ok
    assert applied(tmp_path) == [(0, i) for i in range(len(ps))]


def test_flush_reports_missing_payloads_within_its_deadline(node: ReceiverCore) -> None:
    prep(node, "a1")
    ps = payloads("a1", 0, V0, V1)
    for p in ps[:-1]:
        offer(node, p)
    t0 = time.monotonic()
    ack = flush(node, "a1", {0: len(ps)}, timeout=0.5)
    assert time.monotonic() - t0 < 3
    assert not ack.ok
    assert "0:7(absent)" in ack.errors[0]


def test_xor_item_for_an_xor_incompatible_tensor_is_rejected(tmp_path: Path) -> None:
    from tests.sidecar.apply.loader_matrix import CANONICAL, MatrixModel, canonical_random

    state = canonical_random(1)
    applier = RecordingApplier(MatrixModel(), str(tmp_path / "log"), with_fingerprint=False)  # type: ignore[arg-type]
    core = ReceiverCore(ReceiverConfig(node="m", held_version=0), applier)
    core.control.prewarm(PrewarmRequest(metas=metas(state)))
    assert "negexp.weight" in core.state.xor_incompatible
    prep(core, "a1", open_apply=False)
    target = dict(state)
    target["negexp.weight"] = state["negexp.weight"] + 1
    bad = payloads("a1", 0, state, target, names=["negexp.weight"])[0]
    offer(core, bad)
    wait_for("the attempt failed", lambda: core.control.status().phase == "failed")
    assert "XOR-incompatible" in core.control.status().errors[0]
    assert set(CANONICAL) == {m.name for m in metas(state)}
