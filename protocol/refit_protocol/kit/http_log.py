"""Request logging for every KubeRefit HTTP service (aiohttp middleware).

Every request is logged at debug; a refusal (4xx) at info with its reason, so a wrong token or
a bad request is visible at the default level without a line per successful call; a 5xx at
warning. Identical lines are rate-limited by `refit_protocol.kit.logs.RepeatLimiter`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_REASON_CHARS = 300


def request_logger(component: str) -> Middleware:
    """A middleware logging each request of `component`'s HTTP plane."""
    log = structlog.get_logger(f"kuberefit.{component}.http")

    @web.middleware
    async def log_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
        start = time.monotonic()
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            _emit(log, request, exc.status, exc.text or exc.reason, start)
            raise
        _emit(log, request, response.status, _reason(response), start)
        return response

    return log_requests


def _reason(response: web.StreamResponse) -> str:
    """The error text of a JSON error body (`message` or `error`), else the status reason."""
    if response.status < 400 or not isinstance(response, web.Response):
        return response.reason
    body = response.text or ""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body[:_REASON_CHARS] or response.reason
    if isinstance(parsed, dict):
        text = parsed.get("message") or parsed.get("error") or body
        return str(text)[:_REASON_CHARS]
    return body[:_REASON_CHARS]


def _emit(
    log: structlog.typing.FilteringBoundLogger,
    request: web.Request,
    status: int,
    reason: str,
    start: float,
) -> None:
    fields = {
        "method": request.method,
        "path": request.path,
        "status": status,
        "peer": request.remote,
        "elapsed_s": round(time.monotonic() - start, 4),
    }
    if status >= 500:
        log.warning("http.failed", reason=reason, **fields)
    elif status >= 400:
        log.info("http.refused", reason=reason, **fields)
    else:
        log.debug("http.request", **fields)
