"""The S3 transport's sending side: upload each payload once, announce it to every receiver.

`S3Transport` uploads each payload (`store.upload_payload`), then POSTs a `ManifestEntry`
(bucket, key, digest, ids) to every receiver node's `/v1/manifest`; the send completes when
every receiver accepted it. A receiver answering 429 (queue full) is asked again with backoff:
that is the backpressure path. `stop_and_wait` drains the window, announces the stream end,
aborts incomplete multipart uploads and deletes objects no receiver accepted (the leftovers);
`cleanup` deletes every object of the attempt (after commit or stop).
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog
import urllib3
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from refit_protocol.kit.auth import bearer_header
from refit_protocol.kit.tokens import TokenRing, as_ring
from refit_protocol.receiver_api import API_PREFIX, ManifestEntry, StreamEnd
from refit_sidecar.codec.wire import EncodedPayload
from refit_sidecar.transport.base import TransportSummary
from refit_sidecar.transport.errors import (
    AttemptObsoleteError,
    DeliveryTimeoutError,
    PayloadRejectedError,
    TransportError,
)
from refit_sidecar.transport.s3.store import (
    S3Config,
    abort_uploads,
    attempt_prefix,
    delete_prefix,
    make_client,
    object_key,
    upload_payload,
)
from refit_sidecar.transport.window import AttemptSends, SendWindow

log = structlog.get_logger("kuberefit.transport.s3")


class S3TransportConfig(BaseModel):
    """Where a producer uploads payloads and whom it announces them to."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    s3: S3Config = Field(description="The object store payloads are uploaded to.")
    receivers: list[str] = Field(
        default_factory=list,
        description="Base URLs of every receiver node's service (empty: each attempt plan's "
        "`receiver_urls`, as a coordinator sends them).",
    )
    token: SecretStr | None = Field(default=None, description="Receivers' bearer token.")
    producer: int | None = Field(
        default=None, ge=0, description="This producer's id (stream end of an empty stream)."
    )
    max_in_flight: int = Field(default=2, ge=1, description="Payloads uploading/announcing.")
    http_timeout_s: float = Field(default=30.0, gt=0, description="Per manifest request.")
    http_retries: int = Field(default=3, ge=0, description="Retries after connection errors.")
    max_wait_s: float = Field(
        default=3600.0, gt=0, description="How long a receiver may answer 429 (backpressure)."
    )
    unknown_attempt_timeout_s: float = Field(
        default=30.0, gt=0, description="How long to retry while a receiver lacks the attempt."
    )
    stop_timeout_s: float = Field(
        default=120.0, gt=0, description="How long stop_and_wait waits for uploads and offers."
    )


class S3Transport:
    """`Transport` over object storage for one producer (thread-safe)."""

    def __init__(
        self,
        config: S3TransportConfig,
        *,
        client: Any | None = None,
        tokens: TokenRing | None = None,
    ) -> None:
        self.config = config
        self.client = client if client is not None else make_client(config.s3)
        token = config.token.get_secret_value() if config.token else None
        self._tokens = tokens if tokens is not None else as_ring(token)
        workers = config.max_in_flight
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="s3-send")
        self._posters = ThreadPoolExecutor(
            max(2, min(32, len(config.receivers) * workers)), thread_name_prefix="s3-manifest"
        )
        self._http = urllib3.PoolManager(maxsize=max(4, len(config.receivers)), retries=False)
        self._window = SendWindow(config.max_in_flight)
        self._orphans: dict[str, set[str]] = {}  # objects no receiver accepted, per attempt
        self._orphans_lock = threading.Lock()

    # -- Transport --------------------------------------------------------------------------------
    def send(self, attempt: str, payload: EncodedPayload) -> None:
        if payload.header.attempt != attempt:
            raise ValueError(f"payload of attempt {payload.header.attempt!r} sent as {attempt!r}")
        self._window.admit(attempt, payload.header.producer, payload.size)
        fut = self._pool.submit(self._deliver, attempt, payload)
        size = payload.size
        fut.add_done_callback(lambda f: self._window.settle(attempt, f.exception(), size))

    def stop_and_wait(self, attempt: str) -> TransportSummary:
        deadline = time.monotonic() + self.config.stop_timeout_s
        st = self._window.stop_and_drain(attempt, deadline)
        if st.in_flight:
            self._window.note(st, f"{st.in_flight} payloads still in flight at stop")
        if not st.errors:
            self._announce_end(attempt, st)
        self._sweep_leftovers(attempt, st)
        return self._window.summary(attempt, st)

    def cleanup(self, attempt: str) -> None:
        self._window.forget(attempt)
        with self._orphans_lock:
            self._orphans.pop(attempt, None)
        n = delete_prefix(
            self.client, self.config.s3.bucket, attempt_prefix(self.config.s3, attempt)
        )
        log.info("s3.cleanup", attempt=attempt, deleted=n)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._posters.shutdown(wait=False, cancel_futures=True)
        self._http.clear()

    # -- internals --------------------------------------------------------------------------------
    def _deliver(self, attempt: str, payload: EncodedPayload) -> None:
        h = payload.header
        cfg = self.config.s3
        digest = payload.digest.hex()
        key = object_key(cfg, attempt, h.producer, h.payload_id, digest)
        upload_payload(self.client, cfg, key, payload.body)
        entry = ManifestEntry(
            attempt=attempt,
            producer=h.producer,
            payload_id=h.payload_id,
            order=h.order,
            bucket=cfg.bucket,
            key=key,
            digest=digest,
            size=payload.size,
        )
        body = entry.model_dump_json().encode()
        futs = [
            self._posters.submit(self._post_until_taken, url, "/manifest", body, key)
            for url in self.config.receivers
        ]
        accepted = 0
        first: BaseException | None = None
        for f in futs:
            try:
                f.result()
                accepted += 1
            except BaseException as exc:
                first = first or exc
        if first is not None:
            if accepted == 0:
                with self._orphans_lock:
                    self._orphans.setdefault(attempt, set()).add(key)
            raise first

    def _post_until_taken(self, base: str, path: str, body: bytes, what: str) -> None:
        """POST until the receiver takes it; 429 and unknown attempts are retried with backoff."""
        url = base.rstrip("/") + API_PREFIX + path
        start = time.monotonic()
        backoff = 0.02
        conn_errors = 0
        while True:
            try:
                resp = self._http.request(
                    "POST",
                    url,
                    body=body,
                    headers={
                        "Content-Type": "application/json",
                        **bearer_header(self._tokens.sending()),
                    },
                    timeout=urllib3.Timeout(total=self.config.http_timeout_s),
                )
            except urllib3.exceptions.HTTPError as exc:
                conn_errors += 1
                if conn_errors > self.config.http_retries:
                    raise DeliveryTimeoutError(f"{url}: {exc}") from exc
                time.sleep(min(0.2 * 2**conn_errors, 2.0))
                continue
            status = _status_of(resp)
            if resp.status in (200, 202):
                return
            waited = time.monotonic() - start
            if resp.status == 429 and waited < self.config.max_wait_s:
                time.sleep(backoff)
                backoff = min(backoff * 2, 0.5)
                continue
            if status == "unknown_attempt" and waited < self.config.unknown_attempt_timeout_s:
                time.sleep(backoff)
                backoff = min(backoff * 2, 0.5)
                continue
            error = _error_of(resp)
            if resp.status == 409 and status == "obsolete":
                raise AttemptObsoleteError(f"{url}: {what}: {error}")
            if resp.status in (409, 422):
                raise PayloadRejectedError(f"{url}: {what}: {error}")
            if resp.status == 429:
                raise DeliveryTimeoutError(
                    f"{url}: {what}: still backpressured after {waited:.0f}s"
                )
            raise TransportError(f"{url}: {what}: HTTP {resp.status}: {error}")

    def _announce_end(self, attempt: str, st: AttemptSends) -> None:
        producer = st.end_producer(self.config.producer)
        if producer is None:
            return
        body = StreamEnd(attempt=attempt, producer=producer, total=st.sent).model_dump_json()
        futs = [
            self._posters.submit(self._post_until_taken, url, "/stream-end", body.encode(), "end")
            for url in self.config.receivers
        ]
        for f in futs:
            try:
                f.result()
            except Exception as exc:
                self._window.note(st, f"stream end: {exc}")

    def _sweep_leftovers(self, attempt: str, st: AttemptSends) -> None:
        """Stream end: abort incomplete uploads of this producer, delete unannounced objects."""
        cfg = self.config.s3
        producers = set(st.producers)
        if self.config.producer is not None:
            producers.add(self.config.producer)
        try:
            for producer in producers:
                abort_uploads(
                    self.client, cfg.bucket, f"{attempt_prefix(cfg, attempt)}p{producer}/"
                )
            with self._orphans_lock:
                orphans = self._orphans.pop(attempt, set())
            if orphans:
                self.client.delete_objects(
                    Bucket=cfg.bucket,
                    Delete={"Objects": [{"Key": k} for k in sorted(orphans)], "Quiet": True},
                )
        except Exception as exc:  # cleanup(attempt) deletes the whole prefix later
            log.warning("s3.leftover_sweep_failed", attempt=attempt, error=str(exc))


def _status_of(resp: Any) -> str:
    try:
        data = json.loads(resp.data or b"{}")
    except ValueError:
        return ""
    return str(data.get("status", "")) if isinstance(data, dict) else ""


def _error_of(resp: Any) -> str:
    try:
        data = json.loads(resp.data or b"{}")
    except ValueError:
        return resp.data[:200].decode(errors="replace") if resp.data else ""
    return str(data.get("error", data)) if isinstance(data, dict) else str(data)
