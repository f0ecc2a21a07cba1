"""HTTP client of a trainer sidecar's producer (implements the coordinator's ProducerClient)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TypeVar

import aiohttp
import structlog
from pydantic import BaseModel

from refit_protocol.commit import CommitRecord
from refit_protocol.errors import (
    ConfigurationError,
    EndpointError,
    ErrorBody,
    PeerAuthenticationError,
)
from refit_protocol.kit.answers import read_answer
from refit_protocol.kit.auth import bearer_header
from refit_protocol.kit.tokens import TokenRing, as_ring
from refit_protocol.producer_api import (
    PRODUCER_PREFIX,
    AttemptPlan,
    BaselineManifest,
    BaselineUpdateRequest,
    CommittedRecordRequest,
    ProducerAttemptRequest,
    ProducerStatus,
    SentReport,
)

M = TypeVar("M", bound=BaseModel)
log = structlog.get_logger("kuberefit.producer_client")


class _Ack(BaseModel):
    ok: bool = True


class HttpProducerClient:
    """One producer's control endpoint. Share one `aiohttp.ClientSession` among clients."""

    def __init__(
        self,
        producer: int,
        base_url: str,
        *,
        token: str | TokenRing | None,
        session: aiohttp.ClientSession,
        timeout_s: float = 3600.0,
    ) -> None:
        self.producer = producer
        self.base_url = base_url.rstrip("/")
        self._session = session
        self._tokens = as_ring(token)  # a ring is followed across token rotations
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def _call(self, method: str, path: str, body: BaseModel | None, out: type[M]) -> M:
        headers = bearer_header(self._tokens.sending())
        data = None
        if body is not None:
            # Optional fields newer than the sidecar (e.g. AttemptPlan.settings) are left out
            # when unset, so a sidecar of the previous release still takes the request.
            data = body.model_dump_json(exclude_none=True).encode()
            headers["Content-Type"] = "application/json"
        url = f"{self.base_url}{PRODUCER_PREFIX}{path}"
        try:
            async with self._session.request(
                method, url, data=data, headers=headers, timeout=self._timeout
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    err = ErrorBody.parse(raw, resp.status).error
                    error = PeerAuthenticationError if resp.status in (401, 403) else EndpointError
                    raise error(f"producer {self.producer}{path}: HTTP {resp.status}: {err}")
                return read_answer(out, raw)  # a newer sidecar's added fields are ignored
        except aiohttp.ClientError as exc:
            raise EndpointError(f"producer {self.producer}{path}: {exc}") from exc

    async def status(self) -> ProducerStatus:
        return await self._call("GET", "/status", None, ProducerStatus)

    async def start(self, plan: AttemptPlan) -> None:
        await self._call("POST", "/start", plan, _Ack)

    async def wait_sent(self, attempt: str) -> SentReport:
        return await self._call(
            "POST", "/wait-sent", ProducerAttemptRequest(attempt=attempt), SentReport
        )

    async def stop_and_wait(self, attempt: str) -> None:
        await self._call("POST", "/stop", ProducerAttemptRequest(attempt=attempt), _Ack)

    async def cleanup(self, attempt: str) -> None:
        await self._call("POST", "/cleanup", ProducerAttemptRequest(attempt=attempt), _Ack)

    async def update_baseline(self, attempt: str, record: CommitRecord) -> None:
        req = BaselineUpdateRequest(
            attempt=attempt, version=record.version, baseline_id=record.baseline_id
        )
        await self._call("POST", "/update-baseline", req, _Ack)

    async def baseline_manifest(self) -> BaselineManifest:
        """Every tensor of the export (name, shape, dtype), as the baseline holds it."""
        return await self._call("GET", "/baseline/manifest", None, BaselineManifest)

    async def learn_committed(self, record: CommitRecord) -> None:
        """Tell a producer without a baseline (restarted) which version is committed."""
        req = CommittedRecordRequest(version=record.version, baseline_id=record.baseline_id)
        await self._call("POST", "/committed", req, _Ack)


async def all_staged(
    producers: Sequence[HttpProducerClient], version: int, timeout_s: float | None = None
) -> bool:
    """True when every producer has staged `version` (its candidate), the condition for the next
    transition to start; a producer that does not answer (within `timeout_s`) means not yet."""
    try:
        statuses = await asyncio.gather(
            *(asyncio.wait_for(p.status(), timeout_s) for p in producers)
        )
    except PeerAuthenticationError:
        raise  # another token: waiting cannot help
    except (EndpointError, TimeoutError) as exc:
        log.info("producer.not_ready", error=str(exc) or type(exc).__name__)
        return False
    split = chunking_disagreement({f"producer {s.producer}": s for s in statuses})
    if split is not None:
        raise ConfigurationError(split)  # ownership would overlap: waiting cannot help
    return all(s.candidate_version == version for s in statuses)


def chunking_disagreement(statuses: dict[str, ProducerStatus]) -> str | None:
    """Why these producers cannot share one export (None: they can). Chunk `i` belongs to
    producer `i % producers` of chunks cut at `export_chunk_bytes`: producers that cut or count
    differently would both own some tensors (an XOR applied twice cancels out) and none own
    others. With `auto` sizes a producer without the reference checkpoint falls back to
    256 MiB, so this names what each one reports."""
    seen = {
        name: (s.producers, s.export_chunk_bytes)
        for name, s in statuses.items()
        if s.export_chunk_bytes is not None
    }
    if len(set(seen.values())) <= 1:
        return None
    said = ", ".join(
        f"{name}: {count} producers, {size}-byte chunks" for name, (count, size) in seen.items()
    )
    return (
        f"the producers chunk the export differently ({said}); give every trainer sidecar the "
        "same export_chunk_bytes and producers (with auto sizes, the same "
        "staging.reference_checkpoint), or set them explicitly"
    )
