"""The baseline's store writer: a chunk's new bits, or its committed bits put back, written on
low-priority threads while the pipeline runs.

Why on its own: with `BaselineConfig.early_update` a compared chunk's new bits go into its store
while its payloads travel, a commit then only waits for them, and a discard writes the committed
bits back (new bits XOR mask). Those writes run beside compares and readers, and three rules keep
that safe; here they can be checked on plain arrays, without a whole `SourceBaseline`:

- one chunk's writes apply in the order they were queued: each waits for the chunk's previous
  write (and fails with its error), whatever the number of threads;
- each queued write moves the chunk's *epoch* on (it never goes back, not even at `close`): a
  reader that copied a store while writes ran checks that the epoch did not move meanwhile;
- a write that fails part way *poisons* the writer (`poisoned`): the store then holds neither the
  committed nor the new bits, so the baseline must be rebuilt from a fresh export.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from refit_sidecar.baseline.storage import ChunkStore
from refit_sidecar.codec.records import TensorMeta

#: Niceness of the writer threads: early writes run beside the compare and seal threads and
#: should take the cores they leave idle while payloads wait on the link, not delay a payload.
COMMIT_THREAD_NICENESS = 10


@dataclass(frozen=True)
class PendingTensor:
    """Exact new bits of one tensor's changed elements (and their XOR with the committed bits,
    which undoes an early update), kept until commit or discard."""

    meta: TensorMeta
    locations: npt.NDArray[np.int64]
    new_bits: npt.NDArray[Any]
    xor_bits: npt.NDArray[Any]


class ChunkWriter:
    """Queues writes of pending tensors into the chunk stores; thread-safe.

    `stores` is read when a write runs (the owner may fill it later); `workers` threads write,
    started with the first write and again after `close`.
    """

    def __init__(self, stores: Mapping[int, ChunkStore], *, workers: int) -> None:
        if workers < 1:
            raise ValueError("need at least one writer thread")
        self._stores = stores
        self._workers = workers
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._last: dict[int, Future[None]] = {}
        self._epoch: dict[int, int] = {}
        self._poisoned: BaseException | None = None

    @property
    def poisoned(self) -> BaseException | None:
        """The error of a write that failed (None while every write succeeded)."""
        return self._poisoned

    def epoch(self, index: int) -> int:
        """How many writes were queued for chunk `index` so far."""
        with self._lock:
            return self._epoch.get(index, 0)

    def last(self, index: int) -> Future[None] | None:
        """The last write queued for chunk `index` (None: none since `close`)."""
        with self._lock:
            return self._last.get(index)

    def submit(
        self,
        index: int,
        tensors: Sequence[PendingTensor],
        *,
        undo: bool = False,
        then: Callable[[], None] | None = None,
    ) -> Future[None]:
        """Queue writing `tensors` into chunk `index`'s store once its earlier writes are done:
        their new bits, or with `undo` the committed ones (new bits XOR mask). `then` runs on
        the writer thread after a successful write."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self._workers,
                    thread_name_prefix="baseline-commit",
                    initializer=_yield_to_the_pipeline,
                )
            previous = self._last.get(index)
            fut = self._executor.submit(self._run, index, previous, tensors, undo, then)
            self._last[index] = fut
            self._epoch[index] = self._epoch.get(index, 0) + 1
        return fut

    def _run(
        self,
        index: int,
        previous: Future[None] | None,
        tensors: Sequence[PendingTensor],
        undo: bool,
        then: Callable[[], None] | None,
    ) -> None:
        if previous is not None:
            previous.result()  # the pool starts tasks in order: it runs or ran already
        store = self._stores[index]
        try:
            for p in tensors:
                store.views[p.meta.name][p.locations] = (
                    p.new_bits ^ p.xor_bits if undo else p.new_bits
                )
        except BaseException as exc:
            self._poisoned = exc
            raise
        if then is not None:
            then()

    def wait(self, index: int) -> None:
        """Block until chunk `index`'s queued writes are done (raises a write's error)."""
        fut = self.last(index)
        if fut is not None:
            fut.result()

    def wait_all(self) -> None:
        """Block until every queued write is done (raises the first error met)."""
        with self._lock:
            futures = list(self._last.values())
        for fut in futures:
            fut.result()

    def close(self) -> None:
        """Wait for the queued writes and stop the threads (the epochs are kept)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        with self._lock:
            self._last = {}


def all_done(futures: Sequence[Future[None]]) -> Future[None]:
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


def _yield_to_the_pipeline() -> None:
    """Lower this writer thread's CPU priority (Linux: per thread; elsewhere nothing)."""
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + COMMIT_THREAD_NICENESS
        )
