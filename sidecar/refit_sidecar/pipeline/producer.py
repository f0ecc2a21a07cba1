"""The streaming producer pipeline: intake -> compare -> coalesce -> seal (zstd) -> send.

A changed tensor larger than the split size is cut into parts after its compare
(`parts.split_delta`), so it travels as several payloads.

Every stage is a thread joined to the next by a bounded queue, so payload N is on the wire while
later chunks are compared, and a slow transport stalls the export instead of piling up memory.
With `compare_workers` > 1, chunks are compared and payloads sealed on that many threads; the
payloads still leave in order.
The heavy work (integer-view compare, gathers, byte shuffles, zstd, BLAKE2b) runs in numpy,
zstd and hashlib kernels that release the GIL. The first error in any stage, the export or the
transport cancels the rest and is raised to the caller as `PipelineError` with its cause.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, TypeVar

import structlog

from refit_sidecar.baseline.chunks import ExportChunk
from refit_sidecar.baseline.sizing import auto_split_bytes
from refit_sidecar.baseline.source import ChunkDelta, SourceBaseline
from refit_sidecar.codec.encode import PreparedItem, encode_payload, prepare_item
from refit_sidecar.codec.records import Mode
from refit_sidecar.codec.wire import CODEC_VERSION, CodecConfig, EncodedPayload, PayloadHeader
from refit_sidecar.pipeline.bucket import Bucket, Bucketer
from refit_sidecar.pipeline.config import PipelineConfig
from refit_sidecar.pipeline.metrics import PipelineMetrics
from refit_sidecar.pipeline.parts import split_delta
from refit_sidecar.transport.base import Transport

log = structlog.get_logger(__name__)
T = TypeVar("T")
#: What the bucketer coalesces: a chunk's delta, or one part of it, with its items prepared.
_Unit = tuple[ChunkDelta, list[PreparedItem]]
_END = object()
_POLL_S = 0.05


class PipelineError(RuntimeError):
    """A stage failed; `stage` names it, `__cause__` is the original error."""

    def __init__(self, stage: str, cause: BaseException, metrics: PipelineMetrics) -> None:
        super().__init__(f"producer pipeline failed in {stage}: {cause!r}")
        self.stage = stage
        self.metrics = metrics


class _CancelledError(Exception):
    """Internal: another stage failed, stop quietly."""


class _Run:
    """Shared state of one run: cancellation, the first error, queue helpers."""

    def __init__(self, metrics: PipelineMetrics) -> None:
        self.cancel = threading.Event()
        self.metrics = metrics
        self.error: tuple[str, BaseException] | None = None
        self._lock = threading.Lock()

    def fail(self, stage: str, exc: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = (stage, exc)
        self.cancel.set()

    def put(self, q: queue.Queue[Any], item: object) -> None:
        while True:
            if self.cancel.is_set():
                raise _CancelledError
            try:
                q.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def get(self, q: queue.Queue[Any]) -> Any:
        while True:
            if self.cancel.is_set():
                raise _CancelledError
            try:
                return q.get(timeout=_POLL_S)
            except queue.Empty:
                continue

    def result(self, fut: Future[T]) -> T:
        while True:
            if self.cancel.is_set():
                fut.cancel()
                raise _CancelledError
            done, _ = wait_futures([fut], timeout=_POLL_S)
            if done:
                return fut.result()

    def outcome(self, fut: Future[T], stage: str) -> T:
        """`result`, with a failure of the work recorded as `stage`'s (then cancelling the run)."""
        try:
            return self.result(fut)
        except _CancelledError:
            raise
        except BaseException as exc:
            self.fail(stage, exc)
            raise _CancelledError from exc


class ProducerPipeline:
    """Streams one producer's deltas of an attempt to a transport. With `mac_key`
    (`refit_protocol.keys.payload_mac_key` of the policy's token) every payload carries the MAC
    that receivers holding the token require."""

    def __init__(
        self,
        baseline: SourceBaseline,
        transport: Transport,
        config: PipelineConfig | None = None,
        *,
        mac_key: bytes | None = None,
    ) -> None:
        self.baseline = baseline
        self.transport = transport
        self.config = config or PipelineConfig()
        self.mac_key = mac_key
        bucket = self.config.bucket_bytes
        #: The bucket target in effect (`auto`: the baseline's export chunk limit).
        self.bucket_bytes = bucket if isinstance(bucket, int) else baseline.chunk_bytes
        split = self.config.split_bytes
        #: The split size in effect (`sizing.auto_split_bytes` for `auto`).
        self.split_bytes = (
            split
            if isinstance(split, int)
            else auto_split_bytes(baseline.chunk_bytes, self.bucket_bytes)
        )

    def run(
        self,
        attempt: str,
        chunks: Iterable[ExportChunk],
        *,
        mode: Mode = Mode.MIXED,
        xor_incompatible: frozenset[str] = frozenset(),
    ) -> PipelineMetrics:
        """Compare the export against the baseline and send the deltas of the owned chunks.

        `chunks` is the whole export; chunks owned by other producers are skipped. The pending
        delta stays in the baseline for `commit`, `discard` or an overwrite retry.
        """
        owned = (c for c in chunks if self.baseline.owns(c.index))

        def compare(chunk: ExportChunk, pool: Executor | None) -> ChunkDelta:
            return self.baseline.compare_chunk(
                attempt, chunk, mode=mode, xor_incompatible=xor_incompatible, pool=pool
            )

        return self._run(attempt, mode, owned, compare)

    def run_retry(self, from_attempt: str, attempt: str) -> PipelineMetrics:
        """Send an all-overwrite retry rebuilt from `from_attempt`'s pending delta (no export)."""
        deltas = self.baseline.rebuild_overwrite(from_attempt, attempt)
        return self._run(attempt, Mode.OVERWRITE, deltas, lambda d, _pool: d)

    # ------------------------------------------------------------------------------ machinery
    def _run(
        self,
        attempt: str,
        mode: Mode,
        source: Iterable[T],
        work: Callable[[T, Executor | None], ChunkDelta],
    ) -> PipelineMetrics:
        cfg = self.config
        codec = cfg.codec
        if codec.zstd_threads is None:
            workers = cfg.compare_workers
            codec = codec.model_copy(update={"zstd_threads": workers if workers > 1 else 0})
        metrics = PipelineMetrics(attempt=attempt, mode=str(mode))
        run = _Run(metrics)
        chunk_q: queue.Queue[Any] = queue.Queue(maxsize=cfg.max_chunks_in_flight)
        bucket_q: queue.Queue[Any] = queue.Queue(maxsize=cfg.payload_queue)
        payload_q: queue.Queue[Any] = queue.Queue(maxsize=cfg.payload_queue)
        # With several compare threads, chunk tasks fan their tensors out as slices to the slice
        # pool, whose threads do the compare work; a chunk task only waits, so the two pools
        # cannot deadlock. One compare thread compares in place (slicing would not help).
        executor = ThreadPoolExecutor(cfg.compare_workers, thread_name_prefix="refit-chunk")
        slices = ThreadPoolExecutor(cfg.compare_workers, thread_name_prefix="refit-compare")
        slice_pool = slices if cfg.compare_workers > 1 else None
        # Several threads also seal payloads side by side (sent in order): otherwise the last
        # buckets' byte shuffles and digests run on one thread after the compares are done.
        sealer = ThreadPoolExecutor(cfg.compare_workers, thread_name_prefix="refit-seal")
        seal_pool = sealer if cfg.compare_workers > 1 else None
        held = _Gauge(metrics)

        def timed_work(item: T) -> tuple[ChunkDelta, list[_Unit]]:
            t0 = time.perf_counter()
            delta = work(item, slice_pool)
            units = [  # location encoding, in parallel
                (unit, [prepare_item(i) for i in unit.items])
                for unit in split_delta(delta, self.split_bytes)
            ]
            metrics.add_time("compare", time.perf_counter() - t0)
            return delta, units

        stages = {
            "intake": lambda: self._intake(run, source, executor, timed_work, chunk_q, held),
            "coalesce": lambda: self._coalesce(run, chunk_q, bucket_q, held),
            "compress": lambda: self._compress(run, attempt, codec, bucket_q, payload_q, seal_pool),
            "send": lambda: self._send(run, attempt, payload_q),
        }
        threads = {
            name: threading.Thread(target=_stage(run, name, fn), name=f"refit-{name}", daemon=True)
            for name, fn in stages.items()
        }
        log.info("pipeline.start", attempt=attempt, mode=str(mode), producer=self.baseline.producer)
        t0 = time.perf_counter()
        for th in threads.values():
            th.start()
        stuck = self._join(run, threads)
        executor.shutdown(wait=True, cancel_futures=True)  # compares are finite
        slices.shutdown(wait=True, cancel_futures=True)
        sealer.shutdown(wait=True, cancel_futures=True)
        metrics.wall_s = time.perf_counter() - t0
        if run.error is not None:
            stage, exc = run.error
            log.warning(
                "pipeline.failed", attempt=attempt, stage=stage, error=repr(exc), stuck=stuck
            )
            raise PipelineError(stage, exc, metrics) from exc
        log.info("pipeline.done", **metrics.as_dict())
        return metrics

    def _join(self, run: _Run, threads: dict[str, threading.Thread]) -> list[str]:
        """Wait for all stages; after a failure give blocked ones `cancel_grace_s`."""
        deadline: float | None = None
        for th in threads.values():
            while th.is_alive():
                if run.cancel.is_set() and deadline is None:
                    deadline = time.monotonic() + self.config.cancel_grace_s
                timeout = _POLL_S if deadline is None else max(deadline - time.monotonic(), 0)
                th.join(timeout)
                if deadline is not None and time.monotonic() >= deadline:
                    break
        return [name for name, th in threads.items() if th.is_alive()]

    def _intake(
        self,
        run: _Run,
        source: Iterable[T],
        executor: ThreadPoolExecutor,
        work: Callable[[T], tuple[ChunkDelta, list[_Unit]]],
        chunk_q: queue.Queue[Any],
        held: _Gauge,
    ) -> None:
        it = iter(source)
        while not run.cancel.is_set():
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                break
            run.metrics.add_time("intake", time.perf_counter() - t0)
            held.inc()
            with run.metrics.lock:
                run.metrics.chunks_seen += 1
            run.put(chunk_q, executor.submit(work, item))
        run.put(chunk_q, _END)

    def _coalesce(
        self, run: _Run, chunk_q: queue.Queue[Any], bucket_q: queue.Queue[Any], held: _Gauge
    ) -> None:
        bucketer = Bucketer(self.bucket_bytes)
        m = run.metrics
        while (fut := run.get(chunk_q)) is not _END:
            delta, units = run.outcome(fut, "compare")
            held.dec()
            t0 = time.perf_counter()
            with m.lock:
                m.chunks_compared += 1
                m.canonical_bytes += delta.nbytes
                m.total_elements += delta.total_elements
                m.changed_elements += delta.changed_elements
                m.items += len(delta.items)
            closed = [bucket for unit, prepared in units for bucket in bucketer.add(unit, prepared)]
            m.add_time("coalesce", time.perf_counter() - t0)
            for bucket in closed:
                run.put(bucket_q, bucket)
        last = bucketer.finish()
        if last is not None:
            run.put(bucket_q, last)
        run.put(bucket_q, _END)

    def _compress(
        self,
        run: _Run,
        attempt: str,
        codec: CodecConfig,
        bucket_q: queue.Queue[Any],
        payload_q: queue.Queue[Any],
        pool: Executor | None,
    ) -> None:
        def seal(header: PayloadHeader, bucket: Bucket) -> EncodedPayload:
            t0 = time.perf_counter()
            payload = encode_payload(header, bucket.items, config=codec, mac_key=self.mac_key)
            run.metrics.add_time("compress", time.perf_counter() - t0)
            return payload

        payload_id = 0
        while (bucket := run.get(bucket_q)) is not _END:
            assert isinstance(bucket, Bucket)
            header = PayloadHeader(
                CODEC_VERSION, attempt, self.baseline.producer, payload_id, payload_id
            )
            payload_id += 1
            # In order on the queue; with a pool, as futures the send stage waits for.
            run.put(
                payload_q,
                seal(header, bucket) if pool is None else pool.submit(seal, header, bucket),
            )
        run.put(payload_q, _END)

    def _send(self, run: _Run, attempt: str, payload_q: queue.Queue[Any]) -> None:
        m = run.metrics
        while (payload := run.get(payload_q)) is not _END:
            if isinstance(payload, Future):
                payload = run.outcome(payload, "compress")
            t0 = time.perf_counter()
            self.transport.send(attempt, payload)
            m.add_time("send", time.perf_counter() - t0)
            with m.lock:
                m.payloads += 1
                m.payload_bytes += payload.size
                m.raw_bytes += payload.raw_size
            log.debug("pipeline.sent", attempt=attempt, payload=payload.header.payload_id)


class _Gauge:
    """Chunks taken from the export and not yet coalesced; tracks the maximum."""

    def __init__(self, metrics: PipelineMetrics) -> None:
        self._metrics = metrics
        self._value = 0

    def inc(self) -> None:
        with self._metrics.lock:
            self._value += 1
            self._metrics.max_chunks_held = max(self._metrics.max_chunks_held, self._value)

    def dec(self) -> None:
        with self._metrics.lock:
            self._value -= 1


def _stage(run: _Run, name: str, fn: Callable[[], None]) -> Callable[[], None]:
    def body() -> None:
        try:
            fn()
        except _CancelledError:
            pass
        except BaseException as exc:
            run.fail(name, exc)

    return body
