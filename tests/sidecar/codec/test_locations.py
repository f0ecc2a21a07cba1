"""Location encoding: the compiled gap encoder against its numpy formulation, and its checks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refit_sidecar.codec.errors import LocationError
from refit_sidecar.codec.locations import (
    LocKind,
    _encode_gaps_numpy,
    _gap_kernels,
    decode_gaps,
    encode_positions,
    unshuffle,
)

NOT_INCREASING = r"^locations must be strictly increasing$"
#: Gaps on both sides of every width boundary.
EDGE_GAPS = [0, 1, 254, 255, 256, 65_534, 65_535, 65_536, 2**32 - 1, 2**32, 2**40]


def test_the_compiled_gap_encoder_is_in_use() -> None:
    assert _gap_kernels() is not None


@settings(max_examples=200, deadline=None)
@given(
    first=st.integers(0, 2**40),
    gaps=st.lists(
        st.one_of(st.sampled_from(EDGE_GAPS), st.integers(0, 300)), min_size=1, max_size=400
    ),
)
def test_compiled_and_numpy_gap_encodings_agree(first: int, gaps: list[int]) -> None:
    positions = first + np.cumsum(np.array(gaps, dtype=np.int64) + 1)
    positions = np.concatenate([[first], positions]).astype(np.int64)
    numel = int(positions[-1]) + 1
    enc = encode_positions(positions, numel)
    if int(positions[-1]) - first + 1 == positions.size:
        assert (enc.kind, enc.start, enc.width, enc.gaps) == (LocKind.RANGE, first, 0, None)
        return
    oracle = _encode_gaps_numpy(positions)
    assert (enc.kind, enc.start, enc.width) == (LocKind.GAPS, oracle.start, oracle.width)
    assert oracle.kind is LocKind.GAPS
    assert enc.gaps is not None
    assert oracle.gaps is not None
    assert enc.gaps.dtype == oracle.gaps.dtype
    assert np.array_equal(enc.gaps, oracle.gaps)
    assert enc.width == next(w for w in (1, 2, 4, 8) if max(gaps) < 1 << (8 * w))
    assert np.array_equal(decode_gaps(enc.start, enc.gaps, numel), positions)


@pytest.mark.parametrize(
    "positions",
    [[3, 3], [5, 4], [0, 2, 1, 3], [0, 1, 1, 3], [1, 0, 2], [0, 5, 2**62, 7], [0, 1, 2, 2]],
)
def test_unsorted_or_repeated_positions_are_refused(positions: list[int]) -> None:
    with pytest.raises(LocationError, match=NOT_INCREASING):
        encode_positions(np.array(positions, dtype=np.int64), 2**62 + 1)
    if len(positions) > 1:  # the numpy formulation (KUBEREFIT_KERNELS=numpy) refuses them too
        with pytest.raises(LocationError, match=NOT_INCREASING):
            _encode_gaps_numpy(np.array(positions, dtype=np.int64))


@pytest.mark.parametrize("positions", [[0, 3, 2], [4, 4, 6], [7, 9, 8, 10], [0, 0, 1, 3, 4]])
def test_a_span_as_long_as_the_count_is_a_run_only_when_increasing(positions: list[int]) -> None:
    """last - first + 1 == count makes a run only if the positions increase: these have as many
    elements as their span and are refused, not encoded as a contiguous range."""
    with pytest.raises(LocationError, match=NOT_INCREASING):
        encode_positions(np.array(positions, dtype=np.int64), 100)


@pytest.mark.parametrize("numel", [1, 2, 10, 256, 65_537, 2**40])
def test_decoded_locations_must_lie_inside_the_tensor(numel: int) -> None:
    """The last position may be numel - 1 and never numel: an out-of-range position would be an
    out-of-bounds `index_put_` on the receiver (a device assert on a GPU, not a clean error)."""
    # Every position but the last is fine; the last lands exactly on the boundary.
    if numel > 1:
        inside = decode_gaps(0, np.array([numel - 2], dtype=np.uint64), numel)
        assert inside.tolist() == [0, numel - 1]
        with pytest.raises(LocationError, match="outside"):
            decode_gaps(0, np.array([numel - 1], dtype=np.uint64), numel)  # last == numel
        with pytest.raises(LocationError, match="outside"):
            decode_gaps(1, np.array([numel - 2], dtype=np.uint64), numel)  # last == numel
    if numel > 2:  # only the last of three positions is outside
        with pytest.raises(LocationError, match=rf"^last location {numel} outside "):
            decode_gaps(0, np.array([0, numel - 2], dtype=np.uint64), numel)
    with pytest.raises(LocationError, match="outside"):
        decode_gaps(numel, np.array([], dtype=np.uint64), numel)  # first == numel
    assert decode_gaps(numel - 1, np.array([], dtype=np.uint64), numel).tolist() == [numel - 1]


def test_large_gaps_take_the_unsigned_path_and_decode_exactly() -> None:
    """When start + count x (largest gap + 1) could pass 2**63, gaps are summed in uint64 and
    checked for wrap-around; sums that stay inside the tensor decode to the exact positions."""
    big = 2**62
    gaps = np.array([big, 0, 3, 0], dtype=np.uint64)
    start = 5
    want = [5, 5 + big + 1, 5 + big + 2, 5 + big + 6, 5 + big + 7]
    numel = want[-1] + 1
    assert start + gaps.size * (big + 1) >= 2**63  # the unsigned path
    got = decode_gaps(start, gaps, numel)
    assert got.dtype == np.int64
    assert got.tolist() == want
    with pytest.raises(LocationError, match=rf"^last location {want[-1]} outside {numel - 1} "):
        decode_gaps(start, gaps, numel - 1)


def test_gaps_whose_sum_wraps_64_bits_are_refused() -> None:
    big = 2**62
    gaps = np.array([big, big, big, big], dtype=np.uint64)  # 4 x (2**62 + 1) wraps past 2**64
    with pytest.raises(LocationError, match=r"^locations overflow 64 bits$"):
        decode_gaps(0, gaps, 2**63)
    two = np.array([big, big], dtype=np.uint64)  # no wrap, but past the tensor
    with pytest.raises(LocationError, match=rf"^last location {2 * (big + 1)} outside "):
        decode_gaps(0, two, big + 5)


@pytest.mark.parametrize("numel", [1, 7, 2**40])
def test_decode_refusals_name_what_is_wrong(numel: int) -> None:
    with pytest.raises(LocationError, match=rf"^first location -1 outside a tensor of {numel} "):
        decode_gaps(-1, np.array([], dtype=np.uint8), numel)
    with pytest.raises(LocationError, match=rf"^gap {numel} exceeds a tensor of {numel} "):
        decode_gaps(0, np.array([0, numel], dtype=np.uint64), numel)
    if numel < 8:  # every element, gap 0 after gap 0
        every = decode_gaps(0, np.zeros(numel - 1, dtype=np.uint8), numel)
        assert every.tolist() == list(range(numel))


def test_encode_positions_checks_count_and_range_and_makes_runs() -> None:
    one = encode_positions(np.array([7], dtype=np.int64), 10)
    assert (one.kind, one.start) == (LocKind.RANGE, 7)  # one location is a run of one
    run = encode_positions(np.array([3, 4, 5], dtype=np.int64), 6)
    assert (run.kind, run.start, run.gaps) == (LocKind.RANGE, 3, None)
    with pytest.raises(LocationError, match=r"^an item needs at least one location$"):
        encode_positions(np.array([], dtype=np.int64), 10)
    for positions in ([-1, 2], [2, 10]):
        first, last = positions
        with pytest.raises(
            LocationError, match=rf"^locations \[{first}, {last}\] outside a tensor of 10 elements$"
        ):
            encode_positions(np.array(positions, dtype=np.int64), 10)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.bool_, np.int16, np.float32, np.uint64])
def test_unshuffle_returns_the_asked_dtype(dtype: type) -> None:
    values = np.arange(12).astype(dtype)
    w = values.dtype.itemsize
    planes = np.ascontiguousarray(values.view(np.uint8).reshape(-1, w).T).reshape(-1)
    out = unshuffle(planes, np.dtype(dtype))
    assert out.dtype == np.dtype(dtype)
    assert np.array_equal(out.view(np.uint8), values.view(np.uint8))


def test_sums_that_reach_2_to_the_63_never_come_back_negative() -> None:
    """Positions are int64: a sum of exactly 2**63 (the boundary between the int64 and the
    unsigned path) or one that wraps 64 bits with only two gaps must be refused, never returned
    as a negative position."""
    top = 2**63 - 1  # the largest numel a tensor can declare
    with pytest.raises(LocationError, match=r"^last location 9223372036854775808 outside "):
        decode_gaps(0, np.array([2**62 - 1, 2**62 - 1], dtype=np.uint64), top)  # sum == 2**63
    wraps = np.array([2**63 - 3, 2**63 - 3], dtype=np.uint64)  # the second sum passes 2**64
    with pytest.raises(LocationError, match=r"^locations overflow 64 bits$"):
        decode_gaps(2**63 - 2, wraps, top)


def test_the_numpy_gap_encoder_is_used_without_numba(monkeypatch: pytest.MonkeyPatch) -> None:
    from refit_sidecar import compiled

    monkeypatch.setenv(compiled.KERNELS_ENV, "numpy")
    _gap_kernels.cache_clear()
    try:
        assert _gap_kernels() is None
        enc = encode_positions(np.array([1, 5, 6, 300], dtype=np.int64), 301)
        assert (enc.kind, enc.start, enc.width) == (LocKind.GAPS, 1, 2)
        assert enc.gaps is not None
        assert enc.gaps.tolist() == [3, 0, 293]
    finally:
        monkeypatch.delenv(compiled.KERNELS_ENV)
        _gap_kernels.cache_clear()
    assert _gap_kernels() is not None
