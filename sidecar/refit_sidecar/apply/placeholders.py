"""Placeholder schemes for overwrite items (paper A.2 "Placeholder schemes").

Positions without a change hold a placeholder in scratch; the first intercepted copy into a
destination view turns "not a placeholder" into that view's active mask.

- NaN (default for 16/32/64-bit floats): NaN survives casts and pointwise transforms such as
  `-exp(x)`, so the mask can be formed after a transform. Needs NaN-free active values.
- Exact bits (FP8, integers, bool, or floats whose active values include NaN): a bit pattern
  absent from the item's values. It survives no transform, so the copy must be a plain
  same-dtype view of scratch; anything else fails closed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refit_sidecar.bits import int_dtype, int_view

_NAN_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_BITS_BY_WIDTH = {1: 8, 2: 16, 4: 32, 8: 64}


@dataclass(frozen=True)
class Placeholder:
    """`bits is None` means the NaN scheme; otherwise the exact integer bit pattern."""

    bits: int | None

    @property
    def is_nan(self) -> bool:
        return self.bits is None


def choose(dtype: torch.dtype, values_int: torch.Tensor) -> Placeholder | None:
    """Pick the scheme for an overwrite item with `values_int` (integer view of new bits).

    Returns None when no exact-bit sentinel exists (every pattern of a 1-byte dtype is used):
    the caller then applies the item in smaller parts.
    """
    if dtype in _NAN_DTYPES:
        as_float = values_int.view(dtype) if values_int.numel() else values_int
        if values_int.numel() == 0 or not bool(torch.isnan(as_float).any()):
            return Placeholder(None)
    return _absent_pattern(dtype, values_int)


def _absent_pattern(dtype: torch.dtype, values_int: torch.Tensor) -> Placeholder | None:
    width = torch.empty((), dtype=dtype).element_size()
    if width == 1:
        present = torch.zeros(256, dtype=torch.bool, device=values_int.device)
        present[values_int.to(torch.int64) & 0xFF] = True
        free = torch.nonzero(~present).reshape(-1)
        if free.numel() == 0:
            return None
        # Prefer a NaN-like/unusual pattern first (0x7F, 0xFF), else the first free one.
        for preferred in (0x7F, 0xFF, 0x80):
            if not bool(present[preferred]):
                return Placeholder(_signed(preferred, 8, values_int.dtype))
        return Placeholder(_signed(int(free[0]), 8, values_int.dtype))
    # Wider dtypes: a few candidates suffice (an item has far fewer values than patterns).
    used = set(values_int.reshape(-1).tolist()) if values_int.numel() <= 4096 else None
    bits = _BITS_BY_WIDTH[width]
    for candidate in range(-1, -(1 << 20), -1):
        c = _signed(candidate & ((1 << bits) - 1), bits, values_int.dtype)
        if used is not None:
            if c not in used:
                return Placeholder(c)
        elif not bool((values_int == c).any()):
            return Placeholder(c)
    return None  # pragma: no cover - 2^20 collisions cannot happen for realistic items


def _signed(value: int, bits: int, view_dtype: torch.dtype) -> int:
    """Interpret an unsigned bit pattern in the signedness of `view_dtype`."""
    if view_dtype == torch.uint8:
        return value
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


def fill(view: torch.Tensor, placeholder: Placeholder) -> None:
    """Reset a scratch view to the placeholder."""
    if placeholder.is_nan:
        view.fill_(float("nan"))
    else:
        assert placeholder.bits is not None
        int_view(view).fill_(placeholder.bits)


def active_mask(src: torch.Tensor, placeholder: Placeholder) -> torch.Tensor:
    """Positions of a copy source that carry a change (not the placeholder)."""
    if placeholder.is_nan:
        return ~torch.isnan(src)
    assert placeholder.bits is not None
    return src.view(int_dtype(src)) != placeholder.bits
