"""Placeholder schemes for overwrite items (paper A.2 "Placeholder schemes").

Positions without a change hold a placeholder in scratch; the first intercepted copy into a
destination view turns "not a placeholder" into that view's active mask.

- NaN (default for 16/32/64-bit floats): NaN survives casts and pointwise transforms such as
  `-exp(x)`, so the mask can be formed after a transform. Needs NaN-free active values.
- Exact bits (FP8, integers, bool, or floats whose active values include NaN): a bit pattern
  absent from the item's values. It survives no transform, so the copy must be a plain
  same-dtype view of scratch; anything else fails closed.
- Every position (`COVERS_ALL`): an item that carries every element of its tensor needs no
  placeholder at all; each intercepted copy is written whole, exactly as a dense load writes it.
  This is what a retry sends for a fully changed tensor, and the only way a 16-bit tensor can
  use all 65,536 patterns in a single item.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refit_sidecar.bits import int_dtype, int_view

_NAN_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_BITS_BY_WIDTH = {1: 8, 2: 16, 4: 32, 8: 64}


@dataclass(frozen=True)
class Placeholder:
    """`bits is None` means the NaN scheme; otherwise the exact integer bit pattern.
    `covers_all`: every position is active (no placeholder is written or looked for)."""

    bits: int | None
    covers_all: bool = False

    @property
    def is_nan(self) -> bool:
        return self.bits is None and not self.covers_all


#: The scheme of an item that carries every element of its tensor.
COVERS_ALL = Placeholder(None, covers_all=True)


def covers_whole_tensor(range_start: int | None, count: int, numel: int) -> bool:
    """True for an item whose run starts at 0 and carries all `numel` elements (encoders turn
    every fully covered location list into such a run)."""
    return range_start == 0 and count == numel and numel > 0


def choose(dtype: torch.dtype, values_int: torch.Tensor) -> Placeholder | None:
    """Pick the scheme for an overwrite item with `values_int` (integer view of new bits).

    Returns None when no exact-bit sentinel exists (every pattern of a 1- or 2-byte dtype is
    used): the caller then applies the item in two passes with known sentinels.
    """
    if dtype in _NAN_DTYPES:
        as_float = values_int.view(dtype) if values_int.numel() else values_int
        if values_int.numel() == 0 or not bool(torch.isnan(as_float).any()):
            return Placeholder(None)
    return _absent_pattern(dtype, values_int)


def _absent_pattern(dtype: torch.dtype, values_int: torch.Tensor) -> Placeholder | None:
    """A bit pattern none of `values_int` has, found in at most a couple of passes.

    1 and 2 bytes: a presence table of every pattern (256 or 65,536 entries) built in one pass;
    None when every pattern is used. 4 and 8 bytes: one sort (`torch.unique`), then the highest
    absent pattern counting down from all-ones (-1) in unsigned order: O(n log n). From 2 bytes
    on, all-ones is tried first with one comparison pass, which settles almost every item
    without the table or the sort (and their memory).
    """
    width = torch.empty((), dtype=dtype).element_size()
    bits = _BITS_BY_WIDTH[width]
    flat = values_int.reshape(-1)
    if width >= 2 and not bool((flat == -1).any()):  # signed views: -1 is all-ones
        return Placeholder(-1)
    if width <= 2:
        return _absent_by_table(flat, bits)
    return _absent_by_sort(flat, bits)


#: Preferred 1-byte sentinels (NaN-like or unusual patterns), tried before any other free one.
_PREFERRED_BYTES = (0x7F, 0xFF, 0x80)
#: Values turned into table indices at a time: bounded temporaries for any item size.
_TABLE_CHUNK = 1 << 20


def _absent_by_table(flat: torch.Tensor, bits: int) -> Placeholder | None:
    size = 1 << bits
    counts = torch.zeros(size, dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _TABLE_CHUNK):
        chunk = flat[start : start + _TABLE_CHUNK]
        counts += torch.bincount(chunk.to(torch.int32) & (size - 1), minlength=size)
    present = counts > 0
    if bool(present.all()):
        return None
    free = (~present).to(torch.uint8)  # argmax finds the first free pattern (nonzero is slow)
    if bits == 8:
        for preferred in _PREFERRED_BYTES:
            if not bool(present[preferred]):
                return Placeholder(_signed(preferred, bits, flat.dtype))
        return Placeholder(_signed(int(free.argmax()), bits, flat.dtype))
    # 16 bits: all-ones (-1) first, then counting down, as for wider dtypes.
    highest = size - 1 - int(free.flip(0).argmax())
    return Placeholder(_signed(highest, bits, flat.dtype))


def _absent_by_sort(flat: torch.Tensor, bits: int) -> Placeholder | None:
    used = torch.unique(flat, sorted=True)  # signed int32/int64, ascending
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    negative = int(torch.searchsorted(used, torch.zeros((), dtype=used.dtype)))
    # Unsigned order from all-ones down: -1 .. MIN, then MAX .. 0.
    found = _highest_absent(used[:negative], -1, low)
    if found is None:
        found = _highest_absent(used[negative:], high, 0)
    return None if found is None else Placeholder(found)


def _highest_absent(used: torch.Tensor, high: int, low: int) -> int | None:
    """The largest integer in [low, high] missing from `used` (sorted, unique, in range)."""
    n = used.numel()
    if n == 0 or int(used[-1]) != high:
        return high
    # used[i] + (n - 1 - i) never decreases (values are distinct) and ends at `high`: the run of
    # values ending at `high` without a gap is exactly where it equals `high`.
    reach = used + torch.arange(n - 1, -1, -1, dtype=used.dtype, device=used.device)
    run = int((reach == high).sum())
    candidate = high - run
    return candidate if candidate >= low else None


def _signed(value: int, bits: int, view_dtype: torch.dtype) -> int:
    """Interpret an unsigned bit pattern in the signedness of `view_dtype`."""
    if view_dtype == torch.uint8:
        return value
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


def fill(view: torch.Tensor, placeholder: Placeholder) -> None:
    """Reset a scratch view to the placeholder (nothing to do when every position is active)."""
    if placeholder.covers_all:
        return
    if placeholder.is_nan:
        view.fill_(float("nan"))
    else:
        assert placeholder.bits is not None
        int_view(view).fill_(placeholder.bits)


def active_mask(src: torch.Tensor, placeholder: Placeholder) -> torch.Tensor:
    """Positions of a copy source that carry a change (not the placeholder). Whole-tensor
    items (`covers_all`) have no mask: the hook writes each of their copies whole."""
    if placeholder.is_nan:
        return ~torch.isnan(src)
    assert placeholder.bits is not None
    return src.view(int_dtype(src)) != placeholder.bits
