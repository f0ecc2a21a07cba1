"""The receiver's HTTP control plane (aiohttp): one app per node, bearer-token authenticated.

Every body is one of the pydantic models of `refit_protocol.receiver_api`; a malformed body is
a 400 that changes nothing. Calls that may block (prepare joins a replaced attempt's apply, flush
waits for the queue, prewarm runs the loader) run on a dedicated thread pool so the event loop keeps
serving manifests and status. `/healthz` (liveness: the process answers) and `/readyz`
(readiness: the serving runtime answers and runs the refit extension, the relay node is bound;
`refit_protocol.kit.service_http`) are open: probes carry no token and learn nothing secret.
`/metrics` requires the token like everything else (Prometheus scrape configs send it with
`authorization: {credentials_file: ...}`). Every refusal carries the error body of every plane
(`refit_protocol.errors.ErrorBody`: `{"error", "code", "details"}`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import structlog
from aiohttp import web
from pydantic import BaseModel, ValidationError

from refit_protocol.errors import INTERNAL
from refit_protocol.kit.auth import ring_accepts_bearer
from refit_protocol.kit.http_log import request_logger
from refit_protocol.kit.service_http import (
    OPEN_PATHS,
    Handler,
    ReadinessProbe,
    add_probe_routes,
    error_response,
    json_errors,
    unauthorized,
)
from refit_protocol.kit.tokens import TokenRing, as_ring
from refit_protocol.receiver_api import (
    API_PREFIX,
    AttemptRequest,
    AuditRequest,
    CommitNotice,
    FlushRequest,
    GateRequest,
    PrepareRequest,
    PrewarmRequest,
    RelayFlushRequest,
    RestoreRequest,
)
from refit_sidecar import transport
from refit_sidecar.receiver.core import ReceiverCore
from refit_sidecar.receiver.errors import ReceiverError
from refit_sidecar.transport.plugin import TransportPlugin

log = structlog.get_logger("kuberefit.receiver.http")
M = TypeVar("M", bound=BaseModel)

CORE: web.AppKey[ReceiverCore] = web.AppKey("core", ReceiverCore)
POOL: web.AppKey[ThreadPoolExecutor] = web.AppKey("pool", ThreadPoolExecutor)

#: The routes only a coordinator calls: the time since the last one measures operator absence
#: (not /metrics, audits or payload offers, which others send).
COORDINATOR_ROUTES = frozenset(
    f"{API_PREFIX}/{name}"
    for name in (
        "status", "prewarm", "prepare", "gate", "open-apply", "relay-flush", "flush", "stop",
        "cleanup", "restore", "commit",
    )
)  # fmt: skip
#: How long /readyz waits for the serving runtime's answer.
READY_TIMEOUT_S = 2.0


def _model(obj: BaseModel, status: int = 200) -> web.Response:
    return web.Response(
        body=obj.model_dump_json().encode(), status=status, content_type="application/json"
    )


def _first_error(what: str, errors: list[Any]) -> str:
    """One line naming the first invalid field and why (e.g. a prewarm meta's dtype)."""
    if not errors:
        return what
    first = errors[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{what}: {where + ': ' if where else ''}{first.get('msg', '')}{more}"


async def _parse(request: web.Request, model: type[M]) -> M:
    raw = await request.read()
    return model.model_validate_json(raw or b"{}")


def _not_configured(node: str, plugin: TransportPlugin[Any, Any]) -> Handler:
    """The answer of a node that does not run `plugin`'s inbound to what only it serves."""
    message = (
        f"node {node} does not receive over {plugin.kind} ({plugin.title}): its receiver "
        f"settings have no `{plugin.receiver_field}` section"
    )

    async def refuse(_: web.Request) -> web.Response:
        return error_response(422, message, "transport_not_configured")

    return refuse


def create_app(
    core: ReceiverCore, *, token: str | TokenRing | None, control_threads: int = 16
) -> web.Application:
    """The node's aiohttp application (the caller runs and cleans it up)."""
    ring = as_ring(token)

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = (
            request.match_info.route.resource.canonical
            if request.match_info.route.resource
            else "other"
        )
        status = 500
        try:
            if request.path not in OPEN_PATHS and not ring_accepts_bearer(
                ring, request.headers.get("Authorization", "")
            ):
                status = 401
                return unauthorized()
            if path not in COORDINATOR_ROUTES:
                resp = await handler(request)
            else:  # operator absence is measured from these (`absence`)
                core.control.contact.begin()
                try:
                    resp = await handler(request)
                finally:
                    core.control.contact.end()
            status = resp.status
            return resp
        except ValidationError as exc:
            status = 400
            errors = exc.errors(include_url=False, include_input=False, include_context=False)
            return error_response(
                400,
                _first_error("invalid request body", errors),
                errors=json.loads(json.dumps(errors, default=str)),
            )
        except ReceiverError as exc:
            status = exc.http_status
            return error_response(exc.http_status, str(exc), exc.code)
        except web.HTTPException as exc:
            status = exc.status
            raise
        except Exception as exc:
            log.exception("receiver.http_error", node=core.node, path=request.path)
            return error_response(500, f"internal error: {type(exc).__name__}", INTERNAL)
        finally:
            core.metrics.http.labels(path, str(status)).inc()

    app = web.Application(
        middlewares=[request_logger("receiver"), json_errors, guard],
        client_max_size=core.config.max_control_body_bytes,
    )
    app[CORE] = core
    app[POOL] = ThreadPoolExecutor(control_threads, thread_name_prefix="refit-control")

    async def blocking(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(app[POOL], fn, *args)

    async def status(_: web.Request) -> web.Response:
        return _model(core.control.status())

    async def progress(_: web.Request) -> web.Response:
        return _model(core.control.progress())

    async def prewarm(request: web.Request) -> web.Response:
        return _model(await blocking(core.control.prewarm, await _parse(request, PrewarmRequest)))

    async def prewarmed(_: web.Request) -> web.Response:
        answer = core.control.prewarmed()
        if answer is None:
            return error_response(404, "not prewarmed", "not_prewarmed")
        return _model(answer)

    async def prepare(request: web.Request) -> web.Response:
        return _model(await blocking(core.control.prepare, await _parse(request, PrepareRequest)))

    async def gate(request: web.Request) -> web.Response:
        return _model(await blocking(core.control.gate, await _parse(request, GateRequest)))

    async def open_apply(request: web.Request) -> web.Response:
        req = await _parse(request, AttemptRequest)
        return _model(await blocking(core.control.open_apply, req.attempt))

    async def relay_flush(request: web.Request) -> web.Response:
        return _model(
            await blocking(core.control.relay_flush, await _parse(request, RelayFlushRequest))
        )

    async def flush(request: web.Request) -> web.Response:
        return _model(await blocking(core.control.flush, await _parse(request, FlushRequest)))

    async def stop(request: web.Request) -> web.Response:
        req = await _parse(request, AttemptRequest)
        return _model(await blocking(core.control.stop, req.attempt))

    async def cleanup(request: web.Request) -> web.Response:
        req = await _parse(request, AttemptRequest)
        return _model(await blocking(core.control.cleanup, req.attempt))

    async def audit(request: web.Request) -> web.Response:
        return _model(await blocking(core.control.audit, await _parse(request, AuditRequest)))

    async def restore(request: web.Request) -> web.Response:
        return _model(await blocking(core.control.restore, await _parse(request, RestoreRequest)))

    async def commit(request: web.Request) -> web.Response:
        return _model(await blocking(core.control.commit, await _parse(request, CommitNotice)))

    p = API_PREFIX
    # /healthz is liveness only: this process serves requests (not that the runtime does).
    probe = ReadinessProbe(core.readiness, timeout_s=READY_TIMEOUT_S + 1.0, blocking=True)
    add_probe_routes(app, probe, core.metrics.registry, alive={"node": core.node})
    app.router.add_get(f"{p}/status", status)
    app.router.add_get(f"{p}/progress", progress)
    app.router.add_post(f"{p}/prewarm", prewarm)
    app.router.add_get(f"{p}/prewarm", prewarmed)
    app.router.add_post(f"{p}/prepare", prepare)
    app.router.add_post(f"{p}/gate", gate)
    app.router.add_post(f"{p}/open-apply", open_apply)
    app.router.add_post(f"{p}/relay-flush", relay_flush)
    app.router.add_post(f"{p}/flush", flush)
    app.router.add_post(f"{p}/stop", stop)
    app.router.add_post(f"{p}/cleanup", cleanup)
    app.router.add_post(f"{p}/commit", commit)
    app.router.add_post(f"{p}/restore", restore)
    app.router.add_post(f"{p}/audit", audit)
    for inbound in core.inbounds:  # e.g. the S3 inbound's manifest and stream-end routes
        app.router.add_routes(inbound.routes())
    served = {inbound.kind for inbound in core.inbounds}
    for plugin in transport.plugins():
        if plugin.kind not in served:
            for path in plugin.http_paths:
                app.router.add_post(path, _not_configured(core.node, plugin))
    core.metrics.preset_routes(
        sorted({str(r.resource.canonical) for r in app.router.routes() if r.resource} - OPEN_PATHS)
    )

    async def shutdown(app: web.Application) -> None:
        app[POOL].shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(shutdown)
    return app
