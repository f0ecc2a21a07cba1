"""The producer's HTTP control plane (aiohttp, bearer token): what the coordinator calls."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from pydantic import ValidationError

from refit_operator.ports import EndpointError
from refit_operator.producer_api import (
    PRODUCER_PREFIX,
    AttemptPlanModel,
    BaselineUpdateRequest,
    ProducerAttemptRequest,
    ProducerStatus,
    SentReportModel,
)
from refit_sidecar.producer_service import ProducerService
from refit_sidecar.transport.auth import bearer_ok

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_OK = {"ok": True}


def create_producer_app(service: ProducerService, *, token: str | None) -> web.Application:
    """Routes under /v1/producer; /healthz is open, everything else needs the token."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path != "/healthz" and not bearer_ok(
            token, request.headers.get("Authorization", "")
        ):
            return web.json_response({"error": "missing or invalid bearer token"}, status=401)
        try:
            return await handler(request)
        except ValidationError as exc:
            return web.json_response(
                {"error": f"invalid request: {exc.error_count()} errors"}, status=400
            )
        except (EndpointError, ValueError) as exc:
            return web.json_response({"error": str(exc)}, status=409)

    async def status(_: web.Request) -> web.Response:
        b = service.baseline
        body = ProducerStatus(
            producer=service.producer,
            committed_version=service.committed.version,
            committed_baseline=service.committed.baseline_id,
            candidate_version=service.candidate_version,
            pending_attempt=b.pending_attempt,
        )
        return web.json_response(body.model_dump())

    async def start(request: web.Request) -> web.Response:
        plan = AttemptPlanModel.model_validate_json(await request.read())
        await service.start(plan.plan())
        return web.json_response(_OK)

    async def wait_sent(request: web.Request) -> web.Response:
        req = ProducerAttemptRequest.model_validate_json(await request.read())
        report = await service.wait_sent(req.attempt)
        return web.json_response(SentReportModel.of(report).model_dump())

    async def stop(request: web.Request) -> web.Response:
        req = ProducerAttemptRequest.model_validate_json(await request.read())
        await service.stop_and_wait(req.attempt)
        return web.json_response(_OK)

    async def cleanup(request: web.Request) -> web.Response:
        req = ProducerAttemptRequest.model_validate_json(await request.read())
        await service.cleanup(req.attempt)
        return web.json_response(_OK)

    async def update_baseline(request: web.Request) -> web.Response:
        req = BaselineUpdateRequest.model_validate_json(await request.read())
        await service.update_baseline(req.attempt, req.record())
        return web.json_response(_OK)

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response(_OK)

    app = web.Application(middlewares=[guard])
    p = PRODUCER_PREFIX
    app.router.add_get(f"{p}/status", status)
    app.router.add_post(f"{p}/start", start)
    app.router.add_post(f"{p}/wait-sent", wait_sent)
    app.router.add_post(f"{p}/stop", stop)
    app.router.add_post(f"{p}/cleanup", cleanup)
    app.router.add_post(f"{p}/update-baseline", update_baseline)
    app.router.add_get("/healthz", healthz)
    return app
