"""❶ compare — change detection on stored bits through same-width integer views.

Float equality misses changes (0.0 == -0.0) and invents them (NaN != NaN); comparing the stored
bit patterns through an integer view of the same width finds exactly the elements a dense
refit would rewrite: signed zeros, NaN payloads and subnormals all count.

`diff_bits` is the producer's hot kernel. It compares 64-bit words (four BF16 values at a time)
and emits the position, new bits and XOR mask of each changed element in the same pass. It is
compiled with numba (`diff_kernel.diff_words`, GIL released for the whole slice) because numpy
has no fused "compare and emit" kernel: the numpy formulation (`diff_bits_numpy`, kept as the
fallback and as an independent oracle in the tests) needs ~10 passes and holds the GIL between
them, which made change detection 2-4x a bare compare and limited two-thread scaling
(docs/performance.md).
`submit_slices` spreads one large tensor over several threads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import numpy as np
import numpy.typing as npt
import torch

from refit_sidecar import compiled
from refit_sidecar.bits import NP_INT_VIEW, UnsupportedDtypeError, bits_numpy, int_view

_UINT_VIEW = {w: np.dtype(f"<u{w}") for w in (1, 2, 4, 8)}
_WORD = np.dtype(np.uint64)
#: Words per block of the numpy fallback: 2 x 512 KiB of input and a 64 Ki-entry mask stay in
#: L2 cache. (The compiled kernel streams and needs no blocks.)
DEFAULT_BLOCK_WORDS = 1 << 16
#: Fallback words per block when several compare threads share the GIL: fewer numpy calls per
#: byte, so less Python glue under the GIL (two threads ~1.7x instead of ~1.4x).
PARALLEL_BLOCK_WORDS = 1 << 18
#: Output capacity of one kernel call, as a fraction of the slice's elements (1/16 covers every
#: rate up to ~6% in one call; denser changes continue in further calls).
_FIRST_CAPACITY_DIVISOR = 16
_MIN_CAPACITY = 1 << 12
#: Spare room kept in recyclable output buffers, as a fraction (1/8) of the elements found, so a
#: next attempt with a few more changes still fits in one kernel call.
_HEADROOM_SHIFT = 3
#: Slice size for spreading one large tensor over compare threads. Large enough that only big
#: tensors (embeddings) are sliced: joining slice results costs a copy of the output.
DEFAULT_SLICE_BYTES = 64 << 20


def changed_mask(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Boolean mask (flat) of elements whose stored bits differ between `old` and `new`."""
    _check_pair(old, new)
    return torch.ne(int_view(old), int_view(new))


def changed_locations(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Sorted int64 flat indices of the changed elements."""
    _check_pair(old, new)
    if old.device.type != "cpu" or new.device.type != "cpu":
        return torch.nonzero(changed_mask(old, new), as_tuple=False).reshape(-1)
    diff = diff_bits(bits_numpy(old), bits_numpy(new))
    return torch.from_numpy(diff.locations)


def _check_pair(old: torch.Tensor, new: torch.Tensor) -> None:
    if old.dtype != new.dtype or old.shape != new.shape:
        raise ValueError(
            f"cannot compare {old.dtype}{tuple(old.shape)} with {new.dtype}{tuple(new.shape)}"
        )


@dataclass(frozen=True, eq=False)
class DiffBuffers:
    """Output arrays `diff_bits` can write a result into (unsigned lanes of the element width).

    At a few percent of changed elements the output is ~12 bytes per change, and writing it to
    fresh memory costs a page fault and a zeroed page per 4 KiB: about a sixth of the encode
    time (docs/performance.md). A caller that hands a finished result's buffers back to the next
    `diff_bits` of the same tensor writes into pages it already has.
    """

    locations: npt.NDArray[np.int64]
    new_bits: npt.NDArray[np.generic]
    xor_bits: npt.NDArray[np.generic]

    @classmethod
    def allocate(cls, capacity: int, lanes: np.dtype[Any]) -> DiffBuffers:
        return cls(
            np.empty(capacity, np.int64), np.empty(capacity, lanes), np.empty(capacity, lanes)
        )

    @property
    def capacity(self) -> int:
        return int(self.locations.size)

    def shrink(self, capacity: int) -> None:
        """Give back the memory past `capacity` in place (realloc; the arrays own their data)."""
        for buf in (self.locations, self.new_bits, self.xor_bits):
            buf.resize(capacity, refcheck=False)


#: "Recycle, but nothing to reuse yet": `diff_bits(..., reuse=NO_BUFFERS)` returns a result with
#: recyclable buffers.
NO_BUFFERS = DiffBuffers.allocate(0, np.dtype(np.uint8))


@dataclass(frozen=True)
class BitDiff:
    """The changed elements of one flat tensor: where, the new stored bits, and the XOR mask.

    `buffers`, when the caller asked to recycle, are the arrays the result lives in; they may be
    passed to a later `diff_bits` only once nothing reads this result any more.
    """

    locations: npt.NDArray[np.int64]
    new_bits: npt.NDArray[np.generic]
    xor_bits: npt.NDArray[np.generic]
    buffers: DiffBuffers | None = field(default=None, compare=False, repr=False)

    @property
    def count(self) -> int:
        return int(self.locations.size)


def _check_views(old: npt.NDArray[np.generic], new: npt.NDArray[np.generic]) -> None:
    if old.dtype != new.dtype or old.shape != new.shape or old.ndim != 1:
        raise ValueError(f"cannot compare {old.dtype}{old.shape} with {new.dtype}{new.shape}")
    if NP_INT_VIEW.get(old.dtype.itemsize) != old.dtype:
        raise UnsupportedDtypeError(f"diff_bits needs an integer view, got {old.dtype}")


def _empty(dtype: np.dtype[Any]) -> BitDiff:
    empty = np.empty(0, dtype=dtype)
    return BitDiff(np.empty(0, dtype=np.int64), empty, empty.copy())


def diff_bits(
    old: npt.NDArray[np.generic],
    new: npt.NDArray[np.generic],
    *,
    block_words: int = DEFAULT_BLOCK_WORDS,
    offset: int = 0,
    reuse: DiffBuffers | None = None,
) -> BitDiff:
    """Compare two flat integer views (same dtype and size) and return their changed elements.

    Locations are sorted int64 and 64-bit safe, counted from `offset` (a slice's start in its
    tensor, so slice results need no second pass); values keep the integer view's dtype.
    With `reuse` (`NO_BUFFERS` or an earlier result's `buffers`), the result is written into
    those buffers where it fits and carries the buffers it lives in, with 1/8 spare room, for
    the next call; without it, the result owns exactly its data. `block_words` only shapes the
    numpy fallback (which does not recycle).
    """
    _check_views(old, new)
    if offset < 0:
        raise ValueError("offset must not be negative")
    kernel = _compiled_kernel()
    if kernel is None:
        return diff_bits_numpy(old, new, block_words=block_words, offset=offset)
    return _diff_compiled(kernel, old, new, offset, reuse)


def _diff_compiled(
    kernel: Callable[..., Any],
    old: npt.NDArray[Any],
    new: npt.NDArray[Any],
    offset: int,
    reuse: DiffBuffers | None,
) -> BitDiff:
    per = 8 // old.dtype.itemsize  # elements per 64-bit word
    old_c = np.ascontiguousarray(old)
    new_c = np.ascontiguousarray(new)
    n_words = old_c.size // per
    head = n_words * per
    old_w = old_c[:head].view(_WORD)
    new_w = new_c[:head].view(_WORD)
    lanes = _UINT_VIEW[old.dtype.itemsize]  # the kernel writes unsigned lanes
    recycle = reuse is not None
    given = reuse if _fits(reuse, lanes, 1) else None
    filled: list[tuple[DiffBuffers, int]] = []
    bufs = given
    word = 0
    capacity = max(head // _FIRST_CAPACITY_DIVISOR, _MIN_CAPACITY)
    while word < n_words:
        if bufs is None:
            bufs = DiffBuffers.allocate(capacity, lanes)
            capacity = min(capacity * 2, max(head, _MIN_CAPACITY))
        word, k = kernel(
            old_w, new_w, per, word, offset, bufs.locations, bufs.new_bits, bufs.xor_bits
        )
        if k:
            filled.append((bufs, k))
        bufs = None
    tail: tuple[npt.NDArray[np.int64], npt.NDArray[Any], npt.NDArray[Any]] | None = None
    if head < old_c.size:  # the last < 8 bytes, element by element
        found = np.flatnonzero(old_c[head:] != new_c[head:])
        if found.size:
            pos = (found + head).astype(np.int64)
            xor = np.bitwise_xor(old_c[pos], new_c[pos])
            tail = (pos + offset, new_c[pos].view(lanes), xor.view(lanes))
    if tail is not None and len(filled) <= 1:  # the tail fits in place after the kernel's part
        room, k = filled[0] if filled else (given, 0)
        n_tail = tail[0].size
        if room is not None and room.capacity >= k + n_tail:
            for dst, src in zip((room.locations, room.new_bits, room.xor_bits), tail, strict=True):
                dst[k : k + n_tail] = src
            filled, tail = [(room, k + n_tail)], None
    if len(filled) == 1 and tail is None:  # the usual case: one call, in place
        out, total = filled[0]
        if out is not given:  # fresh: give back the spare capacity (realloc, in place)
            keep = total + (total >> _HEADROOM_SHIFT if recycle else 0)
            if keep < out.capacity:
                out.shrink(keep)
        return _result(out, total, old.dtype, recycle)
    pieces = [(b.locations[:k], b.new_bits[:k], b.xor_bits[:k]) for b, k in filled]
    if filled and filled[0][0] is given:  # `given` holds the first piece: join elsewhere
        reuse = NO_BUFFERS
    return _join(pieces + ([] if tail is None else [tail]), old.dtype, reuse)


Pieces = list[tuple[npt.NDArray[np.int64], npt.NDArray[Any], npt.NDArray[Any]]]


def _join(pieces: Pieces, dtype: np.dtype[Any], reuse: DiffBuffers | None) -> BitDiff:
    """One result from consecutive pieces, in `reuse`'s buffers if they fit, with one copy."""
    total = sum(p[0].size for p in pieces)
    lanes = _UINT_VIEW[dtype.itemsize]
    if total == 0:
        empty = _empty(dtype)
        return BitDiff(empty.locations, empty.new_bits, empty.xor_bits, reuse)
    if _fits(reuse, lanes, total):
        out = reuse
    else:
        spare = total >> _HEADROOM_SHIFT if reuse is not None else 0
        out = DiffBuffers.allocate(total + spare, lanes)
    for i, dst in enumerate((out.locations, out.new_bits, out.xor_bits)):
        np.concatenate([p[i].view(dst.dtype) for p in pieces], out=dst[:total])
    return _result(out, total, dtype, reuse is not None)


def _fits(reuse: DiffBuffers | None, lanes: np.dtype[Any], n: int) -> TypeGuard[DiffBuffers]:
    """Whether `reuse` can hold `n` elements of `lanes`."""
    return reuse is not None and reuse.capacity >= n and reuse.new_bits.dtype == lanes


def _result(out: DiffBuffers, total: int, dtype: np.dtype[Any], recycle: bool) -> BitDiff:
    if not recycle and out.capacity == total:  # owns exactly its data: hand out the arrays
        return BitDiff(out.locations, out.new_bits.view(dtype), out.xor_bits.view(dtype))
    return BitDiff(
        out.locations[:total],
        out.new_bits[:total].view(dtype),
        out.xor_bits[:total].view(dtype),
        out if recycle else None,
    )


def diff_bits_numpy(
    old: npt.NDArray[np.generic],
    new: npt.NDArray[np.generic],
    *,
    block_words: int = DEFAULT_BLOCK_WORDS,
    offset: int = 0,
) -> BitDiff:
    """`diff_bits` in plain numpy kernels, block by block (fallback and test oracle)."""
    _check_views(old, new)
    width = old.dtype.itemsize
    if block_words < 1:
        raise ValueError("block_words must be positive")
    per = 8 // width  # elements per 64-bit word
    shift = per.bit_length() - 1
    n_words = old.size // per
    head = n_words * per
    old_c = np.ascontiguousarray(old)
    new_c = np.ascontiguousarray(new)
    old_w = old_c[:head].view(_WORD)
    new_w = new_c[:head].view(_WORD)

    locs: list[npt.NDArray[np.int64]] = []
    news: list[npt.NDArray[np.generic]] = []
    xors: list[npt.NDArray[np.generic]] = []
    mask = np.empty(min(block_words, max(n_words, 1)), dtype=np.bool_)
    for start in range(0, n_words, block_words):
        stop = min(start + block_words, n_words)
        m = mask[: stop - start]
        np.not_equal(old_w[start:stop], new_w[start:stop], out=m)
        words = m.nonzero()[0]
        if words.size == 0:
            continue
        words += start
        new_g = new_w.take(words)
        xor_g = np.bitwise_xor(old_w.take(words), new_g)
        if per == 1:
            locs.append(words)
            news.append(new_g.view(old.dtype))
            xors.append(xor_g.view(old.dtype))
            continue
        xor_e = xor_g.view(old.dtype)
        k = (xor_e != 0).nonzero()[0]
        pos = words.take(k >> shift)
        pos <<= shift
        pos += k & (per - 1)
        locs.append(pos)
        news.append(new_g.view(old.dtype).take(k))
        xors.append(xor_e.take(k))
    if head < old.size:  # the last < 8 bytes, element by element
        tail = np.flatnonzero(old_c[head:] != new_c[head:])
        if tail.size:
            locs.append((tail + head).astype(np.int64))
            news.append(new_c[head:][tail])
            xors.append(np.bitwise_xor(old_c[head:][tail], new_c[head:][tail]))
    if not locs:
        return _empty(old.dtype)
    positions = np.concatenate(locs).astype(np.int64, copy=False)
    if offset:
        positions += offset
    return BitDiff(
        locations=positions,
        new_bits=np.concatenate(news),
        xor_bits=np.concatenate(xors),
    )


def diff_bits_parallel(
    old: npt.NDArray[np.generic],
    new: npt.NDArray[np.generic],
    pool: Executor,
    *,
    slice_bytes: int = DEFAULT_SLICE_BYTES,
    block_words: int = PARALLEL_BLOCK_WORDS,
) -> BitDiff:
    """`diff_bits` over word-aligned slices run on `pool`, so one large tensor (an embedding)
    does not leave the other compare threads idle. Same result as `diff_bits`."""
    parts = submit_slices(old, new, pool, slice_bytes=slice_bytes, block_words=block_words)
    return gather_slices(parts)


def submit_slices(
    old: npt.NDArray[np.generic],
    new: npt.NDArray[np.generic],
    pool: Executor,
    *,
    slice_bytes: int = DEFAULT_SLICE_BYTES,
    block_words: int = PARALLEL_BLOCK_WORDS,
    reuse: DiffBuffers | None = None,
) -> list[tuple[int, Future[BitDiff]]]:
    """Start the slice diffs of one tensor; pair with `gather_slices` (same `reuse`)."""
    if old.dtype != new.dtype or old.shape != new.shape or old.ndim != 1:
        raise ValueError(f"cannot compare {old.dtype}{old.shape} with {new.dtype}{new.shape}")
    step = max(slice_bytes // old.dtype.itemsize // 8 * 8, 8)  # whole 64-bit words
    starts = range(0, max(old.size, 1), step)
    one = len(starts) == 1  # a single slice writes into `reuse` itself; several are joined into it
    return [
        (
            start,
            pool.submit(
                diff_bits,
                old[start : start + step],
                new[start : start + step],
                block_words=block_words,
                offset=start,
                reuse=reuse if one else None,
            ),
        )
        for start in starts
    ]


def gather_slices(
    parts: list[tuple[int, Future[BitDiff]]], *, reuse: DiffBuffers | None = None
) -> BitDiff:
    """Join slice results in order (their positions are already tensor positions)."""
    diffs = [fut.result() for _, fut in parts]
    if len(diffs) == 1:
        return diffs[0]
    found = [d for d in diffs if d.count]
    if not found:
        return diffs[0] if reuse is None else _join([], diffs[0].new_bits.dtype, reuse)
    dtype = found[0].new_bits.dtype
    return _join([(d.locations, d.new_bits, d.xor_bits) for d in found], dtype, reuse)


@functools.cache
def _compiled_kernel() -> Callable[..., Any] | None:
    """The numba kernel, or None (numpy fallback) when numba is missing or disabled."""
    if not compiled.enabled():
        return None
    from refit_sidecar import diff_kernel  # imports numba: only processes that compare

    return compiled.njit(diff_kernel.diff_words)


def kernel_name() -> str:
    """Which change-detection kernel this process uses ("numba" or "numpy")."""
    return "numpy" if _compiled_kernel() is None else "numba"
