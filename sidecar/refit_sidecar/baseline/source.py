"""The source baseline: the committed canonical bits a producer compares each new export against.

One producer keeps only the chunks it owns, so all producers together hold one copy (H bytes).
The first export becomes the first baseline (no dense sync at start). For each attempt, compare
records a pending delta (locations, exact new bits and XOR masks, whatever the wire op). An
overwrite retry is rebuilt from the pending delta, without a new export.

The committed bits change only through the coordinator's joint commit. By default (`early_update`)
each compared chunk's new bits are written into its store at once, on the commit threads, while
its payloads travel: at a few percent of changed elements that scatter touches every cache line
of the baseline (~80 ms per 600 MiB here), and written at commit it sat on the refit's critical
path (the paper's t1 includes it). Until the commit those stores hold the candidate; `discard`
writes the old bits back (new bits XOR mask), `stored_bits` answers with the committed bits, and
the next compare of a chunk waits for its writes. The baseline's files are private to the
process and deleted with it, so a crash cannot leave candidate bits behind as a baseline.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from refit_protocol.sizes import AUTO
from refit_sidecar.baseline.chunk_writer import ChunkWriter, PendingTensor, all_done
from refit_sidecar.baseline.chunks import ExportChunk, owner_of, plan_chunks
from refit_sidecar.baseline.config import BaselineConfig
from refit_sidecar.baseline.errors import (
    BaselineError,
    BaselinePoisonedError,
    ExportMismatchError,
    PendingStateError,
)
from refit_sidecar.baseline.sizing import resolve_sizes
from refit_sidecar.baseline.storage import ChunkStore
from refit_sidecar.bitdiff import (
    NO_BUFFERS,
    BitDiff,
    DiffBuffers,
    diff_bits,
    gather_slices,
    submit_slices,
)
from refit_sidecar.bits import bits_numpy
from refit_sidecar.codec import dtypes
from refit_sidecar.codec.records import (
    Item,
    Mode,
    Op,
    TensorMeta,
    choose_op,
    item_from_diff,
    item_from_positions,
)

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class ChunkDelta:
    """Result of comparing one chunk: its records and the counts the metrics need."""

    index: int
    nbytes: int
    total_elements: int
    changed_elements: int
    items: tuple[Item, ...]


class SourceBaseline:
    """One producer's share of the source baseline and its pending delta."""

    def __init__(
        self,
        *,
        producer: int,
        producers: int,
        config: BaselineConfig | None = None,
        total_bytes: int | None = None,
    ) -> None:
        """`total_bytes`: the checkpoint's size H, which an `auto` chunk limit is derived from
        (None: unknown, see `sizing.resolve_sizes`)."""
        if not 0 <= producer < producers:
            raise ValueError(f"producer {producer} not in [0, {producers})")
        self.producer = producer
        self.producers = producers
        self.config = config or BaselineConfig()
        #: The export chunk limit in effect (`config.export_chunk_bytes` resolved).
        self.chunk_bytes = resolve_sizes(
            self.config.export_chunk_bytes, AUTO, total_bytes=total_bytes, producers=producers
        ).chunk_bytes
        self._plan: list[tuple[TensorMeta, ...]] | None = None
        self._stores: dict[int, ChunkStore] = {}
        self._dir: Path | None = None
        self._remove_dir: weakref.finalize[Any, Any] | None = None
        self._lock = threading.Lock()
        self._attempt: str | None = None
        self._pending: dict[int, tuple[PendingTensor, ...]] = {}
        # Output buffers of the pending delta's compares, and those free for the next compare
        # (by chunk, then tensor name): see BaselineConfig.reuse_delta_buffers.
        self._buffers: dict[int, dict[str, DiffBuffers]] = {}
        self._spare: dict[int, dict[str, DiffBuffers]] = {}
        self._in_progress: set[int] = set()
        #: Early writes, commits and undos of the stores, queued under `_lock` (the next compare
        #: of a chunk waits for its last one; `stored_bits` checks its snapshot by the epoch).
        self._writer = ChunkWriter(self._stores, workers=self.config.commit_workers)

    # ------------------------------------------------------------------------------ first export
    def load_initial(self, chunks: Iterable[ExportChunk]) -> dict[str, TensorMeta]:
        """Build the baseline from the first export and return every tensor's metadata."""
        if self._plan is not None:
            raise BaselineError("the baseline is already initialized")
        seen: list[tuple[TensorMeta, ...]] = []
        try:
            for chunk in chunks:
                if chunk.index != len(seen):
                    raise ExportMismatchError(f"chunk {chunk.index} arrived as #{len(seen)}")
                metas = chunk.metas()
                for meta in metas:
                    dtypes.dtype_code(meta.dtype)
                seen.append(metas)
                if self.owns(chunk.index):
                    store = ChunkStore(metas, self._chunk_path(chunk.index))
                    self._stores[chunk.index] = store
                    for name, t in chunk.tensors:
                        np.copyto(store.views[name], bits_numpy(t.cpu()))
            flat = [m for metas in seen for m in metas]
            if plan_chunks(flat, self.chunk_bytes) != seen:
                raise ExportMismatchError(
                    f"export chunks do not follow the {self.chunk_bytes}-byte limit"
                )
            names = [m.name for m in flat]
            if len(set(names)) != len(names):
                raise ExportMismatchError("the export repeats a tensor name")
        except BaseException:
            self.close()
            raise
        self._plan = seen
        log.info(
            "baseline.initialized",
            producer=self.producer,
            chunks=len(seen),
            owned=len(self._stores),
            nbytes=self.nbytes,
        )
        return self.metadata

    def _chunk_path(self, index: int) -> Path | None:
        if self.config.in_memory:
            return None
        if self._dir is None:
            root = self.config.directory
            if root is not None:
                root.mkdir(parents=True, exist_ok=True)
            prefix = f"kuberefit-baseline-p{self.producer}-"
            self._dir = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
            # The directory is ours alone: a baseline that is never closed (its owner failed
            # before `close`, a script) still deletes it when collected or when Python exits,
            # instead of leaving a checkpoint's worth of files behind.
            self._remove_dir = weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)
        return self._dir / f"chunk-{index:06d}.bin"

    # ------------------------------------------------------------------------------- inspection
    @property
    def metadata(self) -> dict[str, TensorMeta]:
        """Canonical metadata of every exported tensor (owned or not), in export order."""
        return {m.name: m for metas in self._require_plan() for m in metas}

    @property
    def chunk_count(self) -> int:
        return len(self._require_plan())

    @property
    def owned_chunks(self) -> list[int]:
        return [i for i in range(self.chunk_count) if self.owns(i)]

    @property
    def nbytes(self) -> int:
        """Logical bytes of stored baseline bits on this producer."""
        return sum(s.nbytes for s in self._stores.values())

    @property
    def pending_attempt(self) -> str | None:
        return self._attempt

    def owns(self, chunk_index: int) -> bool:
        return owner_of(chunk_index, self.producers) == self.producer

    def stored_bits(self, name: str) -> npt.NDArray[Any]:
        """A tensor's committed stored bits, read-only (integer view).

        While no attempt is pending (or without early update) this is the store itself, no
        copy: it stays the committed bits until an attempt compares the chunk, so copy it to
        keep it longer. While an attempt is pending with early update, it is a snapshot with the
        old bits put back where the attempt wrote new ones.
        """
        index = next((i for i, st in self._stores.items() if name in st.views), None)
        if index is None:
            raise KeyError(f"{name} is not in this producer's baseline")
        view = self._stores[index].views[name]
        while True:
            with self._lock:
                epoch = self._writer.epoch(index)
                last = self._writer.last(index)
                live = not self.config.early_update or (
                    self._attempt is None and index not in self._in_progress
                )
                written = [p for p in self._pending.get(index, ()) if p.meta.name == name]
            if last is not None:
                last.result()  # the chunk's writes so far are in the store
            out: npt.NDArray[Any]
            if live:  # the store holds the committed bits
                out = view.view()
                out.flags.writeable = False
                return out
            out = view.copy()
            with self._lock:  # nothing was written or undone meanwhile: the snapshot holds
                if self._writer.epoch(index) == epoch:
                    break
        for p in written:
            out[p.locations] = p.new_bits ^ p.xor_bits
        out.flags.writeable = False
        return out

    def _require_plan(self) -> list[tuple[TensorMeta, ...]]:
        if self._plan is None:
            raise BaselineError("the baseline has not been initialized (load_initial)")
        return self._plan

    # ---------------------------------------------------------------------------------- compare
    def compare_chunk(
        self,
        attempt: str,
        chunk: ExportChunk,
        *,
        mode: Mode = Mode.MIXED,
        xor_incompatible: frozenset[str] = frozenset(),
        pool: Executor | None = None,
    ) -> ChunkDelta:
        """Compare an owned chunk against the baseline; keep its pending delta for `attempt`.

        Thread-safe for different chunks. Waits for an in-flight commit of this chunk first.
        With `pool`, the tensors are compared in word-aligned slices on that executor (which
        must not be the one running this call).
        """
        plan = self._require_plan()
        if not 0 <= chunk.index < len(plan) or not self.owns(chunk.index):
            raise ExportMismatchError(f"chunk {chunk.index} is not owned by {self.producer}")
        metas = chunk.metas()
        if metas != plan[chunk.index]:
            raise ExportMismatchError(f"chunk {chunk.index} differs from the first export")
        self._reserve(attempt, chunk.index)
        try:
            self._writer.wait(chunk.index)
            with self._lock:  # after the commit: it frees the buffers of the last delta
                spare = self._spare.pop(chunk.index, {})
            store = self._stores[chunk.index]
            items: list[Item] = []
            pending: list[PendingTensor] = []
            used: dict[str, DiffBuffers] = {}
            total = 0
            recycle = self.config.reuse_delta_buffers
            reuse = [spare.get(m.name, NO_BUFFERS) if recycle else None for m in metas]
            started = [
                self._start_diff(store.views[meta.name], bits_numpy(t.cpu()), pool, buffers)
                for meta, (_, t), buffers in zip(metas, chunk.tensors, reuse, strict=True)
            ]
            for meta, parts, buffers in zip(metas, started, reuse, strict=True):
                total += meta.numel
                diff = gather_slices(parts, reuse=buffers)
                if diff.buffers is not None:
                    used[meta.name] = diff.buffers
                item = item_from_diff(meta, diff, choose_op(meta.name, mode, xor_incompatible))
                if item is not None:
                    items.append(item)
                    pending.append(
                        PendingTensor(meta, diff.locations, diff.new_bits, diff.xor_bits)
                    )
        except BaseException:
            with self._lock:
                self._in_progress.discard(chunk.index)
            raise
        with self._lock:
            self._in_progress.discard(chunk.index)
            if self._attempt != attempt:
                raise PendingStateError(f"attempt {attempt} was discarded during compare")
            if self._writer.poisoned is not None:  # an earlier early write failed
                raise BaselinePoisonedError("a baseline write failed") from self._writer.poisoned
            self._pending[chunk.index] = tuple(pending)
            self._buffers[chunk.index] = used
            if pending and self.config.early_update:
                self._writer.submit(chunk.index, tuple(pending))
        changed = sum(p.locations.size for p in pending)
        return ChunkDelta(chunk.index, chunk.nbytes, total, changed, tuple(items))

    @staticmethod
    def _start_diff(
        old: npt.NDArray[Any],
        new: npt.NDArray[Any],
        pool: Executor | None,
        reuse: DiffBuffers | None,
    ) -> list[tuple[int, Future[BitDiff]]]:
        if pool is None:
            done: Future[BitDiff] = Future()
            done.set_result(diff_bits(old, new, reuse=reuse))
            return [(0, done)]
        return submit_slices(old, new, pool, reuse=reuse)

    def _reserve(self, attempt: str, index: int) -> None:
        with self._lock:
            if (poisoned := self._writer.poisoned) is not None:
                raise BaselinePoisonedError("a commit failed; re-initialize") from poisoned
            if self._attempt is None:
                self._attempt = attempt
            elif self._attempt != attempt:
                raise PendingStateError(
                    f"attempt {self._attempt} still has a pending delta; commit or discard it"
                )
            if index in self._pending or index in self._in_progress:
                raise PendingStateError(f"chunk {index} was already compared for {attempt}")
            self._in_progress.add(index)

    def rebuild_overwrite(self, from_attempt: str, attempt: str) -> Iterator[ChunkDelta]:
        """Overwrite records for a retry, from `from_attempt`'s complete pending delta.

        The pending delta moves to `attempt` at once; chunks are yielded in export order.
        """
        with self._lock:
            self._check_complete(from_attempt)
            self._attempt = attempt
            pending = dict(self._pending)
        return self._overwrite_deltas(pending)

    def _overwrite_deltas(
        self, pending: dict[int, tuple[PendingTensor, ...]]
    ) -> Iterator[ChunkDelta]:
        plan = self._require_plan()
        for index in sorted(pending):
            items = [
                item
                for p in pending[index]
                if (item := item_from_positions(p.meta, Op.OVERWRITE, p.locations, p.new_bits))
            ]
            yield ChunkDelta(
                index=index,
                nbytes=sum(m.nbytes for m in plan[index]),
                total_elements=sum(m.numel for m in plan[index]),
                changed_elements=sum(p.locations.size for p in pending[index]),
                items=tuple(items),
            )

    def pending_complete(self, attempt: str) -> bool:
        """True when `attempt`'s pending delta covers every owned chunk (a retry can be rebuilt
        from it without an export)."""
        with self._lock:
            try:
                self._check_complete(attempt)
            except PendingStateError:
                return False
            return True

    def _check_complete(self, attempt: str) -> None:
        if self._attempt != attempt:
            raise PendingStateError(f"no pending delta for attempt {attempt}")
        missing = set(self.owned_chunks) - set(self._pending)
        if missing or self._in_progress:
            raise PendingStateError(
                f"attempt {attempt} compared only part of the export "
                f"({len(missing)} owned chunks missing); re-export in overwrite mode"
            )

    # ---------------------------------------------------------------------- commit and discard
    def commit(self, attempt: str) -> Future[None]:
        """Write the pending new bits in place, in parallel; the next compare waits for it."""
        with self._lock:
            self._check_complete(attempt)
            pending, self._pending, self._attempt = self._pending, {}, None
            buffers, self._buffers = self._buffers, {}
            early = self.config.early_update
            futures: list[Future[None]] = []
            for i, tensors in pending.items():
                if tensors:
                    # Early: the chunk's writes were submitted at compare time, so this one only
                    # waits for them (the writer runs a chunk's writes in order).
                    free = partial(self._free, i, buffers.pop(i, {}))
                    futures.append(self._writer.submit(i, () if early else tensors, then=free))
            self._spare.update(buffers)  # chunks without changes: nothing reads them
        log.info("baseline.commit", attempt=attempt, chunks=len(futures), early=early)
        return all_done(futures)

    def _free(self, index: int, buffers: dict[str, DiffBuffers]) -> None:
        """A commit or undo of chunk `index` was written: its delta's buffers are free for the
        next compare."""
        with self._lock:
            self._spare[index] = buffers

    def discard(self, attempt: str) -> None:
        """Forget `attempt`'s pending delta; the committed bits stay as they are.

        Call it only once nothing reads the attempt's items any more (its pipeline returned):
        the next compare writes into the same buffers.
        """
        with self._lock:
            if self._attempt == attempt:
                self._attempt = None
                pending, self._pending = self._pending, {}
                buffers, self._buffers = self._buffers, {}
                if self.config.early_update:
                    for i, tensors in pending.items():
                        if tensors:  # the next compare of chunk i waits for this
                            free = partial(self._free, i, buffers.pop(i, {}))
                            self._writer.submit(i, tensors, undo=True, then=free)
                self._spare.update(buffers)

    def wait_committed(self) -> None:
        """Block until every started commit has been written."""
        self._writer.wait_all()

    def close(self) -> None:
        """Wait for commits, release storage and delete the baseline files."""
        self._writer.close()
        with self._lock:  # nothing is pending any more: a later discard has nothing to undo
            self._attempt = None
            self._pending = {}
        for store in self._stores.values():
            store.close()
        self._stores.clear()
        self._buffers.clear()
        self._spare.clear()
        if self._remove_dir is not None:
            self._remove_dir()
            self._remove_dir = None
            self._dir = None
