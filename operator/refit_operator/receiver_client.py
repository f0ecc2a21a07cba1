"""An asyncio HTTP client of one receiver node (no torch, no zmq: usable by the operator).

It implements the coordinator's `ReceiverClient` port plus the producer-facing calls. Non-2xx
answers raise `ReceiverHttpError` (an `EndpointError`) carrying the status and the error body
(`refit_protocol.errors.ErrorBody`: its message, and its `code` as `reason`).
"""

from __future__ import annotations

from typing import TypeVar

import aiohttp
from pydantic import BaseModel

from refit_protocol.errors import EndpointError, ErrorBody, PeerAuthenticationError
from refit_protocol.kit.answers import read_answer
from refit_protocol.kit.auth import bearer_header
from refit_protocol.kit.tokens import TokenRing, as_ring
from refit_protocol.receiver_api import (
    API_PREFIX,
    AttemptRequest,
    AuditRequest,
    AuditResponse,
    CommitNotice,
    FlushRequest,
    FlushResponse,
    GateRequest,
    ManifestEntry,
    ManifestResponse,
    PrepareRequest,
    PrepareResponse,
    PrewarmRequest,
    PrewarmResponse,
    ReceiverStatus,
    RelayFlushRequest,
    RelayFlushResponse,
    RestoreRequest,
    StopResponse,
    StreamEnd,
)

M = TypeVar("M", bound=BaseModel)


class ReceiverHttpError(EndpointError):
    def __init__(self, node: str, path: str, status: int, body: ErrorBody) -> None:
        self.status = status
        self.body = body
        self.reason = body.code  # e.g. obsolete, unknown_attempt, bad_request
        super().__init__(f"{node}{path}: HTTP {status}: {body.error}")


class ReceiverAuthError(ReceiverHttpError, PeerAuthenticationError):
    """The receiver refused the coordinator's token."""


class ReceiverHttpClient:
    """Calls one node's service. Share one `aiohttp.ClientSession` between many clients."""

    def __init__(
        self,
        node: str,
        base_url: str,
        *,
        token: str | TokenRing | None,
        session: aiohttp.ClientSession,
        timeout_s: float = 900.0,
    ) -> None:
        self.node = node
        self.base_url = base_url.rstrip("/")
        self._session = session
        self._tokens = as_ring(token)  # a ring is followed across token rotations
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    @property
    def url(self) -> str:
        return self.base_url

    async def _call(
        self,
        method: str,
        path: str,
        body: BaseModel | None,
        out: type[M],
        ok: tuple[int, ...] = (200,),
    ) -> M:
        data = body.model_dump_json().encode() if body is not None else None
        headers = bearer_header(self._tokens.sending())
        if data is not None:
            headers["Content-Type"] = "application/json"
        try:
            async with self._session.request(
                method, self.base_url + path, data=data, headers=headers, timeout=self._timeout
            ) as resp:
                raw = await resp.read()
                if resp.status not in ok:
                    parsed = ErrorBody.parse(raw, resp.status)
                    error = ReceiverAuthError if resp.status in (401, 403) else ReceiverHttpError
                    raise error(self.node, path, resp.status, parsed)
                return read_answer(out, raw)  # a newer sidecar's added fields are ignored
        except aiohttp.ClientError as exc:
            raise EndpointError(f"{self.node}{path}: {type(exc).__name__}: {exc}") from exc

    # -- coordinator port -------------------------------------------------------------------------
    async def status(self) -> ReceiverStatus:
        return await self._call("GET", f"{API_PREFIX}/status", None, ReceiverStatus)

    async def prepare(self, req: PrepareRequest) -> PrepareResponse:
        return await self._call("POST", f"{API_PREFIX}/prepare", req, PrepareResponse)

    async def gate(self, req: GateRequest) -> None:
        await self._call("POST", f"{API_PREFIX}/gate", req, ReceiverStatus)

    async def open_apply(self, attempt: str) -> None:
        await self._call(
            "POST", f"{API_PREFIX}/open-apply", AttemptRequest(attempt=attempt), ReceiverStatus
        )

    async def relay_flush(self, req: RelayFlushRequest) -> RelayFlushResponse:
        return await self._call("POST", f"{API_PREFIX}/relay-flush", req, RelayFlushResponse)

    async def flush(self, req: FlushRequest) -> FlushResponse:
        return await self._call("POST", f"{API_PREFIX}/flush", req, FlushResponse)

    async def stop(self, attempt: str) -> StopResponse:
        return await self._call(
            "POST", f"{API_PREFIX}/stop", AttemptRequest(attempt=attempt), StopResponse
        )

    async def cleanup(self, attempt: str) -> None:
        await self._call(
            "POST", f"{API_PREFIX}/cleanup", AttemptRequest(attempt=attempt), ReceiverStatus
        )

    async def commit_notice(self, attempt: str, version: int, *, dense: bool = False) -> None:
        await self._call(
            "POST",
            f"{API_PREFIX}/commit",
            CommitNotice(attempt=attempt, version=version, dense=dense),
            ReceiverStatus,
        )

    # -- others -----------------------------------------------------------------------------------
    async def prewarm(self, req: PrewarmRequest) -> PrewarmResponse:
        return await self._call("POST", f"{API_PREFIX}/prewarm", req, PrewarmResponse)

    async def prewarmed(self) -> PrewarmResponse | None:
        """The node's last prewarm answer (None if it was never prewarmed); asks no runtime."""
        try:
            return await self._call("GET", f"{API_PREFIX}/prewarm", None, PrewarmResponse)
        except ReceiverHttpError as exc:
            if exc.status == 404:
                return None
            raise

    async def restore(self, req: RestoreRequest) -> PrewarmResponse:
        """Dense restore to the committed version, then prewarm (see `RestoreRequest`)."""
        return await self._call("POST", f"{API_PREFIX}/restore", req, PrewarmResponse)

    async def audit(self, req: AuditRequest) -> AuditResponse:
        """Prove the node holds exactly a dense load of a checkpoint (see `AuditRequest`)."""
        return await self._call("POST", f"{API_PREFIX}/audit", req, AuditResponse)

    async def manifest(self, entry: ManifestEntry) -> ManifestResponse:
        return await self._call(
            "POST", f"{API_PREFIX}/manifest", entry, ManifestResponse, ok=(200, 202)
        )

    async def stream_end(self, req: StreamEnd) -> ManifestResponse:
        return await self._call("POST", f"{API_PREFIX}/stream-end", req, ManifestResponse)
