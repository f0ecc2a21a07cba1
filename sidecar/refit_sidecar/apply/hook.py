"""The storage-write dispatch hook: active only around one native `load_weights` call.

Every aten op the loader runs passes through `__torch_dispatch__`. Ops that write into model
parameter/buffer storage (found by storage identity, so views and offsets count) are either an
`aten.copy_` — turned into an XOR or a masked overwrite, or (COMPARE, the audit) compared with
what the copy would write and not performed — or a fill that would change no bit there (vLLM
zeroes the rows it pads a vocabulary with on every load), skipped, or fail the apply. Nothing
else is touched: views, reads and writes to other tensors run unchanged.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from refit_sidecar.apply.errors import (
    OverlappingXorError,
    PlaceholderCollisionError,
    PostApplyCheckError,
    UnsupportedWriteError,
    XorTransformError,
)
from refit_sidecar.apply.placeholders import Placeholder, active_mask
from refit_sidecar.apply.storage import ModelStorages, storage_key
from refit_sidecar.bits import int_dtype

aten = torch.ops.aten
#: Fills into model storage: taken only where they would change no bit (`_fill`).
_FILLS = (aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default)


class Mode(enum.Enum):
    DISCOVER = "discover"  # prewarm: classify copies, write nothing
    XOR = "xor"
    OVERWRITE = "overwrite"
    COMPARE = "compare"  # audit: compare each copy's result with the destination, write nothing


#: Mismatching positions kept per destination view (the count is always exact).
MISMATCH_SAMPLES = 8
#: COMPARE works through a destination in blocks of rows of about this size.
COMPARE_BLOCK_BYTES = 16 << 20


def _ints(t: torch.Tensor) -> torch.Tensor:
    """Same-shape integer view (works for strided views: element size is unchanged)."""
    return t.view(int_dtype(t))


def _shown(value: Any) -> str:
    """A fill value for a message (a 0-dim tensor shows as its number)."""
    return repr(value.item() if isinstance(value, torch.Tensor) else value)


@dataclass
class CopyTrace:
    """One intercepted copy into model storage."""

    names: tuple[str, ...]
    xor_compatible: bool
    reason: str = ""


@dataclass
class Mismatch:
    """COMPARE: destination bits that differ from what a copy would write."""

    storages: tuple[str, ...]
    count: int
    positions: list[int]  # flat positions in the destination view (the first few)
    held_bits: list[int]  # what the destination holds there (integer views)
    expected_bits: list[int]  # what the copy would write there


@dataclass
class ItemTrace:
    """What the hook saw while one item's loader call ran."""

    copies: list[CopyTrace] = field(default_factory=list)
    checked: int = 0
    compared: int = 0  # COMPARE: destination elements compared
    mismatches: list[Mismatch] = field(default_factory=list)
    scratch_written: bool = False  # the loader changed scratch in place (masks not preserved)

    @property
    def written_storages(self) -> set[str]:
        return {n for c in self.copies for n in c.names}


@dataclass
class _Geometry:
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    itemsize: int

    def contiguous_span(self) -> tuple[int, int] | None:
        expected = 1
        for size, stride in reversed(list(zip(self.shape, self.stride, strict=True))):
            if size != 1 and stride != expected:
                return None
            expected *= size
        numel = expected
        start = self.offset * self.itemsize
        return start, start + numel * self.itemsize


class StorageWriteHook(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Intercepts writes into `storages` for the item set by `begin_item`."""

    def __init__(self, storages: ModelStorages, scratch: torch.Tensor) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._storages = storages
        self._scratch_key = storage_key(scratch)
        self._mode = Mode.DISCOVER
        self._name = ""
        self._placeholder = Placeholder(None)
        self._trace = ItemTrace()
        self._masks: dict[tuple[Any, ...], tuple[torch.Tensor, ...]] = {}
        self._xor_spans: dict[int, list[_Geometry]] = {}
        self._reach: tuple[int, int] | None = None
        # Post-apply checks left for the current apply call: 0 off, N elements, -1 every element.
        self.check_budget = 0
        self._generator = torch.Generator().manual_seed(0)

    # -- item lifecycle ---------------------------------------------------------------------
    def begin_item(
        self,
        name: str,
        mode: Mode,
        placeholder: Placeholder | None = None,
        reach: tuple[int, int] | None = None,
    ) -> None:
        """`reach` (XOR): the scratch bytes [lo, hi) that may hold nonzero masks; scratch is zero
        elsewhere, so each XOR copy is narrowed to the rows that can reach them."""
        self._name = name
        self._mode = mode
        self._placeholder = placeholder or Placeholder(None)
        self._trace = ItemTrace()
        self._masks = {}
        self._xor_spans = {}
        self._reach = reach

    def end_item(self) -> ItemTrace:
        trace, self._trace = self._trace, ItemTrace()
        self._masks = {}
        self._xor_spans = {}
        return trace

    # -- dispatch ---------------------------------------------------------------------------
    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        written = self._written_model_tensors(func, args, kwargs)
        if not written:
            return func(*args, **kwargs)
        if func is aten.copy_.default and len(written) == 1 and written[0] is args[0]:
            return self._copy(args[0], args[1])
        if func in _FILLS and len(written) == 1 and written[0] is args[0]:
            return self._fill(args[0], 0 if func is aten.zero_.default else args[1])
        names = sorted({n for t in written for n in (self._storages.names(t) or [])})
        raise UnsupportedWriteError(
            self._name,
            f"loader wrote into {names} with {func}; only copy_, and fills that change no bit, "
            "are supported",
        )

    def _written_model_tensors(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[torch.Tensor]:
        schema = func._schema
        if not schema.is_mutable:
            return []
        out: list[torch.Tensor] = []
        for i, arg in enumerate(schema.arguments):
            info = arg.alias_info
            if info is None or not info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in tree_flatten(value)[0]:
                if not isinstance(t, torch.Tensor) or t.numel() == 0:
                    continue
                if self._storages.names(t) is not None:
                    out.append(t)
                elif storage_key(t) == self._scratch_key:
                    self._trace.scratch_written = True
        return out

    # -- the intercepted copy -------------------------------------------------------------------
    def _copy(self, dest: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        names = tuple(self._storages.names(dest) or ())
        reason = self._xor_blocker(dest, src)
        overlap = self._record_xor_span(dest) if not reason else None
        if overlap:
            reason = overlap
        self._trace.copies.append(CopyTrace(names, xor_compatible=not reason, reason=reason))
        if self._mode is Mode.DISCOVER:
            return dest
        if self._mode is Mode.COMPARE:
            self._compare(dest, src, names)
            return dest
        if self._mode is Mode.XOR:
            if reason:
                exc = OverlappingXorError if overlap else XorTransformError
                raise exc(self._name, f"XOR copy into {list(names)} rejected: {reason}")
            self._xor(dest, src)
        else:
            self._overwrite(dest, src, names)
        return dest

    # -- the intercepted fill ---------------------------------------------------------------------
    def _fill(self, dest: torch.Tensor, value: Any) -> torch.Tensor:
        """A fill whose region already holds the value is skipped in every mode: skipping it is
        exactly the dense load (vLLM's padded vocabulary rows, zeroed by every load). A fill that
        would change bits writes values no payload carries (and the audit cannot tell whether a
        later copy covers them): every mode fails closed, writing nothing."""
        want = torch.empty((), dtype=dest.dtype, device=dest.device)
        want.fill_(value)  # the fill's own conversion of the value
        if torch.equal(_ints(dest), _ints(want.expand(dest.shape))):
            return dest
        raise UnsupportedWriteError(
            self._name,
            f"loader fills {list(self._storages.names(dest) or ())} with {_shown(value)} where "
            "they hold other bits: a dense load would write values no payload carries",
        )

    def _compare(self, dest: torch.Tensor, src: torch.Tensor, names: tuple[str, ...]) -> None:
        """What `dest.copy_(src)` would write, compared bit for bit with what `dest` holds, in
        blocks of rows (bounded temporaries) when the copy is shape to shape."""
        if dest.dim() >= 1 and tuple(src.shape) == tuple(dest.shape):
            row = max(dest[0].numel() * dest.element_size(), 1)
            step = max(COMPARE_BLOCK_BYTES // row, 1)
            blocks = [(i, dest[i : i + step], src[i : i + step]) for i in range(0, len(dest), step)]
            row_elems = dest[0].numel()
        else:
            blocks, row_elems = [(0, dest, src)], 0
        count = 0
        where: list[int] = []
        held_bits: list[int] = []
        want_bits: list[int] = []
        for first_row, d, s in blocks:
            expected = torch.empty(d.shape, dtype=d.dtype, device=d.device)
            expected.copy_(s)  # the copy's own casting and broadcasting
            held, want = _ints(d), _ints(expected)
            if torch.equal(held, want):
                continue
            differ = (held != want).reshape(-1)
            count += int(differ.sum())
            if len(where) < MISMATCH_SAMPLES:
                at = torch.nonzero(differ).reshape(-1)[: MISMATCH_SAMPLES - len(where)]
                flat_held, flat_want = held.reshape(-1), want.reshape(-1)
                where += [first_row * row_elems + int(i) for i in at]
                held_bits += [int(v) for v in flat_held[at]]
                want_bits += [int(v) for v in flat_want[at]]
        self._trace.compared += dest.numel()
        if count:
            self._trace.mismatches.append(Mismatch(names, count, where, held_bits, want_bits))

    def _xor_blocker(self, dest: torch.Tensor, src: Any) -> str:
        if not isinstance(src, torch.Tensor):
            return "source is not a tensor"
        if storage_key(src) != self._scratch_key:
            return "source is not a view of scratch (the loader transformed the values)"
        if self._trace.scratch_written:
            return "the loader modified scratch in place before copying"
        if src.dtype != dest.dtype:
            return f"dtype changes from {src.dtype} to {dest.dtype}"
        if tuple(src.shape) != tuple(dest.shape):
            return f"source shape {tuple(src.shape)} is broadcast to {tuple(dest.shape)}"
        return ""

    def _record_xor_span(self, dest: torch.Tensor) -> str:
        """Remember where this item's copies write; report an overlap with an earlier one."""
        geo = _Geometry(
            int(dest.storage_offset()),
            tuple(int(d) for d in dest.shape),
            tuple(int(d) for d in dest.stride()),
            dest.element_size(),
        )
        key = storage_key(dest)
        earlier = self._xor_spans.setdefault(key, [])
        span = geo.contiguous_span()
        for other_geo in earlier:
            other_span = other_geo.contiguous_span()
            if span is not None and other_span is not None:
                if span[0] < other_span[1] and other_span[0] < span[1]:
                    return "destination bytes overlap another copy of the same item"
            elif geo.itemsize == other_geo.itemsize:
                marks = torch.zeros(
                    dest.untyped_storage().nbytes() // geo.itemsize,
                    dtype=torch.uint8,
                    device=dest.device,
                )
                marks.as_strided(other_geo.shape, other_geo.stride, other_geo.offset).fill_(1)
                if bool(marks.as_strided(geo.shape, geo.stride, geo.offset).any()):
                    return "destination bytes overlap another copy of the same item"
            else:
                return "copies of different element sizes into one storage"
        earlier.append(geo)
        return ""

    def _xor(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        rows = _rows_reaching(src, self._reach) if self._reach is not None else None
        if rows is not None:
            first, count = rows
            if count == 0:
                return  # every mask this copy reads is zero: XOR changes nothing
            dest, src = dest.narrow(0, first, count), src.narrow(0, first, count)
        d, s = _ints(dest), _ints(src)
        pick = self._sample(d.numel(), dest.device)
        before = d.reshape(-1)[pick] if pick is not None else None  # a gather: a copy
        d.bitwise_xor_(s)
        if pick is not None and before is not None:
            restored = d.reshape(-1)[pick] ^ s.reshape(-1)[pick]
            self._verify(bool(torch.equal(restored, before)), "XOR mask does not restore bits")

    def _overwrite(self, dest: torch.Tensor, src: torch.Tensor, names: tuple[str, ...]) -> None:
        if dest.dim() == 0:  # a scalar: index it as one element
            dest, src = dest.view(1), src.reshape(1)
        if tuple(src.shape) != tuple(dest.shape):
            raise PlaceholderCollisionError(
                self._name, f"overwrite source {tuple(src.shape)} is broadcast into {names}"
            )
        if self._placeholder.covers_all:
            self._overwrite_whole(dest, src)
            return
        key = (storage_key(dest), dest.storage_offset(), tuple(dest.shape), tuple(dest.stride()))
        active = self._masks.get(key)
        if active is None:
            # The active positions of this destination view, fixed at its first copy.
            active = torch.nonzero(self._first_mask(dest, src, names), as_tuple=True)
            self._masks[key] = active
        d = _ints(dest)
        # Only active positions are converted and written (index_put_ on the strided view).
        d.index_put_(active, _ints(src[active].to(dest.dtype)))
        pick = self._sample(int(active[0].numel()) if active else 0, dest.device)
        if pick is not None:
            idx = tuple(a[pick] for a in active)
            want = _ints(src[idx].to(dest.dtype))
            self._verify(bool(torch.equal(d[idx], want)), "overwrite bits differ")

    def _overwrite_whole(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        """Every position is active: the copy a dense load makes, with optional checks."""
        d = _ints(dest)
        d.copy_(_ints(src.to(dest.dtype)))
        pick = self._sample(d.numel(), dest.device)
        if pick is not None:
            want = _ints(src.reshape(-1)[pick].to(dest.dtype))
            self._verify(bool(torch.equal(d.reshape(-1)[pick], want)), "overwrite bits differ")

    def _first_mask(
        self, dest: torch.Tensor, src: torch.Tensor, names: tuple[str, ...]
    ) -> torch.Tensor:
        ph = self._placeholder
        if ph.is_nan:
            if not src.is_floating_point() or src.element_size() < 2:
                raise PlaceholderCollisionError(
                    self._name,
                    f"copy into {list(names)} has a {src.dtype} source: the NaN placeholder "
                    "cannot form the active mask",
                )
            return active_mask(src, ph)
        # Exact-bit sentinels survive no transform: the source must be raw scratch.
        if storage_key(src) != self._scratch_key or src.dtype != dest.dtype:
            raise PlaceholderCollisionError(
                self._name,
                f"exact-bit placeholder needs an untransformed copy into {list(names)}",
            )
        return active_mask(src, ph)

    # -- optional post-apply checks ----------------------------------------------------------------
    def _sample(self, numel: int, device: torch.device) -> torch.Tensor | None:
        """Positions to check among `numel`: all of them (-1), a budget (N) or none (0)."""
        if self.check_budget == 0 or numel == 0:
            return None
        n = numel if self.check_budget < 0 else min(self.check_budget, numel)
        if self.check_budget > 0:
            self.check_budget -= n
        if n == numel:
            return torch.arange(n, device=device)
        return torch.randint(0, numel, (n,), generator=self._generator).to(device)

    def _verify(self, ok: bool, what: str) -> None:
        self._trace.checked += 1
        if not ok:
            raise PostApplyCheckError(self._name, what)


def _rows_reaching(src: torch.Tensor, reach: tuple[int, int]) -> tuple[int, int] | None:
    """The rows (dim 0) of `src` whose elements can lie in storage bytes [lo, hi): (first,
    count), or None to keep every row (a scalar, a zero or negative stride).

    A superset by construction: a row is kept when its byte extent meets [lo, hi), so a mask
    byte of the item is never left out, whatever the view's layout (a transposed view keeps
    every row). A part of a large tensor then costs an XOR over its own rows, not the tensor."""
    lo, hi = reach
    if src.dim() == 0 or src.numel() == 0:
        return None
    if hi <= lo:
        return 0, 0  # an item with no values
    size = src.element_size()
    strides = src.stride()
    if any(st < 0 for st in strides) or strides[0] == 0:
        return None
    row = strides[0] * size  # bytes between the starts of consecutive rows
    inner = zip(src.shape[1:], strides[1:], strict=True)
    extent = size + sum((n - 1) * st * size for n, st in inner)  # bytes of one row's span
    base = src.storage_offset() * size
    # rows i with base + i*row < hi and base + i*row + extent > lo
    first = min(max(0, (lo - base - extent) // row + 1), src.shape[0])
    last = min(src.shape[0], -((base - hi) // row))  # exclusive: ceil((hi - base) / row)
    return first, max(0, last - first)
