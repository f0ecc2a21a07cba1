"""The apply context: reusable scratch, one native `load_weights` call per item, fail closed.

For each decoded item the scratch region for the canonical tensor is reset to the placeholder
(zero for XOR, NaN or an exact-bit sentinel for overwrite), the item's values are scattered into
it, and the model's own loader is called with `[(name, scratch_view)]` under the storage-write
hook. The loader decides every placement; this file knows no model family or layout.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from refit_sidecar.apply.errors import (
    LoaderMismatchError,
    ScratchAllocationError,
    StorageReplacedError,
)
from refit_sidecar.apply.hook import ItemTrace, Mode, StorageWriteHook
from refit_sidecar.apply.placeholders import (
    COVERS_ALL,
    Placeholder,
    choose,
    covers_whole_tensor,
    fill,
)
from refit_sidecar.apply.storage import ModelStorages, storage_key
from refit_sidecar.bits import int_view
from refit_sidecar.codec import dtypes
from refit_sidecar.codec.records import Item, Op, TensorMeta


class NativeModel(Protocol):
    """What the apply path needs from a serving runtime's model (vLLM's nn.Module fits)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str] | None: ...

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterable[tuple[str, torch.nn.Parameter]]: ...

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterable[tuple[str, torch.Tensor]]: ...


@dataclass
class ApplyStats:
    items: int = 0
    skipped: int = 0
    values: int = 0
    canonical_bytes: int = 0
    copies: int = 0
    checks: int = 0
    reset_s: float = 0.0
    scatter_s: float = 0.0
    load_s: float = 0.0

    def add(self, other: ApplyStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class ApplyContext:
    """Applies decoded items to `model` in place. Reuse one context for a model's lifetime."""

    model: NativeModel
    metas: dict[str, TensorMeta]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    skip_names: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self.metas = dict(self.metas)  # owned copy: prewarm/apply never mutate the caller's
        self._storages = self._snapshot_storages()
        # One byte buffer, reused by every item. It is reserved for the largest canonical tensor
        # the loader takes (by `prewarm`, which learns that), not for the largest one declared:
        # a declared tensor this model does not have must cost nothing. Without prewarm, the
        # first item of each larger size grows it.
        self.scratch = torch.empty(1, dtype=torch.uint8, device=self.device)
        # Scratch bytes [0, _zero_bytes) are known to be zero: XOR items then need no full reset,
        # only the positions the previous XOR item scattered are cleared again.
        self._zero_bytes = 0
        self.hook = StorageWriteHook(self._storages, self.scratch)

    def reserve(self, nbytes: int, *, name: str = "", shrink: bool = False) -> None:
        """Make scratch hold at least `nbytes` (exactly `nbytes` with `shrink`).

        `name` is the tensor that needs it, for the error. Raises `ScratchAllocationError`
        (scratch unchanged) when the device cannot hold it."""
        nbytes = max(nbytes, 1)
        have = self.scratch.numel()
        if have == nbytes or (have > nbytes and not shrink):
            return
        try:
            scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            raise ScratchAllocationError(
                name or "scratch",
                f"cannot allocate {nbytes} bytes of scratch on {self.device}: "
                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
            ) from exc
        budget = self.hook.check_budget  # an apply call in progress keeps its checks
        self.scratch = scratch
        self._zero_bytes = 0
        self.hook = StorageWriteHook(self._storages, scratch)
        self.hook.check_budget = budget

    def largest_storage_bytes(self) -> int:
        """Bytes of the model's largest parameter/buffer storage on this rank."""
        return max(
            (
                t.untyped_storage().nbytes()
                for t in self._tensors.values()
                if t.numel() and t.device.type != "meta"
            ),
            default=0,
        )

    def _named_tensors(self) -> dict[str, torch.Tensor]:
        named: dict[str, torch.Tensor] = dict(self.model.named_parameters(remove_duplicate=False))
        named.update(self.model.named_buffers(remove_duplicate=False))
        return named

    def _snapshot_storages(self) -> ModelStorages:
        self._tensors = self._named_tensors()
        return ModelStorages.of(self._tensors.items())

    def scratch_view(self, meta: TensorMeta) -> torch.Tensor:
        """`meta`'s view of scratch (grown for it if needed: call outside the hook)."""
        n = meta.nbytes
        self.reserve(n, name=meta.name)
        return self.scratch[:n].view(meta.dtype).view(meta.shape)

    # -- public API -------------------------------------------------------------------------------
    def apply(self, items: Sequence[Item], *, check_samples: int = 0) -> ApplyStats:
        """Apply items in order. `check_samples`: 0 off, N sampled elements, -1 every element."""
        stats = ApplyStats()
        self.hook.check_budget = check_samples  # shared by every copy of this call
        for item in items:
            stats.add(self._apply_item(item))
        return stats

    def _apply_item(self, item: Item) -> ApplyStats:
        stats = ApplyStats(items=1, values=item.count)
        meta = self.known(item.meta)
        stats.canonical_bytes = meta.nbytes
        if meta.name in self.skip_names:
            stats.skipped = 1  # prewarm recorded an explicit native skip on this rank
            return stats
        if item.op is Op.XOR:
            self._run(item, meta, Mode.XOR, Placeholder(0), stats)
            return stats
        if covers_whole_tensor(item.range_start, item.count, meta.numel):
            self._run(item, meta, Mode.OVERWRITE, COVERS_ALL, stats)  # a dense write
            return stats
        placeholder = choose(meta.dtype, item.values)
        if placeholder is None:
            # Every 1- or 2-byte pattern is an active value. Two loader passes with known
            # sentinels: the whole item with sentinel P (its values equal to P are not written),
            # then just the values equal to P, with sentinel 0.
            pattern = 0xFF if item.values.dtype == torch.uint8 else -1
            self._run(item, meta, Mode.OVERWRITE, Placeholder(pattern), stats)
            equal = _select(item, item.values == pattern)
            self._run(equal, meta, Mode.OVERWRITE, Placeholder(0), stats)
            return stats
        self._run(item, meta, Mode.OVERWRITE, placeholder, stats)
        return stats

    def _run(
        self,
        item: Item,
        meta: TensorMeta,
        mode: Mode,
        placeholder: Placeholder,
        stats: ApplyStats,
    ) -> None:
        view = self.scratch_view(meta)
        t0 = time.perf_counter()
        if mode is Mode.XOR:
            if self._zero_bytes < meta.nbytes:
                self.scratch[self._zero_bytes : meta.nbytes].zero_()
                self._zero_bytes = meta.nbytes
        else:
            fill(view, placeholder)
            self._zero_bytes = 0
        t1 = time.perf_counter()
        flat = int_view(view)
        index = item.index()
        flat[index] = item.values.to(self.device)
        t2 = time.perf_counter()
        reach = _reach(index, dtypes.width(meta.dtype)) if mode is Mode.XOR else None
        self.hook.begin_item(meta.name, mode, placeholder, reach)
        try:
            with self.hook:
                loaded = self.model.load_weights([(meta.name, view)])
        except BaseException:
            self._zero_bytes = 0
            raise
        finally:
            trace = self.hook.end_item()
        t3 = time.perf_counter()
        if mode is Mode.XOR:
            if trace.scratch_written:
                self._zero_bytes = 0
            else:
                flat[index] = 0  # back to all-zero scratch, touching only what was set
        stats.reset_s += (t1 - t0) + (time.perf_counter() - t3)
        stats.scatter_s += t2 - t1
        stats.load_s += t3 - t2
        stats.copies += len(trace.copies)
        stats.checks += trace.checked
        self._assert_storages_unchanged(loaded or ())
        self.match_loaded(meta.name, set(loaded or ()), trace)
        if not loaded and not trace.copies:
            stats.skipped += 1

    def match_loaded(self, name: str, loaded: set[str], trace: ItemTrace) -> None:
        """Loaded names and intercepted copies must describe the same storages."""
        loaded_keys = {self._storages.key_by_name.get(n) for n in loaded}
        if None in loaded_keys:
            unknown = sorted(n for n in loaded if n not in self._storages.key_by_name)
            raise LoaderMismatchError(name, f"loader reports unknown parameters {unknown}")
        written_keys = {self._storages.key_by_name[n] for n in trace.written_storages}
        if loaded_keys - written_keys:
            missing = sorted(n for n in loaded if self._storages.key_by_name[n] not in written_keys)
            raise LoaderMismatchError(
                name, f"loader reports {missing} loaded but no copy into them was intercepted"
            )
        if written_keys - loaded_keys:
            raise LoaderMismatchError(
                name,
                f"copies into {sorted(trace.written_storages)} not reported as loaded "
                f"(reported {sorted(loaded)})",
            )

    def known(self, meta: TensorMeta) -> TensorMeta:
        known = self.metas.get(meta.name)
        if known is None:
            raise LoaderMismatchError(meta.name, "not a canonical tensor of this model")
        if known != meta:
            raise LoaderMismatchError(
                meta.name,
                f"item is {meta.dtype}{meta.shape}, canonical is {known.dtype}{known.shape}",
            )
        return known

    def _assert_storages_unchanged(self, names: Iterable[str]) -> None:
        """XOR needs the resident bits: a loader must write into storage, never swap it."""
        for name in names:
            t = self._tensors.get(name)
            if t is not None and t.numel() and storage_key(t) != self._storages.key_by_name[name]:
                raise StorageReplacedError(name, "parameter storage was replaced by the loader")


def _reach(index: slice | torch.Tensor, itemsize: int) -> tuple[int, int]:
    """The scratch bytes [lo, hi) an item's values were scattered into (scratch view at 0)."""
    if isinstance(index, slice):
        lo, hi = int(index.start), int(index.stop)
    elif index.numel() == 0:
        lo = hi = 0
    else:
        least, most = torch.aminmax(index)
        lo, hi = int(least), int(most) + 1
    return lo * itemsize, hi * itemsize


def _select(item: Item, keep: torch.Tensor) -> Item:
    """The part of `item` at the positions where `keep` (one flag per value) is set."""
    idx = item.index()
    locs = torch.arange(idx.start, idx.stop, dtype=torch.int64) if isinstance(idx, slice) else idx
    return Item(
        meta=item.meta,
        op=item.op,
        range_start=None,
        locations=locs[keep.to(locs.device)],
        values=item.values[keep],
    )
