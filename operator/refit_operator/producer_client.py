"""HTTP client of a trainer sidecar's producer (implements the coordinator's ProducerClient)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TypeVar

import aiohttp
import structlog
from pydantic import BaseModel

from refit_protocol.auth import bearer_header
from refit_protocol.commit import CommitRecord
from refit_protocol.errors import EndpointError, ErrorBody, PeerAuthenticationError
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
from refit_protocol.tokens import TokenRing, as_ring

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
            data = body.model_dump_json().encode()
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
                return out.model_validate_json(raw)
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
    return all(s.candidate_version == version for s in statuses)
