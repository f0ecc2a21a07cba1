"""❸ encode — delta records: one item per changed tensor in a payload (a large tensor's changes
may be spread over several payloads, one flat range each: `pipeline.parts`), an XOR mask or an
overwrite per element.

Both operations reproduce the new stored bits exactly (paper §5); arithmetic deltas would not,
because `old + (new - old)` can round to a different value. XOR masks compress better but flip
back when applied twice, so every retry uses overwrites.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from refit_protocol.compat import StrEnum
from refit_protocol.limits import limit_violation, shown_name
from refit_sidecar.bitdiff import BitDiff, diff_bits
from refit_sidecar.bits import bits_numpy, int_view
from refit_sidecar.codec import dtypes
from refit_sidecar.codec.errors import EncodeLimitError


class Op(enum.IntEnum):
    """How a receiver applies an item's values to the stored bits."""

    XOR = 1
    OVERWRITE = 2


class Mode(StrEnum):
    """Encoding mode of an attempt: mixed (first attempt) or overwrite (every retry)."""

    MIXED = "mixed"
    OVERWRITE = "overwrite"


@dataclass(frozen=True)
class TensorMeta:
    """Canonical identity of a tensor: HF name, shape and dtype (what receivers prewarm with)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> TensorMeta:
        return cls(name=name, shape=tuple(int(d) for d in t.shape), dtype=t.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * dtypes.width(self.dtype)


def check_limits(meta: TensorMeta) -> None:
    """Refuse a tensor beyond the shared limits (name bytes, dimensions, elements) that every
    receiver enforces: `EncodeLimitError` naming the tensor and the limit."""
    reason = limit_violation(meta.name, meta.shape)
    if reason is not None:
        raise EncodeLimitError(f"{shown_name(meta.name)}: {reason}")


@dataclass(frozen=True)
class Item:
    """One tensor's changes: positions (a contiguous run or sorted int64 flat indices) and values.

    `values` holds the same-width integer view of the dtype (uint8/int16/int32/int64; bool as
    uint8): XOR masks for `Op.XOR`, the new stored bits for `Op.OVERWRITE`.
    """

    meta: TensorMeta
    op: Op
    range_start: int | None
    locations: torch.Tensor | None
    values: torch.Tensor

    def __post_init__(self) -> None:
        if (self.range_start is None) == (self.locations is None):
            raise ValueError(f"{self.meta.name}: exactly one of range_start/locations is needed")
        if self.values.dim() != 1 or self.values.dtype != dtypes.value_dtype(self.meta.dtype):
            raise ValueError(
                f"{self.meta.name}: values must be 1-D {dtypes.value_dtype(self.meta.dtype)}, "
                f"got {self.values.dtype}{tuple(self.values.shape)}"
            )
        if self.locations is not None:
            if self.locations.dim() != 1 or self.locations.dtype != torch.int64:
                raise ValueError(f"{self.meta.name}: locations must be 1-D int64")
            if self.locations.numel() != self.values.numel():
                raise ValueError(f"{self.meta.name}: locations and values differ in length")
        elif self.range_start is not None and not (
            self.range_start >= 0 and self.range_start + self.count <= self.meta.numel
        ):
            raise ValueError(f"{self.meta.name}: range outside the tensor")

    @property
    def count(self) -> int:
        """Number of changed elements carried."""
        return int(self.values.numel())

    def index(self) -> slice | torch.Tensor:
        """A flat index for the target's integer view: a slice for a run, else the locations."""
        if self.range_start is not None:
            return slice(self.range_start, self.range_start + self.count)
        assert self.locations is not None
        return self.locations


def choose_op(name: str, mode: Mode, xor_incompatible: frozenset[str] | set[str]) -> Op:
    """Mixed mode: XOR except the names receivers declared XOR-incompatible; else overwrite."""
    if mode is Mode.OVERWRITE or name in xor_incompatible:
        return Op.OVERWRITE
    return Op.XOR


def item_from_positions(
    meta: TensorMeta, op: Op, locations: np.ndarray, values: np.ndarray
) -> Item | None:
    """An item for sorted positions; a contiguous run becomes a range. None when empty."""
    count = int(locations.size)
    if count == 0:
        return None
    first = int(locations[0])
    vals = torch.from_numpy(np.ascontiguousarray(values))
    if int(locations[-1]) - first + 1 == count:
        return Item(meta, op, range_start=first, locations=None, values=vals)
    locs = torch.from_numpy(np.ascontiguousarray(locations, dtype=np.int64))
    return Item(meta, op, range_start=None, locations=locs, values=vals)


def item_from_diff(meta: TensorMeta, diff: BitDiff, op: Op) -> Item | None:
    """The record of one compared tensor (None when nothing changed)."""
    values = diff.xor_bits if op is Op.XOR else diff.new_bits
    return item_from_positions(meta, op, diff.locations, values)


def diff_item(name: str, old: torch.Tensor, new: torch.Tensor, op: Op = Op.XOR) -> Item | None:
    """Compare the stored bits of two CPU tensors and build their item (None if unchanged)."""
    if old.dtype != new.dtype or old.shape != new.shape:
        raise ValueError(f"{name}: {old.dtype}{tuple(old.shape)} vs {new.dtype}{tuple(new.shape)}")
    meta = TensorMeta.of(name, new)
    dtypes.dtype_code(new.dtype)  # fail early on unsupported dtypes
    check_limits(meta)  # and on what no receiver would accept
    return item_from_diff(meta, diff_bits(bits_numpy(old), bits_numpy(new)), op)


def diff_items(
    old: Mapping[str, torch.Tensor],
    new: Iterable[tuple[str, torch.Tensor]],
    *,
    mode: Mode = Mode.MIXED,
    xor_incompatible: frozenset[str] | set[str] = frozenset(),
) -> list[Item]:
    """Items for every changed tensor of `new` against `old`, with per-name op selection."""
    items: list[Item] = []
    for name, t in new:
        if name not in old:
            raise KeyError(f"{name} has no old tensor to compare with")
        item = diff_item(name, old[name], t, choose_op(name, mode, xor_incompatible))
        if item is not None:
            items.append(item)
    return items


def apply_item_(target: torch.Tensor, item: Item) -> None:
    """Apply `item` in place to a contiguous canonical tensor (reference semantics of the ops)."""
    if TensorMeta.of(item.meta.name, target) != item.meta:
        raise ValueError(f"{item.meta.name}: target {target.dtype}{tuple(target.shape)} differs")
    if not target.is_contiguous():
        raise ValueError(f"{item.meta.name}: target must be contiguous to be written in place")
    flat = int_view(target)
    idx = item.index()
    values = item.values.to(flat.device)
    if item.op is Op.XOR:
        flat[idx] = flat[idx] ^ values
    else:
        flat[idx] = values
