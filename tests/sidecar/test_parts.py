"""Large tensors as several payloads (`pipeline.parts`): the parts tile the tensor, carry every
change exactly once, and a producer's payloads of a split tensor apply bit-exactly in any order
(the receivers' side: a real receiver node over the real S3 transport, `tests.harness`)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from refit_sidecar.baseline import BaselineConfig, ChunkDelta, SourceBaseline, chunk_export
from refit_sidecar.bits import int_view
from refit_sidecar.codec import Item, Op, TensorMeta, apply_item_, decode_payload
from refit_sidecar.codec.records import item_from_positions
from refit_sidecar.pipeline import Bucketer, PipelineConfig, ProducerPipeline
from refit_sidecar.pipeline.parts import part_bounds, split_delta, split_item, unit_bytes
from tests.harness.exports import flip_bits
from tests.harness.s3_payloads import S3Delivery

LIMIT = 4096


@pytest.mark.parametrize(("numel", "width", "split"), [(10, 2, 20), (10, 2, 6), (1000, 2, 333)])
def test_parts_tile_the_tensor_in_near_equal_ranges(numel: int, width: int, split: int) -> None:
    bounds = part_bounds(numel, numel * width, split)
    assert bounds[0][0] == 0
    assert bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert len(bounds) == -(-numel * width // split)
    lengths = [b - a for a, b in bounds]
    assert max(lengths) - min(lengths) <= 1
    assert max(lengths) * width <= split or len(bounds) == 1


def test_parts_need_a_positive_size() -> None:
    with pytest.raises(ValueError, match="positive"):
        part_bounds(10, 20, 0)


def _located(numel: int, seed: int) -> Item:
    gen = np.random.default_rng(seed)
    locations = np.sort(gen.choice(numel, size=numel // 7, replace=False)).astype(np.int64)
    values = gen.integers(-(2**15), 2**15, size=locations.size, dtype=np.int16)
    item = item_from_positions(TensorMeta("w", (numel,), torch.bfloat16), Op.XOR, locations, values)
    assert item is not None
    assert item.locations is not None
    return item


def _flat(items: list[Item]) -> tuple[np.ndarray, np.ndarray]:
    locations = [
        np.arange(i.range_start, i.range_start + i.count)
        if i.range_start is not None
        else i.locations.numpy()
        for i in items
    ]
    return np.concatenate(locations), np.concatenate([i.values.numpy() for i in items])


def test_a_split_item_carries_every_change_once_inside_its_part() -> None:
    item = _located(10_000, seed=3)
    bounds = part_bounds(10_000, 20_000, 4096)
    parts = split_item(item, bounds)
    assert len(parts) == len(bounds)
    for (start, stop), part in parts:
        locations, _ = _flat([part])
        assert start <= locations.min()
        assert locations.max() < stop
        assert part.meta == item.meta
        assert part.op is item.op
    locations, values = _flat([p for _, p in parts])
    assert np.array_equal(locations, item.locations.numpy())
    assert np.array_equal(values.view(np.uint16), item.values.numpy().view(np.uint16))


def test_a_split_run_stays_runs_and_parts_without_changes_give_nothing() -> None:
    meta = TensorMeta("w", (100,), torch.float32)
    run = Item(meta, Op.OVERWRITE, 30, None, torch.arange(20, dtype=torch.int32))
    parts = split_item(run, part_bounds(100, 400, 100))  # [0,25) [25,50) [50,75) [75,100)
    assert [(span, p.range_start, p.count) for span, p in parts] == [((25, 50), 30, 20)]
    run = Item(meta, Op.OVERWRITE, 20, None, torch.arange(40, dtype=torch.int32))
    parts = split_item(run, part_bounds(100, 400, 100))
    assert [(p.range_start, p.values.tolist()) for _, p in parts] == [
        (20, list(range(5))),
        (25, list(range(5, 30))),
        (50, list(range(30, 40))),
    ]


def test_split_delta_keeps_small_tensors_together_and_cuts_large_ones() -> None:
    small = _located(100, seed=1)
    small = Item(
        TensorMeta("a", (100,), torch.bfloat16), Op.XOR, None, small.locations, small.values
    )
    large = _located(10_000, seed=2)
    delta = ChunkDelta(0, 200 + 20_000, 10_100, small.count + large.count, (small, large))
    assert split_delta(delta, 10**9) == [delta]  # nothing above the size: unchanged
    units = split_delta(delta, 4096)
    assert [u.nbytes for u in units] == unit_bytes([200, 20_000], 4096)
    assert units[0].items == (small,)
    assert all(u.items[0].meta.name == "w" for u in units[1:])
    assert sum(u.changed_elements for u in units) == delta.changed_elements
    assert unit_bytes([200, 20_000], None) == [20_200]  # results from before the split


def test_the_bucketer_never_puts_two_parts_of_one_tensor_in_a_payload() -> None:
    units = split_delta(ChunkDelta(0, 20_000, 10_000, 0, (_located(10_000, seed=4),)), 1000)
    bucketer = Bucketer(10**6)  # room for all of them
    closed = [b for u in units for b in bucketer.add(u)]
    last = bucketer.finish()
    buckets = [*closed, *([last] if last else [])]
    assert len(buckets) == len(units) == 20
    assert all(len(b.items) == 1 for b in buckets)


def _export() -> list[tuple[str, torch.Tensor]]:
    """A large first and last tensor (6 and 5 chunk limits) around small ones."""
    gen = torch.Generator().manual_seed(0)
    shapes = [("embed", (48, 256)), *((f"l{i}", (8, 40)) for i in range(6)), ("head", (40, 256))]
    return [(n, torch.randn(s, generator=gen).to(torch.bfloat16)) for n, s in shapes]


def test_large_tensors_travel_in_parts_that_apply_bit_exactly_in_any_order(
    delivery: S3Delivery,
) -> None:
    v0 = _export()
    v1 = flip_bits(v0, seed=1, rate=0.05, xor=3)
    b = SourceBaseline(
        producer=0, producers=1, config=BaselineConfig(export_chunk_bytes=LIMIT, in_memory=True)
    )
    b.load_initial(chunk_export(v0, LIMIT))
    tr = delivery.transport("a1", b)
    m = ProducerPipeline(b, tr, PipelineConfig(compare_workers=2)).run(
        "a1", chunk_export(v1, LIMIT)
    )
    tr.stop_and_wait("a1")
    sent = delivery.payloads("a1")
    decoded = [decode_payload(p.body, expected_digest=p.digest).items for p in sent]
    assert m.payloads == len(sent)
    names = [[i.meta.name for i in items] for items in decoded]
    assert names[:6] == [["embed"]] * 6
    assert names[-5:] == [["head"]] * 5
    assert all(p.raw_size < 2 * LIMIT for p in sent)  # the first and the last are small
    for order in (sent, sent[::-1]):
        state = {n: t.clone() for n, t in v0}
        for p in order:
            for item in decode_payload(p.body, expected_digest=p.digest).items:
                apply_item_(state[item.meta.name], item)
        for name, t in v1:
            assert np.array_equal(int_view(state[name]).numpy(), int_view(t).numpy()), name
    # The overwrite retry is rebuilt from the pending delta and split the same way.
    retry = delivery.transport("a2", b, mode="overwrite")
    ProducerPipeline(b, retry).run_retry("a1", "a2")
    retry.stop_and_wait("a2")
    again = delivery.payloads("a2")
    assert len(again) == len(sent)
    state = {n: t.clone() for n, t in v0}
    for p in again[::-1]:
        for item in decode_payload(p.body, expected_digest=p.digest).items:
            assert item.op is Op.OVERWRITE
            apply_item_(state[item.meta.name], item)
    for name, t in v1:
        assert np.array_equal(int_view(state[name]).numpy(), int_view(t).numpy()), name
