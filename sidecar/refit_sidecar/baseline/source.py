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

import contextlib
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog
from pydantic import BaseModel, ConfigDict, Field

from refit_protocol.config_files import AUTO, ConfigPath, SizeOrAuto
from refit_sidecar.baseline.chunks import ExportChunk, owner_of, plan_chunks
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


class BaselineConfig(BaseModel):
    """Where and how the source baseline is kept, and how the export is chunked."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    directory: ConfigPath | None = Field(
        default=None,
        description="Directory for the file-backed baseline (a private subdirectory is created "
        "in it); None uses the system temp directory.",
    )
    in_memory: bool = Field(default=False, description="Keep the baseline in RAM, not in files.")
    export_chunk_bytes: SizeOrAuto = Field(
        default=AUTO,
        description="Export chunk limit in bytes; `auto` sizes it from the checkpoint so each "
        "producer's share makes ~16 chunks, 4-256 MiB (refit_sidecar/baseline/sizing.py; "
        "256 MiB without staging.reference_checkpoint). Must come out the same on every "
        "producer because ownership depends on it.",
    )
    commit_workers: int = Field(
        default=2, ge=1, description="Threads writing new bits into the baseline (and undoing)."
    )
    early_update: bool = Field(
        default=True,
        description="Write each compared chunk's new bits into the baseline while its payloads "
        "travel, so the commit only waits for writes still running; a discard writes the old "
        "bits back from the XOR masks. False: write them all at commit (the paper's order; the "
        "commit then costs a pass over every changed element).",
    )
    reuse_delta_buffers: bool = Field(
        default=True,
        description="Keep a committed or discarded delta's buffers (about 12 bytes per changed "
        "BF16 element, plus 1/8 spare) and compare the next export into them, instead of "
        "fresh memory whose page faults cost about a sixth of the encode time.",
    )


class BaselineError(RuntimeError):
    """Base class of baseline errors; the baseline's committed bits are unchanged."""


class ExportMismatchError(BaselineError):
    """A chunk does not match the export plan (names, shapes, dtypes, chunking or ownership)."""


class PendingStateError(BaselineError):
    """The call does not fit the pending-delta state (other attempt pending, incomplete, ...)."""


class BaselinePoisonedError(BaselineError):
    """A commit failed part way; the baseline must be rebuilt from a fresh first export."""


@dataclass(frozen=True)
class PendingTensor:
    """Exact new bits of one tensor's changed elements (and their XOR with the committed bits,
    which undoes an early update), kept until commit or discard."""

    meta: TensorMeta
    locations: npt.NDArray[np.int64]
    new_bits: npt.NDArray[Any]
    xor_bits: npt.NDArray[Any]


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
        #: The last write, commit or undo submitted for each chunk (the next compare waits for
        #: it), and how many were submitted (`stored_bits` checks its snapshot against it).
        self._commits: dict[int, Future[None]] = {}
        self._epoch: dict[int, int] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._poisoned: BaseException | None = None

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
                epoch = self._epoch.get(index, 0)
                last = self._commits.get(index)
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
                if self._epoch.get(index, 0) == epoch:
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
            self._wait_commit(chunk.index)
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
            if self._poisoned is not None:  # an earlier early write failed
                raise BaselinePoisonedError("a baseline write failed") from self._poisoned
            self._pending[chunk.index] = tuple(pending)
            self._buffers[chunk.index] = used
            if pending and self.config.early_update:
                self._submit(chunk.index, self._write, chunk.index, tuple(pending))
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
            if self._poisoned is not None:
                raise BaselinePoisonedError("a commit failed; re-initialize") from self._poisoned
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
                    # Early: the chunk's writes were submitted at compare time, so this task
                    # (queued after them: the pool runs tasks in order) only waits for them.
                    fut = self._submit(
                        i,
                        self._settle,
                        i,
                        self._commits.get(i) if early else None,
                        () if early else tensors,
                        buffers.pop(i, {}),
                    )
                    futures.append(fut)
            self._spare.update(buffers)  # chunks without changes: nothing reads them
        log.info("baseline.commit", attempt=attempt, chunks=len(futures), early=early)
        return _gather(futures)

    def _pool(self) -> ThreadPoolExecutor:
        """The commit threads (call with the lock held)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                self.config.commit_workers,
                thread_name_prefix="baseline-commit",
                initializer=_yield_to_the_pipeline,
            )
        return self._executor

    def _submit(self, index: int, fn: Callable[..., None], *args: Any) -> Future[None]:
        """Queue a write, commit or undo of chunk `index` (call with the lock held)."""
        fut = self._pool().submit(fn, *args)
        self._commits[index] = fut
        self._epoch[index] = self._epoch.get(index, 0) + 1
        return fut

    def _write(self, index: int, tensors: Sequence[PendingTensor], *, old: bool = False) -> None:
        """Put the new bits of a chunk's changed elements into its store (`old`: put the
        committed bits back, new bits XOR mask)."""
        store = self._stores[index]
        try:
            for p in tensors:
                bits = p.new_bits ^ p.xor_bits if old else p.new_bits
                store.views[p.meta.name][p.locations] = bits
        except BaseException as exc:
            self._poisoned = exc
            raise

    def _settle(
        self,
        index: int,
        written: Future[None] | None,
        tensors: Sequence[PendingTensor],
        buffers: dict[str, DiffBuffers],
        *,
        undo: bool = False,
    ) -> None:
        """Commit (or, `undo`, discard) one chunk: wait for its early writes, write what is
        left (new bits; old bits when undoing), then free its buffers."""
        if written is not None:
            written.result()
        self._write(index, tensors, old=undo)
        with self._lock:  # written: the delta's buffers are free for the next compare
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
                            last = self._commits.get(i)
                            buf = buffers.pop(i, {})
                            self._submit(i, partial(self._settle, undo=True), i, last, tensors, buf)
                self._spare.update(buffers)

    def _wait_commit(self, index: int) -> None:
        fut = self._commits.get(index)
        if fut is not None:
            fut.result()

    def _wait_commits(self) -> None:
        for fut in list(self._commits.values()):
            fut.result()

    def wait_committed(self) -> None:
        """Block until every started commit has been written."""
        self._wait_commits()

    def close(self) -> None:
        """Wait for commits, release storage and delete the baseline files."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        with self._lock:  # nothing is pending any more: a later discard has nothing to undo
            self._attempt = None
            self._pending = {}
            self._commits = {}
        for store in self._stores.values():
            store.close()
        self._stores.clear()
        self._buffers.clear()
        self._spare.clear()
        if self._remove_dir is not None:
            self._remove_dir()
            self._remove_dir = None
            self._dir = None


#: Niceness of the commit threads: early writes run beside the compare and seal threads and
#: should take the cores they leave idle while payloads wait on the link, not delay a payload.
COMMIT_THREAD_NICENESS = 10


def _yield_to_the_pipeline() -> None:
    """Lower this commit thread's CPU priority (Linux: per thread; elsewhere nothing)."""
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + COMMIT_THREAD_NICENESS
        )


def _gather(futures: list[Future[None]]) -> Future[None]:
    """One future that completes when all `futures` have (with the first exception, if any)."""
    done: Future[None] = Future()
    remaining = len(futures)
    errors: list[BaseException] = []
    lock = threading.Lock()
    if remaining == 0:
        done.set_result(None)
        return done

    def on_done(fut: Future[None]) -> None:
        nonlocal remaining
        exc = fut.exception()
        with lock:
            remaining -= 1
            if exc is not None:
                errors.append(exc)
            if remaining:
                return
        if errors:
            done.set_exception(errors[0])
        else:
            done.set_result(None)

    for fut in futures:
        fut.add_done_callback(on_done)
    return done
