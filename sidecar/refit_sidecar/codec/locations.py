"""Location and byte-plane encodings of the wire format.

A contiguous run is stored as (start, count) and costs no location bytes. Other sorted positions
are stored as `start` plus gaps `g_i = p_i - p_{i-1} - 1` in the smallest lossless unsigned width
(1, 2, 4 or 8 bytes); sortedness and uniqueness then hold by construction.

Multi-byte buffers are byte-plane shuffled before zstd (all low bytes, then the next plane, ...).
Gaps and XOR masks of small updates have nearly constant high bytes, so each plane becomes one
homogeneous stream for zstd's entropy coder; docs/performance.md reports the measured gain.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from refit_sidecar import compiled
from refit_sidecar.codec.errors import LocationError

#: Little-endian unsigned gap dtypes by width.
GAP_DTYPES: dict[int, np.dtype[Any]] = {
    1: np.dtype("<u1"),
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
    8: np.dtype("<u8"),
}
#: Canonical element counts stay below 2**62, so position arithmetic never overflows int64.
MAX_NUMEL = 1 << 62


class LocKind(enum.IntEnum):
    """How an item's positions are stored."""

    RANGE = 0
    GAPS = 1


@dataclass(frozen=True)
class EncodedLocations:
    """Wire form of one item's positions: a run, or `start` plus `count - 1` gaps."""

    kind: LocKind
    start: int
    width: int  # 0 for RANGE
    gaps: npt.NDArray[Any] | None


def gap_width(max_gap: int) -> int:
    """Smallest unsigned width (bytes) that holds `max_gap`."""
    for w in (1, 2, 4):
        if max_gap < 1 << (8 * w):
            return w
    return 8


def encode_run(start: int) -> EncodedLocations:
    return EncodedLocations(LocKind.RANGE, start, 0, None)


def encode_positions(positions: npt.NDArray[np.int64], numel: int) -> EncodedLocations:
    """Encode sorted unique int64 positions (a run when contiguous); checks order and range."""
    count = int(positions.size)
    if count == 0:
        raise LocationError("an item needs at least one location")
    first, last = int(positions[0]), int(positions[-1])
    if first < 0 or last >= numel:
        raise LocationError(f"locations [{first}, {last}] outside a tensor of {numel} elements")
    if last - first + 1 == count:
        _require_strictly_increasing(positions)
        return encode_run(first)  # strictly increasing over this span: contiguous
    kernels = _gap_kernels()
    if kernels is None:
        return _encode_gaps_numpy(positions)
    max_gap_fn, narrow = kernels
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    max_gap = int(max_gap_fn(positions))
    if max_gap < 0:
        raise LocationError("locations must be strictly increasing")
    w = gap_width(max_gap)
    gaps = np.empty(count - 1, dtype=GAP_DTYPES[w])
    narrow(positions, gaps)
    return EncodedLocations(LocKind.GAPS, first, w, gaps)


def _require_strictly_increasing(positions: npt.NDArray[np.int64]) -> None:
    if positions.size > 1 and not bool(np.all(positions[1:] > positions[:-1])):
        raise LocationError("locations must be strictly increasing")


def _encode_gaps_numpy(positions: npt.NDArray[np.int64]) -> EncodedLocations:
    """Gap encoding in numpy passes (the fallback, and the tests' oracle)."""
    gaps = np.diff(positions)
    if int(gaps.min()) < 1:
        raise LocationError("locations must be strictly increasing")
    gaps -= 1
    w = gap_width(int(gaps.max()))
    return EncodedLocations(LocKind.GAPS, int(positions[0]), w, gaps.astype(GAP_DTYPES[w]))


@functools.cache
def _gap_kernels() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """Compiled (max gap, narrow) kernels: two passes instead of numpy's six (diff, min,
    subtract, max, cast) over the int64 positions. None: use the numpy formulation."""
    if not compiled.enabled():
        return None

    def _max_gap(pos):  # type: ignore[no-untyped-def]
        """Largest gap p[i] - p[i-1] - 1, or -1 unless strictly increasing (compared, not
        subtracted, so no overflow can hide a decrease)."""
        hi = 0
        bad = False
        for i in range(1, pos.size):
            bad |= pos[i] <= pos[i - 1]
            hi = max(hi, pos[i] - pos[i - 1] - 1)
        return -1 if bad else hi

    def _narrow(pos, out):  # type: ignore[no-untyped-def]
        """Write the gaps into `out` (a width that holds the largest)."""
        for i in range(1, pos.size):
            out[i - 1] = pos[i] - pos[i - 1] - 1

    return compiled.njit(_max_gap), compiled.njit(_narrow)


def decode_gaps(start: int, gaps: npt.NDArray[Any], numel: int) -> npt.NDArray[np.int64]:
    """Positions from untrusted `start` and gaps; LocationError unless all lie in [0, numel)."""
    if not 0 <= start < numel:
        raise LocationError(f"first location {start} outside a tensor of {numel} elements")
    count = gaps.size + 1
    if gaps.size == 0:
        return np.array([start], dtype=np.int64)
    max_gap = int(gaps.max())
    if max_gap >= numel:
        raise LocationError(f"gap {max_gap} exceeds a tensor of {numel} elements")
    out = np.empty(count, dtype=np.int64)
    out[0] = start
    bound = start + (count - 1) * (max_gap + 1)
    if bound < 1 << 63:  # no partial sum can overflow int64
        steps = gaps.astype(np.int64)
        steps += 1
        np.cumsum(steps, out=out[1:])
        out[1:] += start
    else:  # increments are < 2**62, so a wrap-around shows up as a decrease
        acc = np.cumsum(gaps.astype(np.uint64) + np.uint64(1), dtype=np.uint64)
        acc += np.uint64(start)
        if acc.size > 1 and not bool(np.all(acc[1:] > acc[:-1])):
            raise LocationError("locations overflow 64 bits")
        if int(acc[-1]) >= numel:
            raise LocationError(f"last location {int(acc[-1])} outside {numel} elements")
        out[1:] = acc.astype(np.int64)
    last = int(out[-1])
    if last >= numel:
        raise LocationError(f"last location {last} outside a tensor of {numel} elements")
    return out


def unshuffle(
    planes: npt.NDArray[np.uint8], dtype: np.dtype[np.generic]
) -> npt.NDArray[np.generic]:
    """Inverse of `shuffle` into a new array of `dtype`.

    One strided copy per plane: 2.8-5x faster for 2- and 4-byte elements than numpy's copy of
    the transposed (w, n) view, and as fast for 8 bytes (the receiver's decode runs this on
    every value and gap group)."""
    w = dtype.itemsize
    if w == 1:
        return planes.view(dtype)
    by_plane = planes.reshape(w, -1)
    out = np.empty((by_plane.shape[1], w), dtype=np.uint8)
    for j in range(w):
        out[:, j] = by_plane[j]
    return out.reshape(-1).view(dtype)
