"""The publisher: imported in the trainer process, it hands each version to the local sidecar.

`Publisher.publish(version, source)` runs on every trainer rank that has a sidecar. It iterates
the canonical source to the end (collectives need every rank), writes each chunk this producer
owns as a safetensors file into the shared-memory inbox and names it to the sidecar, which
validates it and moves it out; then it asks the sidecar to stage the complete export as the
candidate of `version`. With `wait=True` (synchronous RL) it returns once the coordinator's
transition committed `version`; with `wait=False` (asynchronous RL) right after staging: the
trainer may step again, because every retry of the transition works from what is staged.
`initialize(source)` publishes the first export, which becomes the baseline (no dense sync).
A `PlanningSource` (`trainer.projected`: direct projection) plans the owned chunks itself from
what the sidecar expects, and may give tensors as changes against the committed baseline.

Memory bound. At most `max_in_flight` owned chunks are held by the publisher at a time, each as
tensors in the trainer process and, while being handed over, as one file in the inbox; a chunk
is at most max(export_chunk_bytes, largest tensor) bytes. So the shared-memory volume never
holds more than `max_in_flight * chunk` bytes from this rank, and the trainer's extra host
memory is `(max_in_flight + 1) * chunk` (the +1 is the chunk being assembled) on top of
whatever the source itself holds transiently (Bridge's gathered tensor, DTensor's all-gather).
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import structlog
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from refit_protocol.kit.answers import read_answer
from refit_protocol.kit.auth import bearer_header, open_ring
from refit_protocol.kit.config_files import ConfigPath
from refit_protocol.pod_contract import INBOX_ENV, PRODUCER_URL_ENV
from refit_protocol.producer_api import (
    PRODUCER_PREFIX,
    BaselineManifest,
    CandidateAbortRequest,
    CandidateChunkAck,
    CandidateChunkRequest,
    CandidateStaged,
    CandidateStageRequest,
    ProducerStatus,
    StagePurpose,
)
from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.trainer.chunk_files import change_keys, chunk_file_name, write_chunk_file
from refit_sidecar.trainer.errors import (
    CandidateDroppedError,
    SidecarUnreachableError,
    StagingError,
    StagingStateError,
    TransitionTimeoutError,
    VersionMismatchError,
    error_for,
)
from refit_sidecar.trainer.export import (
    CanonicalSource,
    PlannedChunk,
    PlanningSource,
    StageIntent,
    plan_owned,
)
from refit_sidecar.trainer.liveness import TrainerPresence
from refit_sidecar.trainer.manifest import from_wire, require_same_layout, to_wire

log = structlog.get_logger("kuberefit.publisher")
#: How often a wait for a commit says what it waits for (it may last up to commit_timeout_s).
WAIT_LOG_INTERVAL_S = 30.0


def _since(start: float) -> float:
    return round(time.monotonic() - start, 1)


M = TypeVar("M", bound=BaseModel)


class PublisherConfig(BaseModel):
    """How the trainer process reaches its sidecar and how much it may hold in flight."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str = Field(
        description="The trainer sidecar's producer endpoint, e.g. http://127.0.0.1:8471."
    )
    inbox: ConfigPath = Field(
        description="The shared-memory volume as mounted in the trainer container (the "
        "sidecar's StagingConfig.inbox is the same volume)."
    )
    token: SecretStr | None = Field(default=None, description="Bearer token of the sidecar.")
    token_file: ConfigPath | None = Field(
        default=None,
        description="File holding the token (a mounted Secret); else $KUBEREFIT_TOKEN.",
    )
    max_in_flight: int = Field(
        default=2,
        ge=1,
        description="Owned chunks held at once (written to the inbox and not yet taken over by "
        "the sidecar); bounds shared memory to max_in_flight chunks (module docstring).",
    )
    request_timeout_s: float = Field(
        default=600.0, gt=0, description="One HTTP call (taking over a chunk copies it)."
    )
    poll_interval_s: float = Field(default=0.2, gt=0, description="Status polling period.")
    commit_timeout_s: float = Field(
        default=3600.0,
        gt=0,
        description="How long publish(wait=True) waits for the transition to commit, and how "
        "long publishing v+1 waits for v (asynchronous RL) before giving up.",
    )

    @classmethod
    def from_pod(cls, **overrides: object) -> PublisherConfig:
        """The settings injection gives an opted-in trainer container: the sidecar's URL in
        $KUBEREFIT_PRODUCER_URL, the inbox in $KUBEREFIT_INBOX, the token file in
        $KUBEREFIT_TOKEN_FILE (read when the publisher starts)."""
        missing = [n for n in (PRODUCER_URL_ENV, INBOX_ENV) if not os.environ.get(n)]
        if missing:
            raise ValueError(
                f"{' and '.join('$' + n for n in missing)} not set: this container was not "
                "injected by KubeRefit (annotate the pod kuberefit.io/inject=trainer) — or "
                "configure the publisher explicitly"
            )
        fields: dict[str, object] = {
            "url": os.environ[PRODUCER_URL_ENV],
            "inbox": os.environ[INBOX_ENV],
            **overrides,
        }
        return cls.model_validate(fields)


@dataclass(frozen=True)
class PublishResult:
    """What one publish did, for the trainer's logs and metrics."""

    version: int
    purpose: StagePurpose
    producer: int
    producers: int
    chunks_total: int
    chunks_sent: int
    bytes_sent: int
    max_in_flight_seen: int
    staged_s: float
    committed: bool
    wall_s: float
    fingerprint: str | None = None
    #: Tensors sent as changes (a projecting source), and the bytes of the chunk files written.
    changed_tensors: int = 0
    file_bytes: int = 0


class Publisher:
    """One rank's handle on its trainer sidecar (thread-safe for one publish at a time)."""

    def __init__(self, config: PublisherConfig) -> None:
        self.config = config
        self._base = config.url.rstrip("/") + PRODUCER_PREFIX
        # A token file (the pod's Secret) is followed: a rotated token needs no trainer restart.
        self._tokens = open_ring(config.token, config.token_file)
        # Tells a sidecar that exits with its trainer (a Job's pod) that this process runs.
        self._presence = TrainerPresence(Path(config.inbox))
        self._presence.announce(warn=False)  # the inbox may not exist before the sidecar runs

    def close(self) -> None:
        """The trainer is finished: a sidecar set to exit with its trainer (a Job's pod) may
        go once what was published is committed. Not needed otherwise; idempotent."""
        self._presence.done()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------ public API
    def status(self) -> ProducerStatus:
        return self._call("GET", "/status", None, ProducerStatus)

    def initialize(
        self, source: CanonicalSource | PlanningSource, *, version: int = 0
    ) -> PublishResult:
        """Publish the first export: it becomes the baseline (fresh start), or is checked
        against the baseline a surviving sidecar holds (trainer restart). `version` is the
        committed version both sides hold (0 on a fresh start)."""
        return self._publish(version, "initial", source, wait=False)

    def publish(
        self, version: int, source: CanonicalSource | PlanningSource, *, wait: bool = True
    ) -> PublishResult:
        """Stage `version` (the next one) and, with `wait`, return when its transition committed."""
        return self._publish(version, "next", source, wait=wait)

    @staticmethod
    def participate(source: CanonicalSource | PlanningSource) -> None:
        """Run an export without a sidecar (a rank whose output nobody owns): collectives need
        every rank of the trainer to iterate the source to the end."""
        chunks = (
            source.plan(None)
            if isinstance(source, PlanningSource)
            else plan_owned(source.entries(), 1 << 62, None, 1)
        )
        for _ in chunks:
            pass

    # ------------------------------------------------------------------------------- machinery
    def _publish(
        self,
        version: int,
        purpose: StagePurpose,
        source: CanonicalSource | PlanningSource,
        *,
        wait: bool,
    ) -> PublishResult:
        t0 = time.monotonic()
        try:
            status, producers, limit = self._stageable(version, purpose)
            expected = self._baseline_layout() if status.baseline_ready else None
        except StagingError as exc:
            if isinstance(source, PlanningSource):  # the other ranks wait in its collective
                _refuse(source, StageIntent.refusing(version, purpose, str(exc)))
            raise
        sender = _ChunkSender(self, version, purpose, status.producer, self.config.max_in_flight)
        manifest: list[TensorMeta] = []
        total = 0
        if isinstance(source, PlanningSource):
            intent = StageIntent(
                version,
                purpose,
                status.producer,
                producers,
                limit,
                status.committed_version,
                expected,
            )
            chunks = source.plan(intent)
        else:
            chunks = plan_owned(source.entries(), limit, status.producer, producers)
        try:
            for planned in chunks:
                total += 1
                start = len(manifest)
                manifest.extend(planned.metas)
                if expected is not None and list(planned.metas) != expected[start : len(manifest)]:
                    sender.halt()  # the layout changed: send nothing more, finish the export
                if planned.owned:
                    sender.send(planned)  # after a failure or halt: drops it
            if expected is not None:
                require_same_layout(manifest, expected, "the baseline's export")
            sender.finish()
            staged = self._call(
                "POST",
                "/candidate",
                CandidateStageRequest(
                    version=version, purpose=purpose, manifest=to_wire(manifest), chunks=sender.sent
                ),
                CandidateStaged,
            )
        except BaseException:
            sender.close()
            self._abort(version)
            raise
        staged_s = time.monotonic() - t0
        log.info(
            "publisher.staged",
            version=version,
            purpose=purpose,
            producer=status.producer,
            chunks=len(sender.sent),
            nbytes=sender.bytes_sent,
            changed_tensors=sender.changed_tensors,
            file_bytes=sender.file_bytes,
            staged_s=round(staged_s, 3),
        )
        committed = False
        if wait and purpose == "next":
            self._wait_committed(version)
            committed = True
        return PublishResult(
            version=version,
            purpose=purpose,
            producer=status.producer,
            producers=producers,
            chunks_total=total,
            chunks_sent=len(sender.sent),
            bytes_sent=sender.bytes_sent,
            max_in_flight_seen=sender.max_seen,
            staged_s=staged_s,
            committed=committed,
            wall_s=time.monotonic() - t0,
            fingerprint=staged.fingerprint,
            changed_tensors=sender.changed_tensors,
            file_bytes=sender.file_bytes,
        )

    def _stageable(self, version: int, purpose: StagePurpose) -> tuple[ProducerStatus, int, int]:
        """The sidecar's status once `version` can be staged, its producer count and chunk
        limit; refuses a sidecar too old to stage and an inbox that is not mounted."""
        status = self._ready_for(version, purpose)
        producers, limit = status.producers, status.export_chunk_bytes
        if producers is None or limit is None:
            raise StagingStateError("the sidecar does not support candidate staging (too old)")
        if not self.config.inbox.is_dir():
            raise StagingStateError(
                f"the inbox {self.config.inbox} is not a directory: mount the shared-memory "
                "volume the sidecar reads (its StagingConfig.inbox) there"
            )
        return status, producers, limit

    def _ready_for(self, version: int, purpose: StagePurpose) -> ProducerStatus:
        """The sidecar's status once `version` can be staged (waits for v-1 in async RL)."""
        status = self.status()
        if purpose == "initial":
            if version != status.committed_version:
                raise VersionMismatchError(
                    f"the first export must be of the committed version "
                    f"v{status.committed_version}, got v{version}: both sides must start from "
                    "the same HF weights (resume the trainer from that version's checkpoint)"
                )
            return status
        if not status.baseline_ready:
            raise StagingStateError(
                "the sidecar has no baseline yet: call Publisher.initialize(source) with the "
                "first export before publishing new versions"
            )
        previous = version - 1
        if status.committed_version == previous - 1 and status.candidate_version == previous:
            # Asynchronous RL: v-1 is staged and its transition is running; stage v after it.
            status = self._wait_for(
                lambda s: s.committed_version >= previous, f"v{previous} to commit", previous
            )
        if version <= status.committed_version:
            raise VersionMismatchError(
                f"v{version} is already committed (the sidecar committed "
                f"v{status.committed_version}); the next version is "
                f"v{status.committed_version + 1}"
            )
        if version != status.committed_version + 1:
            raise VersionMismatchError(
                f"v{version} is not the next version: the sidecar committed "
                f"v{status.committed_version}, the next is v{status.committed_version + 1}"
            )
        return status

    def _baseline_layout(self) -> list[TensorMeta]:
        """The baseline's export layout: checked while exporting, before a chunk is sent."""
        return from_wire(self._call("GET", "/baseline/manifest", None, BaselineManifest).tensors)

    def _wait_committed(self, version: int) -> ProducerStatus:
        return self._wait_for(lambda s: s.committed_version >= version, f"v{version}", version)

    def _wait_for(
        self, done: Callable[[ProducerStatus], bool], what: str, version: int
    ) -> ProducerStatus:
        start = time.monotonic()
        deadline = start + self.config.commit_timeout_s
        outage: SidecarUnreachableError | None = None
        said = start - WAIT_LOG_INTERVAL_S  # say at once what this waits for, then now and then
        while True:
            try:
                status = self.status()
            except SidecarUnreachableError as exc:
                # A sidecar restarting while a transition runs: keep waiting (it then says
                # whether it still holds the candidate), within the same deadline.
                if outage is None:
                    log.warning("publisher.sidecar_unreachable_while_waiting", error=str(exc))
                outage = exc
                if time.monotonic() >= deadline:
                    raise TransitionTimeoutError(
                        f"waited {self.config.commit_timeout_s:.0f}s for {what}; the sidecar "
                        f"stopped answering: {exc}"
                    ) from exc
                time.sleep(self.config.poll_interval_s)
                continue
            if outage is not None:
                log.info("publisher.sidecar_back", version=version)
                outage = None
            if done(status):
                if time.monotonic() - start > WAIT_LOG_INTERVAL_S:
                    log.info("publisher.wait_over", waited_for=what, waited_s=_since(start))
                return status
            if time.monotonic() - said >= WAIT_LOG_INTERVAL_S:
                said = time.monotonic()
                log.info(
                    "publisher.waiting",
                    waiting_for=what,
                    committed=status.committed_version,
                    candidate=status.candidate_version,
                    waited_s=_since(start),
                    timeout_s=self.config.commit_timeout_s,
                )
            if status.candidate_version != version and status.committed_version < version:
                raise CandidateDroppedError(
                    f"the sidecar no longer holds the candidate v{version} and committed only "
                    f"v{status.committed_version} (restarted?): publish v{version} again"
                )
            if time.monotonic() >= deadline:
                raise TransitionTimeoutError(
                    f"waited {self.config.commit_timeout_s:.0f}s for {what}; the sidecar "
                    f"committed v{status.committed_version} (is the coordinator running?)"
                )
            time.sleep(self.config.poll_interval_s)

    def _abort(self, version: int) -> None:
        try:
            self._call("POST", "/candidate/abort", CandidateAbortRequest(version=version), None)
        except StagingError as exc:
            log.warning("publisher.abort_failed", version=version, error=str(exc))

    def _call(
        self,
        method: str,
        path: str,
        body: BaseModel | None,
        out: type[M] | None,
        *,
        compact: bool = False,
    ) -> M:
        """One request; `compact` leaves fields at their defaults out of the body, so a sidecar
        that predates a field still accepts the requests that do not use it."""
        data = None if body is None else body.model_dump_json(exclude_defaults=compact).encode()
        url = self._base + path
        headers = {"Content-Type": "application/json", **bearer_header(self._tokens.newest())}
        req = urllib.request.Request(url, data=data, headers=headers, method=method)  # noqa: S310
        try:
            with urllib.request.urlopen(req, timeout=self.config.request_timeout_s) as resp:  # noqa: S310
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise _refusal(url, exc) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise SidecarUnreachableError(
                f"the trainer sidecar at {self.config.url} is unreachable ({reason}): is it "
                "running, and is the publisher's url its producer endpoint?"
            ) from exc
        self._presence.announce()  # the sidecar answers: its inbox exists by now
        if out is None:
            return None  # type: ignore[return-value]
        return read_answer(out, raw)  # a newer sidecar's added fields are ignored


def _refuse(source: PlanningSource, intent: StageIntent) -> None:
    """Take part in the source's first collective with a refusal, so every rank raises."""
    try:
        for _ in source.plan(intent):
            pass
    except StagingError:
        pass  # the source's word for this rank's own refusal: the caller raises the original


def _refusal(url: str, exc: urllib.error.HTTPError) -> StagingError:
    raw = exc.read()
    try:
        body = json.loads(raw)
        message, code = str(body.get("error")), body.get("code")
    except (ValueError, AttributeError):
        message, code = raw[:300].decode(errors="replace"), None
    if exc.code == 401:
        return StagingError(f"the sidecar refused the bearer token ({url}): check the token")
    return error_for(code, f"{message} (HTTP {exc.code} from {url})")


class _ChunkSender:
    """Writes owned chunks to the inbox and hands them over, at most `limit` at a time."""

    def __init__(
        self, publisher: Publisher, version: int, purpose: StagePurpose, producer: int, limit: int
    ) -> None:
        self._publisher = publisher
        self._version = version
        self._purpose = purpose
        self._producer = producer
        self._slots = threading.Semaphore(limit)
        self._pool = ThreadPoolExecutor(limit, thread_name_prefix="refit-publish")
        self._futures: list[Future[int]] = []
        self._lock = threading.Lock()
        self._held = 0
        self.max_seen = 0
        self.sent: list[int] = []
        self.bytes_sent = 0
        self.changed_tensors = 0
        self.file_bytes = 0
        self._error: BaseException | None = None
        self._halted = False

    def halt(self) -> None:
        """Send no further chunks (the caller raises a better error once the export ends)."""
        self._halted = True

    def send(self, chunk: PlannedChunk) -> None:
        """Hand one owned chunk to a worker; blocks while `limit` chunks are held. After a
        failure the chunk is dropped: the caller keeps iterating so the other ranks are not
        stuck in a collective, and `finish` raises the first error."""
        if self._error is not None or self._halted:
            return
        self._slots.acquire()
        with self._lock:
            self._held += 1
            self.max_seen = max(self.max_seen, self._held)
        fut = self._pool.submit(self._hand_over, chunk)
        fut.add_done_callback(self._release)
        self._futures.append(fut)

    def _release(self, fut: Future[int]) -> None:
        with self._lock:
            self._held -= 1
            if fut.exception() is not None and self._error is None:
                self._error = fut.exception()
        self._slots.release()

    def _hand_over(self, chunk: PlannedChunk) -> int:
        inbox = self._publisher.config.inbox
        name = chunk_file_name(self._version, self._producer, chunk.index)
        entries = list(chunk.chunk.tensors if chunk.chunk is not None else ())
        for change in chunk.changes:
            entries += zip(change_keys(change.name), (change.positions, change.values), strict=True)
        path, size = write_chunk_file(inbox, name, entries)
        try:
            ack = self._publisher._call(
                "POST",
                "/candidate/chunk",
                CandidateChunkRequest(
                    version=self._version,
                    purpose=self._purpose,
                    index=chunk.index,
                    file=name,
                    names=[m.name for m in chunk.metas],
                    changed=[c.name for c in chunk.changes],
                ),
                CandidateChunkAck,
                compact=True,  # `changed` is newer than the export path's sidecars
            )
        finally:
            path.unlink(missing_ok=True)  # taken over (moved) by the sidecar, or refused
        with self._lock:
            self.sent.append(chunk.index)
            self.bytes_sent += ack.nbytes
            self.changed_tensors += len(chunk.changes)
            self.file_bytes += size
        return ack.nbytes

    def finish(self) -> None:
        for fut in self._futures:
            fut.exception()  # wait
        self._pool.shutdown(wait=True)
        if self._error is not None:
            raise self._error
        self.sent.sort()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
