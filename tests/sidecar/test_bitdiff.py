"""Change detection (step 1): both kernels (numba, numpy) against a plain element-wise reference."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refit_sidecar.bitdiff import (
    NO_BUFFERS,
    changed_locations,
    changed_mask,
    diff_bits,
    diff_bits_numpy,
    diff_bits_parallel,
    kernel_name,
)
from refit_sidecar.bits import NP_INT_VIEW, UnsupportedDtypeError


@settings(max_examples=120, deadline=None)
@given(
    width=st.sampled_from([1, 2, 4, 8]),
    n=st.integers(0, 3000),
    rate=st.floats(0.0, 1.0),
    block_words=st.sampled_from([1, 3, 64, 1 << 17]),
    seed=st.integers(0, 2**32 - 1),
    kernel=st.sampled_from([diff_bits, diff_bits_numpy]),
)
def test_diff_bits_matches_elementwise_reference(
    width: int, n: int, rate: float, block_words: int, seed: int, kernel: Any
) -> None:
    rng = np.random.default_rng(seed)
    dtype = NP_INT_VIEW[width]
    old = rng.integers(0, 256, size=n * width, dtype=np.uint8).view(dtype)
    new = old.copy()
    flip = rng.random(n) < rate
    raw = new.view(np.uint8).reshape(n, width)
    raw[flip, rng.integers(0, width)] ^= np.uint8(1 << int(rng.integers(0, 8)))
    diff = kernel(old, new, block_words=block_words)
    expected = np.flatnonzero(old != new)
    assert diff.locations.dtype == np.int64
    assert np.array_equal(diff.locations, expected)
    assert np.array_equal(diff.new_bits, new[expected])
    assert np.array_equal(diff.xor_bits, old[expected] ^ new[expected])
    assert diff.new_bits.dtype == dtype
    assert diff.xor_bits.dtype == dtype


def test_the_compiled_kernel_is_in_use() -> None:
    """numba is a declared sidecar dependency; a silent fallback would hide a 1.5-2x slowdown."""
    assert kernel_name() == "numba"


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_every_subset_of_changed_lanes_in_a_word(width: int) -> None:
    """The compiled kernel visits only a word's nonzero lanes (a SWAR test on each lane's top
    bit): every subset of changed lanes, with XOR masks that set only the lowest bit, only the
    top bit or every bit of a lane, must come out exactly."""
    per = 8 // width
    dtype = NP_INT_VIEW[width]
    top = 1 << (8 * width - 1)
    masks = [1, top, (1 << (8 * width)) - 1]
    subsets = range(1, 1 << per)
    old = (
        np.random.default_rng(width)
        .integers(0, 256, size=len(masks) * len(subsets) * 8, dtype=np.uint8)
        .view(dtype)
    )
    new = old.copy()
    unsigned = new.view(f"<u{width}")
    word = 0
    for mask in masks:
        for subset in subsets:
            for lane in range(per):
                if subset >> lane & 1:
                    unsigned[word * per + lane] ^= np.array(mask, dtype=f"<u{width}")
            word += 1
    diff = diff_bits(old, new)
    expected = np.flatnonzero(old != new)
    assert np.array_equal(diff.locations, expected)
    assert np.array_equal(diff.new_bits, new[expected])
    assert np.array_equal(diff.xor_bits, old[expected] ^ new[expected])


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("rate", [0.2, 1.0])
def test_dense_changes_overflow_the_first_output_buffer(width: int, rate: float) -> None:
    """More changes than the first output capacity (1/16 of the elements) continue in further
    kernel calls without losing or repeating an element; the tail (< 8 bytes) is included."""
    rng = np.random.default_rng(width)
    n = 300_007
    dtype = NP_INT_VIEW[width]
    old = rng.integers(0, 256, size=n * width, dtype=np.uint8).view(dtype)
    new = old.copy()
    flip = np.flatnonzero(rng.random(n) < rate)
    new.view(np.uint8).reshape(n, width)[flip, 0] ^= np.uint8(0x80)
    new[-1] ^= dtype.type(1)
    diff = diff_bits(old, new)
    expected = np.flatnonzero(old != new)
    assert np.array_equal(diff.locations, expected)
    assert np.array_equal(diff.new_bits, new[expected])
    assert np.array_equal(diff.xor_bits, old[expected] ^ new[expected])
    assert diff.locations.base is None  # owns exactly its data: no spare capacity pinned


def test_float_equality_would_be_wrong_but_bits_are_compared() -> None:
    old = torch.tensor([0.0, float("nan"), 1.0, 1e-45], dtype=torch.float32)
    new = torch.tensor([-0.0, float("nan"), 1.0, 0.0], dtype=torch.float32)
    assert changed_mask(old, new).tolist() == [True, False, False, True]
    assert changed_locations(old, new).tolist() == [0, 3]


def test_mismatched_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="cannot compare"):
        changed_mask(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="cannot compare"):
        diff_bits(np.zeros(3, np.int16), np.zeros(3, np.int32))
    with pytest.raises(UnsupportedDtypeError):
        diff_bits(np.zeros(3, np.float32), np.zeros(3, np.float32))


@settings(max_examples=40, deadline=None)
@given(
    width=st.sampled_from([1, 2, 4, 8]),
    n=st.integers(0, 5000),
    slice_bytes=st.sampled_from([1, 8, 100, 4096, 1 << 20]),
    seed=st.integers(0, 2**32 - 1),
)
def test_sliced_parallel_diff_equals_whole_tensor_diff(
    width: int, n: int, slice_bytes: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    dtype = NP_INT_VIEW[width]
    old = rng.integers(0, 256, size=n * width, dtype=np.uint8).view(dtype)
    new = old.copy()
    new.view(np.uint8)[rng.random(n * width) < 0.05] ^= 0x11
    with ThreadPoolExecutor(2) as pool:
        sliced = diff_bits_parallel(old, new, pool, slice_bytes=slice_bytes)
    whole = diff_bits(old, new)
    assert np.array_equal(sliced.locations, whole.locations)
    assert np.array_equal(sliced.new_bits, whole.new_bits)
    assert np.array_equal(sliced.xor_bits, whole.xor_bits)


@settings(max_examples=60, deadline=None)
@given(
    width=st.sampled_from([1, 2, 4, 8]),
    n=st.integers(0, 3000),
    rates=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=5),
    offset=st.integers(0, 1 << 40),
    seed=st.integers(0, 2**32 - 1),
)
def test_recycled_output_buffers_give_the_fresh_result(
    width: int, n: int, rates: list[float], offset: int, seed: int
) -> None:
    """A sequence of diffs, each written into the previous result's buffers: every result is the
    element-wise reference (positions counted from `offset`), and a result that fits well within
    the previous buffers is written in place."""
    rng = np.random.default_rng(seed)
    dtype = NP_INT_VIEW[width]
    old = rng.integers(0, 256, size=n * width, dtype=np.uint8).view(dtype)
    buffers = NO_BUFFERS
    for rate in rates:
        new = old.copy()
        new.view(np.uint8)[rng.random(n * width) < rate] ^= np.uint8(0x41)
        diff = diff_bits(old, new, offset=offset, reuse=buffers)
        expected = np.flatnonzero(old != new)
        assert np.array_equal(diff.locations, expected + offset)
        assert np.array_equal(diff.new_bits, new[expected])
        assert np.array_equal(diff.xor_bits, old[expected] ^ new[expected])
        assert diff.new_bits.dtype == dtype
        assert diff.locations.dtype == np.int64
        assert diff.buffers is not None
        if diff.count + 512 <= buffers.capacity:
            assert diff.buffers is buffers
            assert diff.count == 0 or np.shares_memory(diff.locations, buffers.locations)
        fresh = diff_bits(old, new, offset=offset)
        assert fresh.buffers is None
        assert np.array_equal(fresh.locations, diff.locations)
        buffers = diff.buffers


@pytest.mark.parametrize("kernel", [diff_bits, diff_bits_numpy])
def test_offset_shifts_positions_only(kernel: Any) -> None:
    rng = np.random.default_rng(3)
    old = rng.integers(0, 1 << 16, size=1001, dtype=np.uint16).view(np.int16)
    new = old.copy()
    new[[0, 5, 500, 1000]] ^= 3
    shifted = kernel(old, new, offset=(1 << 33) + 7)
    assert shifted.locations.tolist() == [(1 << 33) + 7 + i for i in (0, 5, 500, 1000)]
    assert np.array_equal(shifted.xor_bits, kernel(old, new).xor_bits)
    with pytest.raises(ValueError, match="offset"):
        diff_bits(old, new, offset=-1)
