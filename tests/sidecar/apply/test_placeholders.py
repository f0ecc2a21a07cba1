"""Exact-bit placeholders: a pattern absent from an overwrite item's values, found in a couple
of passes for every width (a presence table for 1 and 2 bytes, one sort for 4 and 8), or None
when every pattern is used. Bits are compared through integer views."""

from __future__ import annotations

import time

import pytest
import torch

from refit_sidecar.apply.placeholders import (
    Placeholder,
    _absent_by_sort,
    _absent_pattern,
    _highest_absent,
    choose,
)
from refit_sidecar.bits import TORCH_INT_VIEW

FP8 = torch.float8_e4m3fn


def every_pattern(width: int) -> torch.Tensor:
    """Every bit pattern of a 1- or 2-byte integer view, shuffled."""
    bits = 8 * width
    view = TORCH_INT_VIEW[width]
    values = torch.arange(1 << bits, dtype=torch.int64)
    if view is not torch.uint8:
        values = torch.where(values >= 1 << (bits - 1), values - (1 << bits), values)
    perm = torch.randperm(1 << bits, generator=torch.Generator().manual_seed(width))
    return values[perm].to(view)


def assert_absent(values: torch.Tensor, ph: Placeholder | None) -> int:
    assert ph is not None
    assert ph.bits is not None
    probe = torch.tensor(ph.bits, dtype=torch.int64).to(values.dtype)
    assert int(probe) == ph.bits  # representable in the item's integer view
    assert not bool((values == probe).any())
    return ph.bits


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.bool, FP8])
def test_one_byte(dtype: torch.dtype) -> None:
    assert _absent_pattern(dtype, every_pattern(1)) is None
    without = every_pattern(1)
    without = without[without != 0x7F]
    assert assert_absent(without, _absent_pattern(dtype, without)) == 0x7F
    # The preferred sentinels used: the first free pattern.
    used = torch.tensor([0x7F, 0xFF, 0x80, 0x00], dtype=torch.uint8)
    assert assert_absent(used, _absent_pattern(dtype, used)) == 0x01
    assert _absent_pattern(dtype, torch.empty(0, dtype=torch.uint8)) == Placeholder(0x7F)


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint16, torch.bfloat16, torch.float16])
def test_two_bytes(dtype: torch.dtype) -> None:
    every = every_pattern(2)
    t0 = time.process_time()  # CPU time (torch's threads too), not the loaded machine's wall
    assert _absent_pattern(dtype, every) is None  # all 65,536 patterns used
    assert time.process_time() - t0 < 5.0  # one pass, not one pass per candidate
    for missing in (-1, -2, 0, 12345, -32768):
        values = every[every != missing]
        assert assert_absent(values, _absent_pattern(dtype, values)) == missing
    # -1 (0xFFFF) first, then counting down, as before.
    assert _absent_pattern(dtype, torch.tensor([1, 2], dtype=torch.int16)) == Placeholder(-1)
    taken = torch.tensor([-1, -2, 5], dtype=torch.int16)
    assert assert_absent(taken, _absent_pattern(dtype, taken)) == -3
    dense = torch.randint(-(1 << 15), 1 << 15, (200_000,), dtype=torch.int16)
    assert_absent(dense, _absent_pattern(dtype, dense))


@pytest.mark.parametrize(
    ("dtype", "view"),
    [
        (torch.int32, torch.int32),
        (torch.float32, torch.int32),
        (torch.int64, torch.int64),
        (torch.float64, torch.int64),
    ],
)
def test_four_and_eight_bytes(dtype: torch.dtype, view: torch.dtype) -> None:
    assert _absent_pattern(dtype, torch.tensor([0, 7], dtype=view)) == Placeholder(-1)
    run = torch.arange(-1000, 0, dtype=view)[torch.randperm(1000)]  # -1 .. -1000 all used
    assert assert_absent(run, _absent_pattern(dtype, run)) == -1001
    gap = torch.tensor([-1, -2, -4, 9, -3, -6], dtype=view)
    assert assert_absent(gap, _absent_pattern(dtype, gap)) == -5
    g = torch.Generator().manual_seed(3)
    big = torch.randint(-(1 << 30), 1 << 30, (1_000_000,), generator=g, dtype=torch.int64)
    big = torch.cat([big, torch.arange(-100_000, 0)]).to(view)  # one pass each, before
    t0 = time.process_time()
    found = assert_absent(big, _absent_pattern(dtype, big))
    assert time.process_time() - t0 < 5.0
    assert found < -100_000


def test_sorted_search_when_every_pattern_is_used() -> None:
    """The 4/8-byte search on a small universe: all negatives used, then all patterns used."""
    assert _absent_by_sort(torch.arange(-8, 7, dtype=torch.int32), 4) == Placeholder(7)
    holed = torch.cat([torch.arange(-8, 6), torch.tensor([7])]).to(torch.int32)
    assert _absent_by_sort(holed, 4) == Placeholder(6)
    assert _absent_by_sort(torch.arange(-8, 8, dtype=torch.int32), 4) is None
    assert _highest_absent(torch.arange(-8, 0, dtype=torch.int64), -1, -8) is None
    assert _highest_absent(torch.empty(0, dtype=torch.int64), -1, -8) == -1
    top = (1 << 63) - 1
    used = torch.tensor([0, top - 1, top], dtype=torch.int64)
    assert _highest_absent(used, top, 0) == top - 2


def test_choose_prefers_nan_unless_values_hold_nan() -> None:
    values = torch.randn(100).to(torch.bfloat16).view(torch.int16)
    assert choose(torch.bfloat16, values) == Placeholder(None)
    with_nan = torch.cat([values, torch.tensor([-1], dtype=torch.int16)])  # 0xFFFF is a NaN
    ph = choose(torch.bfloat16, with_nan)
    assert ph is not None
    assert assert_absent(with_nan, ph) == -2
    assert choose(torch.bfloat16, every_pattern(2)) is None
