"""Producer pipeline: bit-exact end to end, bucket coalescing, overlap, backpressure, cancellation.

Payloads travel over the real S3 transport to a real receiver node (`tests.harness.s3_payloads`)
and are read back from the bucket. The in-memory `...TransportFake`s only inject a fault a real
transport cannot be made to produce on cue: a saturated link, a failing send, a lost payload, a
hung connection.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from refit_sidecar.baseline import (
    BaselineConfig,
    ChunkDelta,
    ExportChunk,
    ExportMismatchError,
    PendingStateError,
    SourceBaseline,
    chunk_export,
)
from refit_sidecar.bits import int_view
from refit_sidecar.codec import (
    EncodedPayload,
    Item,
    Mode,
    Op,
    TensorMeta,
    apply_item_,
    decode_payload,
)
from refit_sidecar.pipeline import Bucketer, PipelineConfig, PipelineError, ProducerPipeline
from refit_sidecar.pipeline.parts import unit_bytes
from refit_sidecar.transport import Transport, TransportSummary
from tests.harness.exports import Export, flip_bits, random_export
from tests.harness.s3_payloads import S3Delivery

LIMIT = 4096


class _InMemoryFake:
    """Base of the fault fakes: keeps every payload in memory, in send order."""

    def __init__(self) -> None:
        self.sent: list[EncodedPayload] = []
        self.send_times: list[float] = []

    def send(self, attempt: str, payload: EncodedPayload) -> None:
        self.send_times.append(time.monotonic())
        self.sent.append(payload)

    def stop_and_wait(self, attempt: str) -> TransportSummary:
        n = len(self.sent)
        return TransportSummary(attempt, n, sum(p.size for p in self.sent), n)

    def cleanup(self, attempt: str) -> None:
        self.sent.clear()


class SlowTransportFake(_InMemoryFake):
    """Fault: takes `delay` seconds per payload, like a saturated link."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def send(self, attempt: str, payload: EncodedPayload) -> None:
        super().send(attempt, payload)
        time.sleep(self.delay)


class FailingTransportFake(_InMemoryFake):
    """Fault: raises on the `fail_at`-th send (0-based), a link that goes down."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at

    def send(self, attempt: str, payload: EncodedPayload) -> None:
        if len(self.sent) == self.fail_at:
            raise ConnectionError("link down")
        super().send(attempt, payload)


class LossyTransportFake(_InMemoryFake):
    """Fault: accepts every payload but loses the ones in `lose` (a receiver never applies them)."""

    def __init__(self, lose: set[int]) -> None:
        super().__init__()
        self.lose = lose
        self.delivered: list[EncodedPayload] = []

    def send(self, attempt: str, payload: EncodedPayload) -> None:
        super().send(attempt, payload)
        if payload.header.payload_id not in self.lose:
            self.delivered.append(payload)


class BlockingTransportFake(_InMemoryFake):
    """Fault: blocks every send until `release` is set (a hung connection)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def send(self, attempt: str, payload: EncodedPayload) -> None:
        self.release.wait(10)
        super().send(attempt, payload)


DTYPES = (torch.bfloat16, torch.float32, torch.float16, torch.int8)


def _export(n: int = 24, seed: int = 0) -> Export:
    return random_export(n, seed, DTYPES, lambda i, _: (32, 24 + i), name="m.{i}.w")


def _update(export: Export, seed: int = 1, rate: float = 0.1, keep_every: int = 5) -> Export:
    """Flip bits at `rate`; every `keep_every`-th tensor stays unchanged (0: none does)."""
    return flip_bits(export, seed, rate, xor=3, keep_every=keep_every)


def _baselines(export, producers: int = 1) -> list[SourceBaseline]:
    cfg = BaselineConfig(export_chunk_bytes=LIMIT, in_memory=True)
    out = [SourceBaseline(producer=p, producers=producers, config=cfg) for p in range(producers)]
    for b in out:
        b.load_initial(chunk_export(export, LIMIT))
    return out


def _apply_all(state: dict[str, torch.Tensor], payloads: list[EncodedPayload], known) -> None:
    for p in sorted(payloads, key=lambda p: p.header.order):
        for item in decode_payload(p.body, expected_digest=p.digest, known=known).items:
            apply_item_(state[item.meta.name], item)


def _assert_bits_equal(state: dict[str, torch.Tensor], expected) -> None:
    for name, t in expected:
        assert np.array_equal(int_view(state[name]).numpy(), int_view(t).numpy()), name


def test_transport_fakes_satisfy_the_protocol() -> None:
    fakes = [
        SlowTransportFake(0),
        FailingTransportFake(0),
        LossyTransportFake(set()),
        BlockingTransportFake(),
    ]
    assert all(isinstance(f, Transport) for f in fakes)


def _delivered(transport: Transport, attempt: str) -> TransportSummary:
    """Wait for the attempt's last acknowledgments: every payload reached the receiver."""
    summary = transport.stop_and_wait(attempt)
    assert summary.errors == ()
    assert summary.payloads_acknowledged == summary.payloads_sent
    return summary


@pytest.mark.parametrize(("producers", "bucket"), [(1, 1), (2, 6000), (3, 10**9)])
def test_pipeline_is_bit_exact_across_producers(
    delivery: S3Delivery, producers: int, bucket: int
) -> None:
    v0 = _export()
    v1 = _update(v0)
    baselines = _baselines(v0, producers)
    total_changed = 0
    for b in baselines:
        tr = delivery.transport("a1", b)
        cfg = PipelineConfig(compare_workers=2, bucket_bytes=bucket)
        m = ProducerPipeline(b, tr, cfg).run("a1", chunk_export(v1, LIMIT))
        summary = _delivered(tr, "a1")
        sent = delivery.payloads("a1", b.producer)
        assert [p.header.payload_id for p in sent] == list(range(len(sent)))
        assert all(p.header.producer == b.producer and p.header.attempt == "a1" for p in sent)
        assert m.payloads == summary.payloads_sent == len(sent)
        assert m.payload_bytes == summary.bytes_sent == sum(p.size for p in sent)
        assert m.chunks_compared == len(b.owned_chunks)
        total_changed += m.changed_elements
    expected = sum(
        int(np.count_nonzero(int_view(a).numpy() != int_view(b).numpy()))
        for (_, a), (_, b) in zip(v0, v1, strict=True)
    )
    assert total_changed == expected
    state = {n: t.clone() for n, t in v0}
    _apply_all(state, delivery.payloads("a1"), baselines[0].metadata)
    _assert_bits_equal(state, v1)


def test_mixed_mode_uses_overwrite_for_declared_names(delivery: S3Delivery) -> None:
    v0 = _export()
    v1 = _update(v0)
    [b] = _baselines(v0)
    tr = delivery.transport("a1", b)
    ProducerPipeline(b, tr).run(
        "a1", chunk_export(v1, LIMIT), xor_incompatible=frozenset({"m.0.w"})
    )
    _delivered(tr, "a1")
    sent = delivery.payloads("a1")
    items = [i for p in sent for i in decode_payload(p.body, expected_digest=p.digest).items]
    assert {i.op for i in items if i.meta.name == "m.0.w"} == {Op.OVERWRITE}
    assert {i.op for i in items if i.meta.name != "m.0.w"} == {Op.XOR}
    state = {n: t.clone() for n, t in v0}
    _apply_all(state, sent, b.metadata)
    _assert_bits_equal(state, v1)


def test_bucketer_packs_whole_chunks() -> None:
    meta = TensorMeta("t", (4,), torch.uint8)
    item = Item(meta, Op.XOR, 0, None, torch.ones(1, dtype=torch.uint8))

    def delta(index: int, nbytes: int, changed: bool = True) -> ChunkDelta:
        return ChunkDelta(index, nbytes, nbytes, int(changed), (item,) if changed else ())

    b = Bucketer(100)
    assert b.add(delta(0, 40)) == []
    assert b.add(delta(1, 500, changed=False)) == []  # no records: adds nothing
    [first] = b.add(delta(2, 70))  # would exceed: the open bucket closes first
    assert first.chunks == [0]
    assert first.nbytes == 40
    [second, third] = b.add(delta(3, 250))  # larger than the target: travels alone
    assert second.chunks == [2]
    assert third.chunks == [3]
    assert b.add(delta(4, 100))
    assert b.finish() is None


def _counting(
    chunks: list[ExportChunk], pulled: list[int], times: list[float] | None = None
) -> Iterator[ExportChunk]:
    """The export as a stream that records when each chunk was taken."""
    for c in chunks:
        pulled.append(c.index)
        if times is not None:
            times.append(time.monotonic())
        yield c


def test_slow_transport_bounds_memory_and_overlaps_sending_with_compare() -> None:
    v0 = _export(n=40)
    v1 = _update(v0, rate=0.3, keep_every=0)  # every chunk has records: one payload per unit
    [b] = _baselines(v0)
    chunks = list(chunk_export(v1, LIMIT))
    pulled: list[int] = []
    pulled_at: list[float] = []
    tr = SlowTransportFake(delay=0.02)
    sent_chunks_at_send: list[tuple[int, int]] = []
    original_send = tr.send

    def send(attempt: str, payload: EncodedPayload) -> None:
        sent_chunks_at_send.append((len(pulled), len(tr.sent)))
        original_send(attempt, payload)

    tr.send = send  # type: ignore[method-assign]
    cfg = PipelineConfig(compare_workers=2, bucket_bytes=1, max_chunks_in_flight=2, payload_queue=1)
    m = ProducerPipeline(b, tr, cfg).run("a1", _counting(chunks, pulled, pulled_at))
    # One payload per chunk, and per part of a tensor above the chunk limit.
    sizes = [[t.numel() * t.element_size() for _, t in c.tensors] for c in chunks]
    assert m.payloads == sum(len(unit_bytes(s, LIMIT)) for s in sizes) > len(chunks)
    # Held chunks: the queue, one waiting to be queued, one being coalesced.
    assert m.max_chunks_held <= cfg.max_chunks_in_flight + 2
    # Chunks taken from the export but not yet sent stay bounded by the stage sizes.
    bound = cfg.max_chunks_in_flight + 2 + 2 * cfg.payload_queue + 2
    for taken, sent in sent_chunks_at_send:
        assert taken - sent <= bound
    assert len(chunks) > bound + 5  # the bound is far below the whole export
    # Payload 0 was on the wire while later chunks were still being taken in and compared.
    assert tr.send_times[0] < pulled_at[-1]
    assert sent_chunks_at_send[0][0] < len(chunks)


def test_failing_transport_cancels_the_rest() -> None:
    v0 = _export(n=40)
    v1 = _update(v0, rate=0.3)
    [b] = _baselines(v0)
    pulled: list[int] = []
    tr = FailingTransportFake(fail_at=1)
    cfg = PipelineConfig(bucket_bytes=1, max_chunks_in_flight=2, payload_queue=1)
    t0 = time.monotonic()
    with pytest.raises(PipelineError) as info:
        ProducerPipeline(b, tr, cfg).run("a1", _counting(list(chunk_export(v1, LIMIT)), pulled))
    assert time.monotonic() - t0 < 5
    assert info.value.stage == "send"
    assert isinstance(info.value.__cause__, ConnectionError)
    assert len(tr.sent) == 1
    assert len(pulled) < 12  # the export stopped being read


def test_failing_compare_cancels_the_rest(delivery: S3Delivery) -> None:
    v0 = _export(n=40)
    v1 = _update(v0)
    [b] = _baselines(v0)
    chunks = list(chunk_export(v1, LIMIT))
    name, t = chunks[3].tensors[0]
    chunks[3] = ExportChunk(3, ((name, t.to(torch.float64)), *chunks[3].tensors[1:]))
    pulled: list[int] = []
    tr = delivery.transport("a1", b)
    cfg = PipelineConfig(bucket_bytes=1, max_chunks_in_flight=2, payload_queue=1)
    with pytest.raises(PipelineError) as info:
        ProducerPipeline(b, tr, cfg).run("a1", _counting(chunks, pulled))
    assert info.value.stage == "compare"
    assert isinstance(info.value.__cause__, ExportMismatchError)
    assert len(pulled) < 12
    _delivered(tr, "a1")
    assert len(delivery.payloads("a1")) <= 3


def test_failing_export_and_compress_surface_with_their_stage(
    delivery: S3Delivery, monkeypatch: pytest.MonkeyPatch
) -> None:
    v0 = _export()
    v1 = _update(v0)
    [b] = _baselines(v0)

    def broken_export() -> Iterator[ExportChunk]:
        yield from list(chunk_export(v1, LIMIT))[:2]
        raise OSError("trainer went away")

    with pytest.raises(PipelineError) as info:
        ProducerPipeline(b, delivery.transport("a0", b)).run("a0", broken_export())
    assert info.value.stage == "intake"
    assert isinstance(info.value.__cause__, OSError)
    b.discard("a0")

    def broken_encode(*args: object, **kwargs: object) -> EncodedPayload:
        raise MemoryError("no room")

    monkeypatch.setattr("refit_sidecar.pipeline.producer.encode_payload", broken_encode)
    for workers in (1, 2):  # sealed inline, and on the sealing threads
        cfg = PipelineConfig(compare_workers=workers)
        with pytest.raises(PipelineError) as info:
            ProducerPipeline(b, delivery.transport(f"a{workers}", b), cfg).run(
                f"a{workers}", chunk_export(v1, LIMIT)
            )
        assert info.value.stage == "compress"
        assert isinstance(info.value.__cause__, MemoryError)
        b.discard(f"a{workers}")


def test_blocked_send_does_not_hold_up_the_error_beyond_the_grace_period() -> None:
    v0 = _export(n=40)
    v1 = _update(v0)
    [b] = _baselines(v0)
    chunks = list(chunk_export(v1, LIMIT))
    name, t = chunks[3].tensors[0]
    chunks[3] = ExportChunk(3, ((name, t.reshape(-1)), *chunks[3].tensors[1:]))
    tr = BlockingTransportFake()
    cfg = PipelineConfig(
        bucket_bytes=1, max_chunks_in_flight=2, payload_queue=1, cancel_grace_s=0.3
    )
    t0 = time.monotonic()
    try:
        with pytest.raises(PipelineError) as info:
            ProducerPipeline(b, tr, cfg).run("a1", chunks)
        assert info.value.stage == "compare"
        assert time.monotonic() - t0 < 3
    finally:
        tr.release.set()


def test_overwrite_retry_repairs_a_partial_delivery_without_a_new_export(
    delivery: S3Delivery,
) -> None:
    v0 = _export()
    v1 = _update(v0)
    [b] = _baselines(v0)
    lossy = LossyTransportFake(lose={1})
    ProducerPipeline(b, lossy, PipelineConfig(bucket_bytes=6000)).run("a1", chunk_export(v1, LIMIT))
    assert len(lossy.sent) >= 3
    receiver = {n: t.clone() for n, t in v0}
    _apply_all(receiver, lossy.delivered, b.metadata)  # XOR payloads applied except payload 1
    # Payload 0 was applied; the retry re-sends everything as overwrites: repeats are safe.
    retry = delivery.transport("a2", b, mode="overwrite")
    m = ProducerPipeline(b, retry, PipelineConfig(bucket_bytes=6000)).run_retry("a1", "a2")
    assert m.mode == str(Mode.OVERWRITE)
    _delivered(retry, "a2")
    sent = delivery.payloads("a2")
    items = [i for p in sent for i in decode_payload(p.body).items]
    assert {i.op for i in items} == {Op.OVERWRITE}
    _apply_all(receiver, sent, b.metadata)
    _assert_bits_equal(receiver, v1)
    b.commit("a2").result()
    assert np.array_equal(b.stored_bits("m.0.w"), int_view(v1[0][1]).numpy())


def test_retry_after_an_incomplete_compare_needs_a_new_export_in_overwrite_mode(
    delivery: S3Delivery,
) -> None:
    v0 = _export(n=40)
    v1 = _update(v0)
    [b] = _baselines(v0)
    cfg = PipelineConfig(bucket_bytes=1, max_chunks_in_flight=2, payload_queue=1)
    with pytest.raises(PipelineError):
        ProducerPipeline(b, FailingTransportFake(fail_at=0), cfg).run("a1", chunk_export(v1, LIMIT))
    tr = delivery.transport("a2", b, mode="overwrite")
    with pytest.raises(PendingStateError):
        ProducerPipeline(b, tr).run_retry("a1", "a2")
    b.discard("a1")
    ProducerPipeline(b, tr).run("a2", chunk_export(v1, LIMIT), mode=Mode.OVERWRITE)
    _delivered(tr, "a2")
    receiver = {n: t.clone() for n, t in v0}
    _apply_all(receiver, delivery.payloads("a2"), b.metadata)
    _assert_bits_equal(receiver, v1)
