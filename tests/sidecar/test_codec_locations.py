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
)

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
        assert enc.kind is LocKind.RANGE
        return
    oracle = _encode_gaps_numpy(positions)
    assert (enc.kind, enc.start, enc.width) == (LocKind.GAPS, oracle.start, oracle.width)
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
    with pytest.raises(LocationError, match="strictly increasing"):
        encode_positions(np.array(positions, dtype=np.int64), 2**62 + 1)


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
    with pytest.raises(LocationError, match="outside"):
        decode_gaps(numel, np.array([], dtype=np.uint64), numel)  # first == numel
    assert decode_gaps(numel - 1, np.array([], dtype=np.uint64), numel).tolist() == [numel - 1]
