"""The baseline's store writer on plain in-memory stores: new bits, undo, per-chunk order, epochs,
poisoning (no `SourceBaseline`, no export)."""

from __future__ import annotations

import threading
from concurrent.futures import Future, wait

import numpy as np
import pytest
import torch

from refit_sidecar.baseline.chunk_writer import ChunkWriter, PendingTensor, all_done
from refit_sidecar.baseline.storage import ChunkStore
from refit_sidecar.bitdiff import diff_bits
from refit_sidecar.codec.records import TensorMeta

METAS = (
    TensorMeta("a.weight", (64, 3), torch.bfloat16),
    TensorMeta("b.weight", (50,), torch.float32),
    TensorMeta("c.weight", (7,), torch.int8),
)


def _stores(chunks: int, seed: int = 0) -> tuple[dict[int, ChunkStore], dict[str, np.ndarray]]:
    """In-memory stores holding random committed bits; those bits, by `chunk/name`."""
    rng = np.random.default_rng(seed)
    stores: dict[int, ChunkStore] = {}
    committed: dict[str, np.ndarray] = {}
    for index in range(chunks):
        store = stores[index] = ChunkStore(METAS, None)
        for name, view in store.views.items():
            info = np.iinfo(view.dtype)
            view[:] = rng.integers(info.min, info.max, view.size, dtype=view.dtype, endpoint=True)
            committed[f"{index}/{name}"] = view.copy()
    return stores, committed


def _pending(
    store: ChunkStore, seed: int
) -> tuple[tuple[PendingTensor, ...], dict[str, np.ndarray]]:
    """A delta flipping about a quarter of the elements' low bit; the new bits, by name."""
    rng = np.random.default_rng(seed)
    pending, new = [], {}
    for meta in METAS:
        old = store.views[meta.name]
        bits = old.copy()
        flip = rng.random(bits.size) < 0.25
        flip[0] = True  # never an empty delta
        bits[flip] ^= 1
        diff = diff_bits(old, bits)
        assert diff.locations.size == int(flip.sum()) > 0
        pending.append(PendingTensor(meta, diff.locations, diff.new_bits, diff.xor_bits))
        new[meta.name] = bits
    return tuple(pending), new


def _holds(store: ChunkStore, bits: dict[str, np.ndarray]) -> bool:
    return all(np.array_equal(store.views[name], b) for name, b in bits.items())


def test_a_write_puts_the_new_bits_and_an_undo_the_committed_bits_back() -> None:
    stores, committed = _stores(2)
    writer = ChunkWriter(stores, workers=2)
    try:
        pending, new = _pending(stores[0], seed=1)
        freed: list[str] = []
        writer.submit(0, pending, then=lambda: freed.append("write")).result(timeout=10)
        assert _holds(stores[0], new)
        assert freed == ["write"]
        assert _holds(stores[1], {n: committed[f"1/{n}"] for n in stores[1].views})  # untouched
        writer.submit(0, pending, undo=True).result(timeout=10)
        assert _holds(stores[0], {n: committed[f"0/{n}"] for n in stores[0].views})
        writer.submit(0, ()).result(timeout=10)  # nothing to write: a barrier only
        assert writer.epoch(0) == 3
        assert writer.poisoned is None
    finally:
        writer.close()


def test_one_chunks_writes_run_in_queue_order_and_other_chunks_do_not_wait() -> None:
    """An undo queued behind a write that has not finished waits for it, although a free thread
    could take it; a write of another chunk runs meanwhile."""
    stores, committed = _stores(2)
    writer = ChunkWriter(stores, workers=3)
    held, gate = threading.Event(), threading.Event()
    order: list[str] = []

    def hold() -> None:
        order.append("write 0")
        held.set()
        assert gate.wait(10)

    try:
        pending, new = _pending(stores[0], seed=2)
        other, other_new = _pending(stores[1], seed=3)
        first = writer.submit(0, pending, then=hold)
        undo = writer.submit(0, pending, undo=True, then=lambda: order.append("undo 0"))
        assert writer.last(0) is undo
        assert (writer.epoch(0), writer.epoch(1)) == (2, 0)
        assert held.wait(10)
        writer.submit(1, other, then=lambda: order.append("write 1")).result(timeout=10)
        assert _holds(stores[1], other_new)
        done, _ = wait([first, undo], timeout=0.2)
        assert done == set()  # the undo waits for the write it follows
        gate.set()
        undo.result(timeout=10)
        assert first.done()
        assert order == ["write 0", "write 1", "undo 0"]
        assert _holds(stores[0], {n: committed[f"0/{n}"] for n in stores[0].views})
        assert not _holds(stores[0], new)
    finally:
        gate.set()
        writer.close()


def test_a_failed_write_poisons_the_writer_and_fails_the_chunks_later_writes() -> None:
    stores, committed = _stores(2)
    writer = ChunkWriter(stores, workers=1)
    pending, _ = _pending(stores[0], seed=4)
    other, other_new = _pending(stores[1], seed=5)
    freed: list[int] = []
    view = stores[0].views["a.weight"]
    try:
        view.flags.writeable = False  # the fault: a store that refuses the write
        failed = writer.submit(0, pending, then=lambda: freed.append(0))
        with pytest.raises(ValueError, match="read-only"):
            failed.result(timeout=10)
        assert writer.poisoned is failed.exception()
        view.flags.writeable = True
        later = writer.submit(0, pending, undo=True, then=lambda: freed.append(0))
        with pytest.raises(ValueError, match="read-only"):  # the earlier write's error
            writer.wait(0)
        assert later.exception() is failed.exception()
        assert freed == []
        assert _holds(stores[0], {n: committed[f"0/{n}"] for n in stores[0].views})
        writer.submit(1, other).result(timeout=10)  # another chunk is still written
        assert _holds(stores[1], other_new)
        with pytest.raises(ValueError, match="read-only"):
            writer.wait_all()
    finally:
        view.flags.writeable = True
        writer.close()


def test_close_waits_for_the_writes_and_keeps_the_epochs() -> None:
    stores, _ = _stores(1)
    writer = ChunkWriter(stores, workers=2)
    pending, new = _pending(stores[0], seed=6)
    writer.submit(0, pending)
    writer.close()
    assert _holds(stores[0], new)
    assert writer.last(0) is None
    assert writer.epoch(0) == 1  # a reader's snapshot taken before close stays checkable
    writer.wait(0)
    writer.wait_all()
    writer.submit(0, pending, undo=True).result(timeout=10)  # threads start again
    assert writer.epoch(0) == 2
    writer.close()
    with pytest.raises(ValueError, match="writer thread"):
        ChunkWriter(stores, workers=0)


def test_all_done_completes_after_the_last_future_with_the_first_error() -> None:
    assert all_done([]).result(timeout=1) is None
    parts: list[Future[None]] = [Future() for _ in range(3)]
    joined = all_done(parts)
    parts[2].set_result(None)
    parts[0].set_exception(KeyError("first"))
    assert not joined.done()
    parts[1].set_exception(KeyError("second"))
    assert joined.done()
    assert isinstance(joined.exception(), KeyError)
    assert str(joined.exception()) == "'first'"
    ok: list[Future[None]] = [Future(), Future()]
    joined = all_done(ok)
    for fut in ok:
        fut.set_result(None)
    assert joined.result(timeout=1) is None
