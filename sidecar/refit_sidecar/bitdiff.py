"""Step 1 — change detection on stored bits through same-width integer views.

Float equality misses changes (0.0 == -0.0) and invents them (NaN != NaN); comparing the stored
bit patterns through an integer view of the same width finds exactly the elements a dense
refit would rewrite: signed zeros, NaN payloads and subnormals all count.

`diff_bits` is the producer's hot kernel. It compares 64-bit words (four BF16 values at a time)
and emits the position, new bits and XOR mask of each changed element in the same pass. It is
compiled with numba (`_diff_words`, GIL released for the whole slice) because numpy has no fused
"compare and emit" kernel: the numpy formulation (`diff_bits_numpy`, kept as the fallback and as
an independent oracle in the tests) needs ~10 passes and holds the GIL between them, which made
change detection 2-4x a bare compare and limited two-thread scaling (docs/performance.md).
`submit_slices` spreads one large tensor over several threads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from refit_sidecar import compiled

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: numpy dtype of the same-width integer view, by element width in bytes.
NP_INT_VIEW: dict[int, np.dtype[np.generic]] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int16),
    4: np.dtype(np.int32),
    8: np.dtype(np.int64),
}
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
#: Slice size for spreading one large tensor over compare threads.
DEFAULT_SLICE_BYTES = 16 << 20


class UnsupportedDtypeError(TypeError):
    """The dtype has no same-width integer view (e.g. complex or sub-byte types)."""


def int_view(t: torch.Tensor) -> torch.Tensor:
    """A flat view of `t`'s stored bits as integers of the same width (no copy if contiguous)."""
    width = t.element_size()
    target = _INT_VIEW.get(width)
    if target is None or t.is_complex():
        raise UnsupportedDtypeError(f"no integer view for {t.dtype}")
    flat = t.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(target)


def bits_numpy(t: torch.Tensor) -> npt.NDArray[np.generic]:
    """`int_view(t)` as a numpy array sharing memory (CPU tensors only)."""
    return int_view(t.detach()).cpu().numpy()


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


@dataclass(frozen=True)
class BitDiff:
    """The changed elements of one flat tensor: where, the new stored bits, and the XOR mask."""

    locations: npt.NDArray[np.int64]
    new_bits: npt.NDArray[np.generic]
    xor_bits: npt.NDArray[np.generic]

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
) -> BitDiff:
    """Compare two flat integer views (same dtype and size) and return their changed elements.

    Locations are sorted int64 and 64-bit safe; values keep the integer view's dtype.
    `block_words` only shapes the numpy fallback.
    """
    _check_views(old, new)
    kernel = _compiled_kernel()
    if kernel is None:
        return diff_bits_numpy(old, new, block_words=block_words)
    return _diff_compiled(kernel, old, new)


def _diff_compiled(
    kernel: Callable[..., Any], old: npt.NDArray[Any], new: npt.NDArray[Any]
) -> BitDiff:
    per = 8 // old.dtype.itemsize  # elements per 64-bit word
    old_c = np.ascontiguousarray(old)
    new_c = np.ascontiguousarray(new)
    n_words = old_c.size // per
    head = n_words * per
    old_w = old_c[:head].view(_WORD)
    new_w = new_c[:head].view(_WORD)
    parts: list[BitDiff] = []
    word = 0
    lanes = _UINT_VIEW[old.dtype.itemsize]  # the kernel writes unsigned lanes
    capacity = max(head // _FIRST_CAPACITY_DIVISOR, _MIN_CAPACITY)
    while word < n_words:
        locs = np.empty(capacity, dtype=np.int64)
        news = np.empty(capacity, dtype=lanes)
        xors = np.empty(capacity, dtype=lanes)
        word, k = kernel(old_w, new_w, per, word, locs, news, xors)
        if k:  # shrink in place (realloc): the pending delta must not pin the spare capacity
            for buf in (locs, news, xors):
                buf.resize(k, refcheck=False)
            parts.append(BitDiff(locs, news.view(old.dtype), xors.view(old.dtype)))
        capacity = min(capacity * 2, max(head, _MIN_CAPACITY))
    if head < old_c.size:  # the last < 8 bytes, element by element
        tail = np.flatnonzero(old_c[head:] != new_c[head:])
        if tail.size:
            pos = (tail + head).astype(np.int64)
            parts.append(BitDiff(pos, new_c[pos], np.bitwise_xor(old_c[pos], new_c[pos])))
    if not parts:
        return _empty(old.dtype)
    if len(parts) == 1:
        return parts[0]
    return BitDiff(
        locations=np.concatenate([p.locations for p in parts]),
        new_bits=np.concatenate([p.new_bits for p in parts]),
        xor_bits=np.concatenate([p.xor_bits for p in parts]),
    )


def diff_bits_numpy(
    old: npt.NDArray[np.generic],
    new: npt.NDArray[np.generic],
    *,
    block_words: int = DEFAULT_BLOCK_WORDS,
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
    return BitDiff(
        locations=np.concatenate(locs).astype(np.int64, copy=False),
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
) -> list[tuple[int, Future[BitDiff]]]:
    """Start the slice diffs of one tensor; pair with `gather_slices`."""
    if old.dtype != new.dtype or old.shape != new.shape or old.ndim != 1:
        raise ValueError(f"cannot compare {old.dtype}{old.shape} with {new.dtype}{new.shape}")
    step = max(slice_bytes // old.dtype.itemsize // 8 * 8, 8)  # whole 64-bit words
    return [
        (
            start,
            pool.submit(
                diff_bits,
                old[start : start + step],
                new[start : start + step],
                block_words=block_words,
            ),
        )
        for start in range(0, max(old.size, 1), step)
    ]


def gather_slices(parts: list[tuple[int, Future[BitDiff]]]) -> BitDiff:
    """Join slice results in order, shifting slice-local positions to tensor positions."""
    diffs = [(start, fut.result()) for start, fut in parts]
    if len(diffs) == 1:
        return diffs[0][1]
    found = [(start, d) for start, d in diffs if d.count]
    if not found:
        return diffs[0][1]
    return BitDiff(
        locations=np.concatenate([d.locations + start for start, d in found]),
        new_bits=np.concatenate([d.new_bits for _, d in found]),
        xor_bits=np.concatenate([d.xor_bits for _, d in found]),
    )


@functools.cache
def _compiled_kernel() -> Callable[..., Any] | None:
    """The numba kernel, or None (numpy fallback) when numba is missing or disabled."""
    if not compiled.enabled():
        return None
    from numba.cpython.unsafe.numbers import trailing_zeros  # an LLVM cttz intrinsic

    def _diff_words(old_w, new_w, per, word, locs, news, xors):  # type: ignore[no-untyped-def]
        """Scan 64-bit words from `word`; emit each changed element until the output is full.

        Two phases per block of words. First, the indices of changed words are compacted into a
        small buffer (branch-free, stays in L1). Then, for each changed word, a SWAR test marks
        the top bit of every nonzero lane of the XOR and only those lanes are visited, lowest
        first (count-trailing-zeros): at 1-5% of BF16 elements a changed word nearly always has
        one changed lane, so this does a quarter of the work of writing all four lanes and the
        loop exit is well predicted. Returns (next word to scan, elements written)."""
        n_words = old_w.size
        cap = locs.size
        k = 0
        block = 2048
        buf = np.empty(block, np.int64)
        bits = 64 // per
        lane_shift = 3  # log2(bits): a bit position >> lane_shift is its lane
        while (1 << lane_shift) < bits:
            lane_shift += 1
        full = np.uint64(0xFFFFFFFFFFFFFFFF)
        lane_mask = full if per == 1 else (np.uint64(1) << np.uint64(bits)) - np.uint64(1)
        top = np.uint64(0)  # the top bit of every lane
        for lane in range(per):
            top |= np.uint64(1) << np.uint64(lane * bits + bits - 1)
        below = ~top
        while word < n_words:
            stop = min(word + block, n_words)
            if k + (stop - word) * per > cap:  # a worst-case block must fit
                room = (cap - k) // per
                if room <= 0:
                    break
                stop = word + room
            c = 0
            for i in range(word, stop):
                buf[c] = i
                c += old_w[i] != new_w[i]
            for j in range(c):
                w = buf[j]
                b = new_w[w]
                x = old_w[w] ^ b
                # a lane is nonzero iff its top bit is set or its lower bits carry into it
                nonzero = (((x & below) + below) | x) & top
                base = w * per
                while nonzero:
                    lane = trailing_zeros(nonzero) >> lane_shift
                    shift = np.uint64(lane * bits)
                    locs[k] = base + lane
                    news[k] = (b >> shift) & lane_mask
                    xors[k] = (x >> shift) & lane_mask
                    k += 1
                    nonzero &= nonzero - np.uint64(1)
            word = stop
        return word, k

    return compiled.njit(_diff_words)


def kernel_name() -> str:
    """Which change-detection kernel this process uses ("numba" or "numpy")."""
    return "numpy" if _compiled_kernel() is None else "numba"
