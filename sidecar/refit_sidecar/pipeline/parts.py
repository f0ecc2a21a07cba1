"""Large tensors travel as several payloads: a changed tensor above the split size is cut into
parts before coalescing.

Why: chunks group whole tensors, so a tensor larger than the chunk limit (the embedding and the
output head, first and last in export order) was one payload several times the median one;
the stream started with it and drained with it. A part is a flat element range [start, stop)
of one tensor. Its item keeps the tensor's own metadata and flat indices, so a receiver applies
it like any item: parts never overlap, each payload stays independent of the others, and the
result is bit-exact in any order with nothing to reassemble.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from refit_sidecar.baseline.source import ChunkDelta
from refit_sidecar.codec.records import Item, item_from_positions

#: A part: [start, stop) flat element indices of one tensor.
Span = tuple[int, int]


def part_bounds(numel: int, nbytes: int, split_bytes: int) -> list[Span]:
    """The [start, stop) element ranges of a tensor's parts: ceil(nbytes / split_bytes) ranges
    of near-equal length, or the whole tensor when it is not larger than `split_bytes`."""
    if split_bytes < 1:
        raise ValueError("split_bytes must be positive")
    parts = min(max(1, -(-nbytes // split_bytes)), max(numel, 1))
    return [(i * numel // parts, (i + 1) * numel // parts) for i in range(parts)]


def part_bytes(nbytes: int, split_bytes: int) -> list[int]:
    """Bytes of each part of a tensor of `nbytes` (what the planner needs, without shapes)."""
    return [b - a for a, b in part_bounds(nbytes, nbytes, split_bytes)]


def units(tensor_bytes: Sequence[int], split_bytes: int | None) -> list[tuple[int, int | None]]:
    """The units `split_delta` gives for one chunk whose tensors all changed, in order, as
    (bytes, the tensor's position in the chunk for a part, else None): runs of tensors not
    larger than `split_bytes`, and the parts of each larger one. `split_bytes` None: tensors
    are never split (one unit, the whole chunk). Parts are cut by bytes here, by elements in
    the pipeline: their sizes agree to within an element."""
    if split_bytes is None or all(n <= split_bytes for n in tensor_bytes):
        return [(sum(tensor_bytes), None)] if tensor_bytes else []
    out: list[tuple[int, int | None]] = []
    run = 0
    for i, n in enumerate(tensor_bytes):
        if n <= split_bytes:
            run += n
            continue
        if run:
            out.append((run, None))
            run = 0
        out.extend((b, i) for b in part_bytes(n, split_bytes))
    if run:
        out.append((run, None))
    return out


def unit_bytes(tensor_bytes: Sequence[int], split_bytes: int | None) -> list[int]:
    """Bytes of each of `units`."""
    return [n for n, _ in units(tensor_bytes, split_bytes)]


def split_item(item: Item, bounds: Sequence[Span]) -> list[tuple[Span, Item]]:
    """The item's changes inside each range of `bounds`, with their range (ranges without
    changes give none)."""
    out: list[tuple[Span, Item]] = []
    if item.range_start is not None:
        first, end = item.range_start, item.range_start + item.count
        for start, stop in bounds:
            lo, hi = max(start, first), min(stop, end)
            if lo < hi:
                values = item.values[lo - first : hi - first]
                out.append(((start, stop), Item(item.meta, item.op, lo, None, values)))
        return out
    assert item.locations is not None
    locations = item.locations.numpy()
    bits = item.values.numpy()
    cuts = np.searchsorted(locations, [b for _, b in bounds]).tolist()
    begin = 0
    for span, end in zip(bounds, cuts, strict=True):
        part = item_from_positions(item.meta, item.op, locations[begin:end], bits[begin:end])
        if part is not None:
            out.append((span, part))
        begin = end
    return out


def split_delta(delta: ChunkDelta, split_bytes: int) -> list[ChunkDelta]:
    """The units the bucketer coalesces for one compared chunk: `delta` itself when no changed
    tensor is larger than `split_bytes`; else, in export order, each run of the other items
    and each part of a large tensor that has changes (unchanged tensors count for nothing,
    like chunks without records)."""
    if all(item.meta.nbytes <= split_bytes for item in delta.items):
        return [delta]
    out: list[ChunkDelta] = []
    run: list[Item] = []
    for item in delta.items:
        if item.meta.nbytes <= split_bytes:
            run.append(item)
            continue
        if run:
            out.append(_unit(delta.index, run))
            run = []
        bounds = part_bounds(item.meta.numel, item.meta.nbytes, split_bytes)
        width = item.meta.nbytes // max(item.meta.numel, 1)
        for (start, stop), part in split_item(item, bounds):
            n = stop - start
            out.append(ChunkDelta(delta.index, n * width, n, part.count, (part,)))
    if run:
        out.append(_unit(delta.index, run))
    return out


def _unit(index: int, items: list[Item]) -> ChunkDelta:
    return ChunkDelta(
        index,
        sum(i.meta.nbytes for i in items),
        sum(i.meta.numel for i in items),
        sum(i.count for i in items),
        tuple(items),
    )
