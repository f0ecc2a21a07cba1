"""What every KubeRefit HTTP service answers the same way (aiohttp): error bodies, `/readyz`
and `/metrics`.

- Errors: `ErrorBody` (`refit_protocol.errors`): `{"error", "code", "details"}`;
  `error_response` builds one, `json_errors` turns aiohttp's own refusals (unknown path,
  wrong method, body too large) into it.
- Readiness (`/readyz`, open like `/healthz`): `{"ready": bool, "checks": {name: {"ok": bool,
  "detail": str}}}` with 200 when every check passes, else 503; each failed check's detail
  names what is missing. `/healthz` stays liveness: the process answers, nothing more.
- Metrics (`/metrics`, bearer token): the process's registry in Prometheus text format.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from refit_protocol.errors import ErrorBody

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
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
        return error_response(exc.status, reason, path=request.path)


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
