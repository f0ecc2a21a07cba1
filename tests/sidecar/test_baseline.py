"""Source baseline: ownership, first export, pending delta, commit, discard, overwrite rebuild."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refit_sidecar.baseline import (
    BaselineConfig,
    BaselinePoisonedError,
    ExportChunk,
    ExportMismatchError,
    PendingStateError,
    SourceBaseline,
    chunk_export,
    plan_chunks,
)
from refit_sidecar.bits import int_view
from refit_sidecar.codec import Mode, Op, TensorMeta, apply_item_
from tests.harness.exports import Export, flip_bits, random_export

DTYPES = (torch.bfloat16, torch.float32, torch.int8, torch.bool, torch.float16)


def _export(seed: int = 0, n: int = 9) -> Export:
    return random_export(
        n, seed, DTYPES, lambda _, gen: (int(torch.randint(1, 40, (1,), generator=gen)), 17)
    )


def _update(export: Export, seed: int, rate: float = 0.2) -> Export:
    return flip_bits(export, seed, rate)


def _bits(t: torch.Tensor) -> np.ndarray:
    return int_view(t).numpy()


def _make(producers: int, limit: int, export, tmp_path: Path | None, in_memory=False, early=True):
    cfg = BaselineConfig(
        directory=tmp_path, export_chunk_bytes=limit, in_memory=in_memory, early_update=early
    )
    baselines = [
        SourceBaseline(producer=p, producers=producers, config=cfg) for p in range(producers)
    ]
    for b in baselines:
        b.load_initial(chunk_export(export, limit))
    return baselines


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5000), min_size=0, max_size=30),
    limit=st.integers(1, 12000),
    producers=st.integers(1, 7),
)
def test_ownership_is_deterministic_complete_and_disjoint(
    sizes: list[int], limit: int, producers: int
) -> None:
    metas = [TensorMeta(f"t{i}", (s,), torch.uint8) for i, s in enumerate(sizes)]
    plan = plan_chunks(metas, limit)
    assert plan == plan_chunks(metas, limit)
    assert [m for chunk in plan for m in chunk] == metas  # whole tensors, in order, once
    for chunk in plan:  # bounded unless a single tensor is larger than the limit
        assert sum(m.nbytes for m in chunk) <= limit or len(chunk) == 1
    tensors = [(m.name, torch.zeros(m.shape, dtype=torch.uint8)) for m in metas]
    chunks = list(chunk_export(tensors, limit))
    assert tuple(c.metas() for c in chunks) == tuple(plan)
    baselines = _make(producers, limit, tensors, None, in_memory=True)
    owned = [set(b.owned_chunks) for b in baselines]
    assert set().union(*owned) == set(range(len(chunks)))  # complete
    assert sum(len(o) for o in owned) == len(chunks)  # disjoint
    assert sum(b.nbytes for b in baselines) == sum(sizes)  # one copy in total
    for b in baselines:
        b.close()


@pytest.mark.parametrize(("producers", "limit"), [(1, 10**9), (2, 700), (3, 1500), (4, 1)])
def test_baselines_across_producers_hold_one_copy(tmp_path: Path, producers: int, limit: int):
    export = _export()
    h = sum(t.numel() * t.element_size() for _, t in export)
    baselines = _make(producers, limit, export, tmp_path)
    try:
        assert sum(b.nbytes for b in baselines) == h
        owned = [set(b.owned_chunks) for b in baselines]
        assert set().union(*owned) == set(range(baselines[0].chunk_count))
        assert sum(len(o) for o in owned) == baselines[0].chunk_count
        for b in baselines:  # every producer knows every tensor's metadata for prewarm
            assert list(b.metadata) == [n for n, _ in export]
            assert b.metadata["layer.3.weight"] == TensorMeta.of("layer.3.weight", export[3][1])
    finally:
        for b in baselines:
            b.close()


def _all_bits(baselines: list[SourceBaseline], export) -> dict[str, np.ndarray]:
    """Committed bits of every tensor, from whichever producer owns it."""
    out = {}
    for name, _ in export:
        for b in baselines:
            try:
                out[name] = b.stored_bits(name).copy()
            except KeyError:
                continue
    return out


def _store_bits(b: SourceBaseline, name: str) -> np.ndarray:
    """What a chunk store holds right now (committed or not): not through `stored_bits`."""
    return next(s.views[name] for s in b._stores.values() if name in s.views).copy()


@pytest.mark.parametrize(("in_memory", "early"), [(False, True), (True, True), (False, False)])
def test_discard_leaves_bits_and_commit_writes_exactly_the_new_bits(
    tmp_path: Path, in_memory: bool, early: bool
) -> None:
    v0 = _export()
    v1 = _update(v0, seed=1)
    baselines = _make(2, 900, v0, tmp_path, in_memory=in_memory, early=early)
    try:
        files = list(tmp_path.rglob("chunk-*.bin"))
        assert (len(files) > 0) != in_memory
        for b in baselines:
            for chunk in chunk_export(v1, 900):
                if b.owns(chunk.index):
                    b.compare_chunk("a1", chunk)
            b.wait_committed()
            for name, t in v0:  # pending: the committed bits, whatever the stores hold
                with contextlib.suppress(KeyError):
                    assert np.array_equal(b.stored_bits(name), _bits(t)), name
                    held = _store_bits(b, name)
                    assert np.array_equal(held, _bits(dict(v1)[name]) if early else _bits(t))
            b.discard("a1")
        for name, t in v0:
            assert np.array_equal(_all_bits(baselines, v0)[name], _bits(t))
        for b in baselines:
            for chunk in chunk_export(v1, 900):
                if b.owns(chunk.index):
                    delta = b.compare_chunk("a2", chunk)
                    assert delta.changed_elements == sum(
                        int(np.count_nonzero(_bits(t) != _bits(dict(v0)[n])))
                        for n, t in chunk.tensors
                    )
            b.commit("a2").result()
        after = _all_bits(baselines, v0)
        for name, t in v1:
            assert np.array_equal(after[name], _bits(t))
        for b in baselines:  # the next compare sees the committed bits: nothing changed
            for chunk in chunk_export(v1, 900):
                if b.owns(chunk.index):
                    assert b.compare_chunk("a3", chunk).items == ()
    finally:
        for b in baselines:
            b.close()
    assert list(tmp_path.rglob("chunk-*.bin")) == []


@pytest.mark.parametrize("reuse", [True, False])
def test_delta_buffers_are_reused_after_discard_and_commit(reuse: bool) -> None:
    """The next compare writes into the last delta's buffers (config on) and every delta still
    reproduces its target exactly; with the option off, nothing is shared."""
    v0 = _export(n=6)
    v1 = _update(v0, seed=1)
    v2 = _update(v1, seed=2)
    cfg = BaselineConfig(export_chunk_bytes=900, in_memory=True, reuse_delta_buffers=reuse)
    b = SourceBaseline(producer=0, producers=1, config=cfg)
    b.load_initial(chunk_export(v0, 900))
    try:

        def compare(attempt: str, export) -> list:
            return [i for c in chunk_export(export, 900) for i in b.compare_chunk(attempt, c).items]

        def reproduces(items: list, start, target) -> None:
            state = {n: t.clone() for n, t in start}
            for item in items:
                apply_item_(state[item.meta.name], item)
            for name, t in target:
                assert np.array_equal(_bits(state[name]), _bits(t)), name

        first = compare("a1", v1)
        values = [i.values.numpy().copy() for i in first]
        b.discard("a1")
        second = compare("a2", v1)  # same export, same counts: fits the recycled buffers
        shared = [
            np.shares_memory(x.values.numpy(), y.values.numpy())
            for x, y in zip(first, second, strict=True)
        ]
        assert all(shared) if reuse else not any(shared)
        for item, before in zip(second, values, strict=True):
            assert np.array_equal(item.values.numpy(), before)
        reproduces(second, v0, v1)
        b.commit("a2").result()
        third = compare("a3", v2)  # after the commit wrote a2's bits from those buffers
        reproduces(third, v1, v2)
        b.commit("a3").result()
        after = _all_bits([b], v0)
        for name, t in v2:
            assert np.array_equal(after[name], _bits(t))
    finally:
        b.close()


def test_overwrite_rebuild_reproduces_new_bits_without_export(tmp_path: Path) -> None:
    v0 = _export()
    v1 = _update(v0, seed=2)
    [b] = _make(1, 800, v0, tmp_path)
    try:
        for chunk in chunk_export(v1, 800):
            b.compare_chunk("a1", chunk, mode=Mode.MIXED, xor_incompatible=frozenset())
        target = {n: t.clone() for n, t in v0}
        deltas = list(b.rebuild_overwrite("a1", "a2"))
        assert b.pending_attempt == "a2"
        assert [d.index for d in deltas] == b.owned_chunks
        for d in deltas:
            for item in d.items:
                assert item.op is Op.OVERWRITE
                apply_item_(target[item.meta.name], item)
                apply_item_(target[item.meta.name], item)  # overwrites repeat safely
        for name, t in v1:
            assert np.array_equal(_bits(target[name]), _bits(t))
        with pytest.raises(PendingStateError):
            b.commit("a1")  # the pending delta moved to a2
        b.commit("a2").result()
        assert np.array_equal(b.stored_bits("layer.0.weight"), _bits(v1[0][1]))
    finally:
        b.close()


def test_pending_state_rules(tmp_path: Path) -> None:
    v0 = _export()
    v1 = _update(v0, seed=3)
    [b] = _make(1, 800, v0, tmp_path)
    chunks = list(chunk_export(v1, 800))
    try:
        b.compare_chunk("a1", chunks[0])
        with pytest.raises(PendingStateError):
            b.compare_chunk("a1", chunks[0])  # the same chunk twice
        with pytest.raises(PendingStateError):
            b.compare_chunk("other", chunks[1])  # another attempt while a1 is pending
        with pytest.raises(PendingStateError):
            b.commit("a1")  # incomplete: not every owned chunk was compared
        with pytest.raises(PendingStateError):
            list(b.rebuild_overwrite("a1", "a2"))
        before = b.stored_bits(chunks[0].tensors[0][0]).copy()
        b.discard("a1")
        assert np.array_equal(b.stored_bits(chunks[0].tensors[0][0]), before)
        b.compare_chunk("a2", chunks[1])  # a new attempt after discard
    finally:
        b.close()


def test_chunks_must_match_the_first_export(tmp_path: Path) -> None:
    v0 = _export()
    [b, other] = _make(2, 800, v0, tmp_path)
    try:
        chunks = list(chunk_export(v0, 800))
        mine = next(c for c in chunks if b.owns(c.index))
        theirs = next(c for c in chunks if not b.owns(c.index))
        with pytest.raises(ExportMismatchError):
            b.compare_chunk("a", theirs)
        name, t = mine.tensors[0]
        reshaped = ExportChunk(mine.index, ((name, t.reshape(-1)), *mine.tensors[1:]))
        with pytest.raises(ExportMismatchError):
            b.compare_chunk("a", reshaped)
        retyped = ExportChunk(mine.index, ((name, t.to(torch.float64)), *mine.tensors[1:]))
        with pytest.raises(ExportMismatchError):
            b.compare_chunk("a", retyped)
    finally:
        b.close()
        other.close()
    cfg = BaselineConfig(in_memory=True, export_chunk_bytes=800)
    fresh = SourceBaseline(producer=0, producers=1, config=cfg)
    with pytest.raises(ExportMismatchError):  # chunked with another limit than configured
        fresh.load_initial(chunk_export(v0, 10**9))


def test_stored_bits_are_the_committed_bits_while_early_writes_and_undos_run() -> None:
    """A reader asking for a tensor while an attempt is pending (its chunks being compared and
    early-written, then discarded and undone) always gets the committed bits, never a store
    caught mid-write. Reads start only while the attempt is pending, and the reader stops
    before the next attempt, so a live view handed out after the undo stays valid."""
    gen = torch.Generator().manual_seed(7)
    v0 = [(f"big.{i}", torch.randn(1 << 19, generator=gen, dtype=torch.bfloat16)) for i in range(4)]
    v1 = _update(v0, seed=8, rate=0.3)
    limit = 1 << 20
    cfg = BaselineConfig(in_memory=True, export_chunk_bytes=limit, commit_workers=1)
    b = SourceBaseline(producer=0, producers=1, config=cfg)
    b.load_initial(chunk_export(v0, limit))
    want = {name: _bits(t).copy() for name, t in v0}
    wrong: list[str] = []
    reads = 0
    try:
        for k in range(12):
            stop = threading.Event()

            def reader(stop: threading.Event) -> None:
                nonlocal reads
                while not stop.is_set():
                    for name, bits in want.items():
                        if b.pending_attempt is None:
                            continue
                        reads += 1
                        if not np.array_equal(b.stored_bits(name), bits):
                            wrong.append(name)

            thread = threading.Thread(target=reader, args=(stop,))
            thread.start()
            for chunk in chunk_export(v1, limit):
                b.compare_chunk(f"a{k}", chunk)
            b.discard(f"a{k}")
            b.wait_committed()
            stop.set()
            thread.join()
        assert reads > 0
        assert wrong == []
    finally:
        b.close()


@pytest.mark.parametrize("early", [True, False])
def test_stored_bits_never_write_to_the_store(early: bool) -> None:
    """Answering with the committed bits while an attempt is pending reads the stores and
    never writes them (read-only stores would refuse a write)."""
    v0 = _export()
    v1 = _update(v0, seed=5)
    [b] = _make(1, 800, v0, None, in_memory=True, early=early)
    try:
        for chunk in chunk_export(v1, 800):
            b.compare_chunk("a1", chunk)
        b.wait_committed()
        for store in b._stores.values():
            for view in store.views.values():
                view.flags.writeable = False
        for name, t in v0:
            assert np.array_equal(b.stored_bits(name), _bits(t)), name
    finally:
        for store in b._stores.values():
            for view in store.views.values():
                view.flags.writeable = True
        b.close()


def test_a_failed_early_write_fails_the_attempt_before_its_commit() -> None:
    """A store that refuses the write (here a read-only mapping) poisons the baseline: the next
    compare of the attempt fails instead of the failure waiting for the commit."""
    v0 = _export()
    v1 = _update(v0, seed=4)
    [b] = _make(1, 800, v0, None, in_memory=True)
    chunks = list(chunk_export(v1, 800))
    try:
        first = chunks[0].tensors[0][0]
        b._stores[0].views[first].flags.writeable = False  # the fault: a read-only store
        b.compare_chunk("a1", chunks[0])
        with pytest.raises(ValueError, match="read-only"):
            b.wait_committed()  # the write's own error
        with pytest.raises(BaselinePoisonedError):
            b.compare_chunk("a1", chunks[1])
    finally:
        b._stores[0].views[first].flags.writeable = True
        b.close()
    b.discard("a1")  # after close: nothing left to undo, no error


def test_the_next_compare_waits_for_an_inflight_commit() -> None:
    gen = torch.Generator().manual_seed(5)
    v0 = [(f"big.{i}", torch.randn(1 << 20, generator=gen, dtype=torch.bfloat16)) for i in range(4)]
    v1 = _update(v0, seed=6, rate=0.5)
    limit = 2 << 20
    [b] = _make(1, limit, v0, None, in_memory=True)
    try:
        for chunk in chunk_export(v1, limit):
            b.compare_chunk("a1", chunk)
        commit = b.commit("a1")  # not waited for
        for chunk in chunk_export(v1, limit):
            assert b.compare_chunk("a2", chunk).changed_elements == 0
        assert commit.done()
        assert commit.exception() is None
    finally:
        b.close()


def test_a_baseline_never_closed_deletes_its_files_when_python_exits(tmp_path: Path) -> None:
    # A real interpreter that loads a file-backed baseline and exits without `close`.
    script = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from refit_sidecar.baseline import BaselineConfig, SourceBaseline, chunk_export\n"
        "export = [(f't{i}', torch.arange(4096, dtype=torch.int32)) for i in range(4)]\n"
        "cfg = BaselineConfig(directory=Path(sys.argv[1]), export_chunk_bytes=1 << 14)\n"
        "b = SourceBaseline(producer=0, producers=1, config=cfg)\n"
        "b.load_initial(chunk_export(export, 1 << 14))\n"
        "print(len(list(Path(sys.argv[1]).rglob('chunk-*.bin'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert int(out.stdout.strip().splitlines()[-1]) == 4  # the files existed while it ran
    assert list(tmp_path.iterdir()) == []
