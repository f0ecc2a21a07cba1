"""What every KubeRefit HTTP service answers the same way (aiohttp): error bodies, the bearer
guard, `/healthz`, `/readyz` and `/metrics` (`add_probe_routes`).

- Errors: `ErrorBody` (`refit_protocol.errors`): `{"error", "code", "details"}`;
  `error_response` builds one, `json_errors` turns aiohttp's own refusals (unknown path,
  wrong method, body too large) into it.
- Readiness (`/readyz`, open like `/healthz`): `{"ready": bool, "checks": {name: {"ok": bool,
  "detail": str}}}` with 200 when every check passes, else 503; each failed check's detail
  names what is missing. `/healthz` stays liveness: the process answers, nothing more.
- Metrics (`/metrics`, bearer token): the process's registry in Prometheus text format.
- The guard (`bearer_guard`): every path but `OPEN_PATHS` needs a token the ring accepts (a
  service whose guard does more, e.g. counts answers per route, checks `OPEN_PATHS` itself).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from refit_protocol.errors import ErrorBody
from refit_protocol.kit.auth import ring_accepts_bearer
from refit_protocol.kit.tokens import TokenRing

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: What every service answers without a token: liveness and readiness (the kubelet's probes).
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
#: What a bearer-token refusal says on every plane.
UNAUTHORIZED_MESSAGE = "missing or invalid bearer token"
WWW_AUTHENTICATE = {"WWW-Authenticate": 'Bearer realm="kuberefit"'}


def error_response(
    status: int,
    message: str,
    code: str | None = None,
    *,
    headers: dict[str, str] | None = None,
    **details: Any,
) -> web.Response:
    """An error answer with the one body schema (`ErrorBody`)."""
    body = ErrorBody.of(status, message, code, **details)
    return web.json_response(body.to_json(), status=status, headers=headers)


def unauthorized() -> web.Response:
    return error_response(401, UNAUTHORIZED_MESSAGE, headers=WWW_AUTHENTICATE)


def bearer_guard(ring: TokenRing) -> Middleware:
    """A middleware: a path outside `OPEN_PATHS` without a token the ring accepts gets 401."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS and not ring_accepts_bearer(
            ring, request.headers.get("Authorization", "")
        ):
            return unauthorized()
        return await handler(request)

    return guard


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own refusals (404 unknown path, 405 wrong method, 413 body too large) as
    `ErrorBody` JSON instead of its plain-text pages."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        reason = exc.text or exc.reason
        if reason.startswith(f"{exc.status}: "):
            reason = reason[len(f"{exc.status}: ") :]
        headers = {k: v for k, v in exc.headers.items() if k.lower() != "content-type"}
        return error_response(exc.status, reason, headers=headers or None, path=request.path)


class ReadinessCheck(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    ok: bool
    detail: str = ""


class Readiness(BaseModel):
    """The body of `/readyz`: ready only when every check is ok."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ready: bool
    checks: dict[str, ReadinessCheck] = Field(default_factory=dict)

    @classmethod
    def of(cls, checks: Iterable[tuple[str, bool, str]]) -> Readiness:
        found = {name: ReadinessCheck(ok=ok, detail=detail) for name, ok, detail in checks}
        return cls(ready=all(c.ok for c in found.values()), checks=found)

    def missing(self) -> list[str]:
        """`name: detail` of every failed check."""
        return [f"{name}: {c.detail}" for name, c in self.checks.items() if not c.ok]


def readiness_response(readiness: Readiness) -> web.Response:
    return web.json_response(readiness.model_dump(), status=200 if readiness.ready else 503)


def metrics_response(registry: CollectorRegistry) -> web.Response:
    return web.Response(
        body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


def add_probe_routes(
    app: web.Application,
    readiness: Callable[[], Awaitable[Readiness]],
    registry: CollectorRegistry,
    *,
    alive: Mapping[str, Any] | None = None,
) -> None:
    """`/healthz` (liveness only: the event loop answers, with `{"ok": true}` and `alive`),
    `/readyz` (`readiness()`'s answer: a `ReadinessProbe` where checks cost anything) and
    `/metrics` (`registry`), the same on every service. Who may call which is the guard's
    business (`OPEN_PATHS`)."""
    body = {"ok": True, **(alive or {})}

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response(body)

    async def readyz(_: web.Request) -> web.Response:
        return readiness_response(await readiness())

    async def metrics(_: web.Request) -> web.Response:
        return metrics_response(registry)

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)


Check = tuple[str, bool, str]


class ReadinessProbe:
    """`/readyz` behind an open door: one check at a time, its answer reused for `ttl_s`, and
    a deadline, so callers without a token cannot make a service hammer its dependencies or
    tie up the threads its real work runs on. Blocking checks run on this probe's own thread
    (`blocking=True`); async ones on the event loop. `clock` times the answer's reuse (the
    deadline runs on the event loop's own clock)."""

    def __init__(
        self,
        checks: Callable[[], Iterable[Check]] | Callable[[], Awaitable[Iterable[Check]]],
        *,
        timeout_s: float,
        ttl_s: float = 1.0,
        blocking: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._checks, self.timeout_s, self.ttl_s = checks, timeout_s, ttl_s
        self._clock = clock
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="readyz") if blocking else None
        self._running: asyncio.Future[Iterable[Check]] | None = None
        self._last: tuple[float, Readiness] | None = None

    async def __call__(self) -> Readiness:
        if self._last is not None and self._clock() - self._last[0] < self.ttl_s:
            return self._last[1]
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._run())
        try:
            found = await asyncio.wait_for(asyncio.shield(self._running), self.timeout_s)
        except TimeoutError:
            found = [("readiness", False, f"the checks took over {self.timeout_s:g}s")]
        answer = Readiness.of(found)
        self._last = (self._clock(), answer)
        return answer

    async def _run(self) -> Iterable[Check]:
        if self._executor is not None:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, self._checks)  # type: ignore[arg-type]
        found: Iterable[Check] = await self._checks()  # type: ignore[misc]
        return found

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
