"""❷ projection, affine part (paper §4, App. A.1): map a training shard's changed elements
straight to canonical (HF name, flat index) records, without assembling the canonical tensor.

Every conversion the bridge does for an *affine* task (column, row and replicated shards, the
gate/up halves of a fused MLP, the rows of a fused Q/K/V) moves whole local rows to canonical
rows and never touches a value. So a `RowMap` — for each local row, the canonical tensor and row
it lands in, plus one column offset — turns the sorted changed positions of a shard into sorted
canonical positions per destination, and the XOR masks and new bits carry over unchanged. The
records are the same `Item`s the export path builds (codec/records.py): a receiver cannot tell
which path made them.

Which tasks are affine, and the maps of a Megatron model, come from
`trainer.megatron_projection`; this module holds only the geometry, so it is testable without
Megatron against plain `torch.cat`/`chunk` references.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from refit_sidecar.bitdiff import BitDiff, diff_bits
from refit_sidecar.bits import bits_numpy
from refit_sidecar.codec.records import Item, Op, TensorMeta, check_limits, item_from_positions


@dataclass(frozen=True, eq=False)
class RowMap:
    """Where each row of one local shard lands in the canonical tensors.

    The shard is viewed as `[rows, width]` (a 1-D shard as `[n, 1]`); local element `j` lands in
    `dests[dest[j // width]]` at flat index `dest_row[j // width] * row_width + col0 + j % width`.
    Within each destination `dest_row` increases with the local row, so sorted local positions
    give sorted canonical positions, as `Item` requires.
    """

    local_shape: tuple[int, ...]
    dests: tuple[TensorMeta, ...]
    dest: npt.NDArray[np.int16]
    dest_row: npt.NDArray[np.int64]
    col0: int
    row_width: int

    def __post_init__(self) -> None:
        rows, width = _rows_width(self.local_shape)
        if self.dest.shape != (rows,) or self.dest_row.shape != (rows,):
            raise ValueError(f"a row map needs one entry per local row ({rows})")
        if not 0 <= self.col0 <= self.row_width - width:
            raise ValueError(f"columns [{self.col0}, {self.col0 + width}) outside {self.row_width}")
        for d, meta in enumerate(self.dests):
            if _rows_width(meta.shape)[1] != self.row_width:
                raise ValueError(
                    f"{meta.name}: rows of {list(meta.shape)} are not {self.row_width} wide"
                )
            mine = self.dest_row[self.dest == d]
            if mine.size and (np.any(np.diff(mine) <= 0) or mine[0] < 0):
                raise ValueError(f"{meta.name}: destination rows must increase")
            if mine.size and (int(mine[-1]) + 1) * self.row_width > meta.numel:
                raise ValueError(f"{meta.name}: row {int(mine[-1])} outside {list(meta.shape)}")

    @property
    def width(self) -> int:
        return _rows_width(self.local_shape)[1]

    def route(
        self, local: npt.NDArray[np.int64]
    ) -> list[tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_] | None]]:
        """For each destination: the canonical flat positions of the sorted local positions
        that land in it (sorted), and which of `local` they are (None: all of them)."""
        row, col = np.divmod(local, self.width)
        flat = self.dest_row[row] * self.row_width + self.col0 + col
        if len(self.dests) == 1:
            return [(flat, None)]
        which = self.dest[row]
        masks = [which == d for d in range(len(self.dests))]
        return [(flat[mask], mask) for mask in masks]


def _rows_width(shape: Sequence[int]) -> tuple[int, int]:
    if len(shape) == 1:
        return int(shape[0]), 1
    if len(shape) == 2:
        return int(shape[0]), int(shape[1])
    raise ValueError(f"projection handles 1-D and 2-D shards, not {list(shape)}")


def _one(meta: TensorMeta, local_shape: tuple[int, ...], rows: np.ndarray, col0: int) -> RowMap:
    row_width = meta.shape[1] if len(meta.shape) == 2 else 1
    return RowMap(
        local_shape,
        (meta,),
        np.zeros(rows.size, np.int16),
        rows.astype(np.int64),
        col0,
        row_width,
    )


def identity(meta: TensorMeta) -> RowMap:
    """A shard that is the whole canonical tensor (replicated, or not split)."""
    rows, _ = _rows_width(meta.shape)
    return _one(meta, meta.shape, np.arange(rows), 0)


def column(meta: TensorMeta, tp_rank: int, tp_size: int) -> RowMap:
    """Rank `tp_rank`'s block of rows (split along dim 0: column-parallel linear, embedding)."""
    rows = _split(meta.shape[0], tp_size, meta.name)
    local = (rows, *meta.shape[1:])
    return _one(meta, local, np.arange(rows) + tp_rank * rows, 0)


def row(meta: TensorMeta, tp_rank: int, tp_size: int) -> RowMap:
    """Rank `tp_rank`'s block of columns (split along dim 1: row-parallel linear)."""
    if len(meta.shape) != 2:
        raise ValueError(f"{meta.name}: a row-parallel split needs a 2-D tensor")
    cols = _split(meta.shape[1], tp_size, meta.name)
    return _one(meta, (meta.shape[0], cols), np.arange(meta.shape[0]), tp_rank * cols)


def gated(gate: TensorMeta, up: TensorMeta, tp_rank: int, tp_size: int) -> RowMap:
    """A fused gate/up shard: its first half is rank `tp_rank`'s block of gate rows, its second
    half the same block of up rows (Megatron's `linear_fc1` of a gated MLP)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"{gate.name} and {up.name} differ in shape or dtype")
    half = _split(gate.shape[0], tp_size, gate.name)
    rows = np.concatenate([np.arange(half), np.arange(half)]) + tp_rank * half
    dest = np.repeat(np.array([0, 1], np.int16), half)
    width = gate.shape[1] if len(gate.shape) == 2 else 1
    local = (2 * half, *gate.shape[1:])
    return RowMap(local, (gate, up), dest, rows.astype(np.int64), 0, width)


def qkv(
    q: TensorMeta,
    k: TensorMeta,
    v: TensorMeta,
    *,
    heads: int,
    groups: int,
    head_dim: int,
    tp_rank: int,
    tp_size: int,
) -> RowMap:
    """A fused Q/K/V shard in Megatron's interleaved layout: per query group, `heads/groups`
    query heads, then one key and one value head, `head_dim` rows each; rank `tp_rank` holds
    groups `[tp_rank * groups/tp, (tp_rank+1) * groups/tp)`."""
    if heads % groups:
        raise ValueError(f"{q.name}: {heads} heads in {groups} query groups")
    per = heads // groups
    local_groups = _split(groups, tp_size, q.name)
    block = np.arange((per + 2) * head_dim * local_groups)
    group = tp_rank * local_groups + block // ((per + 2) * head_dim)
    b = (block // head_dim) % (per + 2)
    x = block % head_dim
    dest = np.where(b < per, 0, np.where(b == per, 1, 2)).astype(np.int16)
    rows = np.where(b < per, (group * per + b) * head_dim + x, group * head_dim + x)
    width = q.shape[1] if len(q.shape) == 2 else 1
    local = (int(block.size), *q.shape[1:])
    return RowMap(local, (q, k, v), dest, rows.astype(np.int64), 0, width)


def _split(n: int, parts: int, name: str) -> int:
    if parts < 1 or n % parts:
        raise ValueError(f"{name}: {n} does not split into {parts} equal parts")
    return n // parts


def project_diff(rowmap: RowMap, diff: BitDiff, op: Op) -> list[Item]:
    """The records of one shard's changes in canonical coordinates: one item per destination
    that changed (none when nothing did)."""
    values = diff.xor_bits if op is Op.XOR else diff.new_bits
    if diff.count and not 0 <= int(diff.locations[-1]) < math.prod(rowmap.local_shape):
        raise ValueError(f"{rowmap.dests[0].name}: changes outside {list(rowmap.local_shape)}")
    items = []
    for meta, (where, mask) in zip(rowmap.dests, rowmap.route(diff.locations), strict=True):
        item = item_from_positions(meta, op, where, values if mask is None else values[mask])
        if item is not None:
            items.append(item)
    return items


def project_shard(rowmap: RowMap, old: torch.Tensor, new: torch.Tensor, op: Op) -> list[Item]:
    """Compare the stored bits of a shard's two versions and project the changes."""
    if tuple(new.shape) != rowmap.local_shape or old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(
            f"shard of {rowmap.dests[0].name}: {old.dtype}{tuple(old.shape)} vs "
            f"{new.dtype}{tuple(new.shape)}, row map for {list(rowmap.local_shape)}"
        )
    if any(new.dtype != meta.dtype for meta in rowmap.dests):
        raise ValueError(f"{rowmap.dests[0].name}: shard dtype {new.dtype} is not canonical")
    for meta in rowmap.dests:
        check_limits(meta)
    return project_diff(rowmap, diff_bits(bits_numpy(old), bits_numpy(new)), op)
