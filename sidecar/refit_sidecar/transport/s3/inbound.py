"""The S3 transport's receiving side: take manifest pointers, download, stage.

A producer POSTs one `ManifestEntry` per payload to `/v1/manifest` on every receiver and a
`StreamEnd` to `/v1/stream-end` (both on the node's authenticated control plane). An entry is
claimed from the node's sink first (admitted, deduplicated, counted against the producer's
quota); its object is then downloaded on this inbound's pool with the node's own client, never
more bytes than the entry announced, and staged unverified (the sink checks identity, MAC and
digest before anything is decoded or held). While the node's queue is full a manifest request
waits up to `offer_wait_s`, then answers 429: the producer asks again (backpressure).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import structlog
from aiohttp import web

from refit_protocol.receiver_api import (
    API_PREFIX,
    ManifestEntry,
    ManifestResponse,
    PrepareRequest,
    StreamEnd,
)
from refit_sidecar.transport.errors import PayloadRejectedError
from refit_sidecar.transport.inbound import AckStatus, Claim, PayloadIdent, PayloadSink
from refit_sidecar.transport.plugin import InboundContext
from refit_sidecar.transport.s3.store import S3Config, S3Fetcher

log = structlog.get_logger("kuberefit.transport.s3")

MANIFEST_PATH, STREAM_END_PATH = f"{API_PREFIX}/manifest", f"{API_PREFIX}/stream-end"
#: HTTP status of each answer to an offer (manifest entry, stream end).
OFFER_STATUS = {
    AckStatus.STAGED: 202,
    AckStatus.DUPLICATE: 200,
    AckStatus.WAIT: 429,
    AckStatus.OBSOLETE: 409,
    AckStatus.UNKNOWN_ATTEMPT: 409,
    AckStatus.REJECTED: 422,
    AckStatus.READY: 200,
}


def ident_of(m: ManifestEntry) -> PayloadIdent:
    """The identity a manifest entry announces (ValueError: a digest that is not 16 hex bytes)."""
    try:
        digest = bytes.fromhex(m.digest)
    except ValueError as exc:
        raise ValueError(f"digest {m.digest[:40]!r} is not hex") from exc
    if len(digest) != 16:
        raise ValueError("digest must be 16 bytes (BLAKE2b-128)")
    return PayloadIdent(m.attempt, m.producer, m.payload_id, m.order, digest, m.size)


class S3Inbound:
    """One node's S3 downloads (`transport.inbound.Inbound`)."""

    kind = "s3"

    def __init__(
        self,
        config: S3Config,
        sink: PayloadSink,
        context: InboundContext,
        fetcher: S3Fetcher | None = None,
    ) -> None:
        self.config = config
        self.sink = sink
        self.context = context
        self._fetcher = fetcher
        self._pool: ThreadPoolExecutor | None = None

    # -- Inbound ----------------------------------------------------------------------------------
    def start(self) -> S3Inbound:
        if self._fetcher is None:
            self._fetcher = S3Fetcher(self.config)
        self._pool = ThreadPoolExecutor(self.context.workers, "refit-download")
        return self

    def refusal(self, req: PrepareRequest) -> str:
        return ""

    def drain(self, attempt: str, timeout: float) -> list[str]:
        return []  # a download in flight is a registered payload: the sink's barrier waits

    def abort(self, attempt: str) -> None:
        """Nothing to stop: downloads of a retired attempt see it and drop their bytes."""

    def forget(self, attempt: str) -> None:
        """Nothing kept per attempt."""

    def readiness(self) -> tuple[str, bool, str]:
        if self._pool is None:
            return ("s3", False, "S3 downloads not started")
        where = self.config.endpoint_url or f"AWS {self.config.region}"
        return ("s3", True, f"downloads from s3://{self.config.bucket} at {where}")

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post(MANIFEST_PATH, self._manifest),
            web.post(STREAM_END_PATH, self._stream_end),
        ]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # -- offers -----------------------------------------------------------------------------------
    def offer(self, m: ManifestEntry) -> tuple[AckStatus, str]:
        """Claim a manifest entry and queue its download. An entry naming another bucket fails
        the attempt here (REJECTED)."""
        if self._pool is None:
            return (AckStatus.REJECTED, "this node's S3 downloads are not started")
        if m.bucket != self.config.bucket:  # a producer configured for another store
            reason = (
                f"manifest of payload {m.producer}/{m.payload_id}: bucket {m.bucket!r} is not "
                f"the configured payload bucket {self.config.bucket!r}"
            )
            self.sink.fail(m.attempt, reason)
            return (AckStatus.REJECTED, reason)
        try:
            ident = ident_of(m)
        except ValueError as exc:
            return (AckStatus.REJECTED, str(exc))
        claim = self.sink.claim(ident)
        if isinstance(claim, tuple):
            return claim
        self._pool.submit(self._download, claim, m)
        return (AckStatus.STAGED, "")

    def _download(self, claim: Claim, m: ManifestEntry) -> None:
        assert self._fetcher is not None
        last: Exception | None = None
        for i in range(self.context.retries + 1):
            if not self.sink.live(claim):
                self.sink.withdraw(claim, None)
                return
            try:
                data = self._fetcher.fetch(m.bucket, m.key, m.size)
                break
            except PayloadRejectedError as exc:  # wrong bucket or size: retrying cannot help
                self.sink.withdraw(claim, f"download of {m.key}: {exc}")
                return
            except Exception as exc:  # network, 404 before consistency
                last = exc
                time.sleep(min(0.1 * 2**i, 2.0))
        else:
            self.sink.withdraw(claim, f"download of {m.key} failed: {last!r}")
            return
        self.sink.stage(claim, data, verified=False)

    # -- HTTP -------------------------------------------------------------------------------------
    async def _manifest(self, request: web.Request) -> web.Response:
        # A malformed body raises ValidationError: the control plane answers 400.
        entry = ManifestEntry.model_validate_json(await request.read() or b"{}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.context.offer_wait_s
        delay = 0.005
        while True:
            verdict, error = self.offer(entry)
            if verdict is not AckStatus.WAIT or loop.time() >= deadline:
                break
            await asyncio.sleep(delay)  # backpressure: the producer's request waits here
            delay = min(delay * 2, 0.1)
        return self._answer(verdict, error, OFFER_STATUS[verdict])

    async def _stream_end(self, request: web.Request) -> web.Response:
        req = StreamEnd.model_validate_json(await request.read() or b"{}")
        verdict, error = self.sink.end(req.attempt, req.producer, req.total)
        status = 200 if verdict is AckStatus.STAGED else OFFER_STATUS[verdict]
        return self._answer(verdict, error, status)

    def _answer(self, verdict: AckStatus, error: str, status: int) -> web.Response:
        body = ManifestResponse(node=self.sink.node, status=verdict.value, error=error)
        return web.Response(
            body=body.model_dump_json().encode(),
            status=status,
            content_type="application/json",
        )
