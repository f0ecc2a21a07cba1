"""The producer's HTTP control plane (aiohttp, bearer token): what the coordinator calls, and
the candidate endpoints the trainer's publisher calls to hand over its exports.

Refusals carry the error body of every plane (`refit_protocol.errors.ErrorBody`: `{"error":
message, "code": code, "details": {...}}`); the codes of the trainer handoff are the
`refit_sidecar.trainer.errors` classes, so the publisher raises the same typed error.
`/healthz` (liveness) and `/readyz` (the inbox and reference checkpoint are there:
`producer.readiness`) are open; `/metrics` (`producer.metrics`) needs the token like the rest.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from pydantic import ValidationError

from refit_protocol.errors import CONFLICT, EndpointError
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
from refit_protocol.producer_api import (
    PRODUCER_PREFIX,
    AttemptPlan,
    BaselineManifest,
    BaselineUpdateRequest,
    CandidateAbortRequest,
    CandidateChunkRequest,
    CandidateStageRequest,
    CommittedRecordRequest,
    FixedSettings,
    ProducerAttemptRequest,
    ProducerStatus,
)
from refit_sidecar.baseline.errors import BaselineError, ExportMismatchError
from refit_sidecar.producer.service import ProducerService
from refit_sidecar.trainer.errors import CandidateMismatchError, StagingError, StagingStateError
from refit_sidecar.trainer.manifest import to_wire

#: Largest request body (a stage request carries the manifest of the whole export).
MAX_REQUEST_BYTES = 256 << 20
_OK = {"ok": True}


def create_producer_app(
    service: ProducerService, *, token: str | TokenRing | None
) -> web.Application:
    """Routes under /v1/producer; /healthz and /readyz are open, everything else needs the
    token."""
    ring = as_ring(token)
    metrics = service.metrics

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        path = resource.canonical if resource else "other"
        status = 500
        try:
            if request.path not in OPEN_PATHS and not ring_accepts_bearer(
                ring, request.headers.get("Authorization", "")
            ):
                resp: web.StreamResponse = unauthorized()
            else:
                resp = await _answer(request, handler)
            status = resp.status
            return resp
        except web.HTTPException as exc:  # aiohttp's own (404, 405, 413): `json_errors`
            status = exc.status
            raise
        finally:
            metrics.http.labels(path, str(status)).inc()

    async def status(_: web.Request) -> web.Response:
        answer = producer_status(service)
        # Only when there is one: a trainer image's older publisher refuses fields it does not
        # know (extra="forbid"), so a healthy sidecar answers as the previous release did.
        quiet = set() if answer.transport_problem else {"transport_problem"}
        return web.json_response(answer.model_dump(exclude=quiet))

    async def baseline_manifest(_: web.Request) -> web.Response:
        if not service.baseline_ready:
            raise StagingStateError(f"producer {service.producer} has no baseline yet")
        body = BaselineManifest(
            version=service.committed.version,
            tensors=to_wire(list(service.baseline.metadata.values())),
        )
        return web.json_response(body.model_dump())

    async def candidate_chunk(request: web.Request) -> web.Response:
        req = CandidateChunkRequest.model_validate_json(await request.read())
        ack = await asyncio.to_thread(service.ingest_chunk, req)
        return web.json_response(ack.model_dump())

    async def candidate_stage(request: web.Request) -> web.Response:
        req = CandidateStageRequest.model_validate_json(await request.read())
        staged = await asyncio.to_thread(service.stage, req)
        return web.json_response(staged.model_dump())

    async def candidate_abort(request: web.Request) -> web.Response:
        req = CandidateAbortRequest.model_validate_json(await request.read())
        await asyncio.to_thread(service.abort_staging, req.version)
        return web.json_response(_OK)

    async def start(request: web.Request) -> web.Response:
        plan = AttemptPlan.model_validate_json(await request.read())
        await service.start(plan)
        return web.json_response(_OK)

    async def wait_sent(request: web.Request) -> web.Response:
        req = ProducerAttemptRequest.model_validate_json(await request.read())
        report = await service.wait_sent(req.attempt)
        return web.json_response(report.model_dump())

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

    async def committed(request: web.Request) -> web.Response:
        req = CommittedRecordRequest.model_validate_json(await request.read())
        service.learn_committed(req.record())
        return web.json_response(_OK)

    # A candidate's manifest names every tensor of the export (~100 bytes each): allow large
    # models' manifests, well above aiohttp's 1 MiB default.
    app = web.Application(
        middlewares=[request_logger("producer"), json_errors, guard],
        client_max_size=MAX_REQUEST_BYTES,
    )
    p = PRODUCER_PREFIX
    app.router.add_get(f"{p}/status", status)
    app.router.add_post(f"{p}/start", start)
    app.router.add_post(f"{p}/wait-sent", wait_sent)
    app.router.add_post(f"{p}/stop", stop)
    app.router.add_post(f"{p}/cleanup", cleanup)
    app.router.add_post(f"{p}/update-baseline", update_baseline)
    app.router.add_post(f"{p}/committed", committed)
    app.router.add_get(f"{p}/baseline/manifest", baseline_manifest)
    app.router.add_post(f"{p}/candidate/chunk", candidate_chunk)
    app.router.add_post(f"{p}/candidate", candidate_stage)
    app.router.add_post(f"{p}/candidate/abort", candidate_abort)
    probe = ReadinessProbe(service.readiness, timeout_s=5.0, blocking=True)
    add_probe_routes(app, probe, metrics.registry)
    metrics.preset_routes(
        sorted({str(r.resource.canonical) for r in app.router.routes() if r.resource} - OPEN_PATHS)
    )
    return app


async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The handler's answer, with every refusal as an `ErrorBody`."""
    try:
        return await handler(request)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False, include_context=False)
        where = ".".join(str(p) for p in errors[0]["loc"]) if errors else ""
        first = f"{where + ': ' if where else ''}{errors[0]['msg']}" if errors else ""
        return error_response(
            400,
            f"invalid request: {exc.error_count()} errors; first: {first}",
            errors=json.loads(json.dumps(errors, default=str)),
        )
    except StagingError as exc:
        return _refusal(exc)
    except ExportMismatchError as exc:
        return _refusal(CandidateMismatchError(str(exc)))
    except BaselineError as exc:
        return _refusal(StagingStateError(str(exc)))
    except (EndpointError, ValueError) as exc:
        return error_response(409, str(exc), CONFLICT)


def _refusal(exc: StagingError) -> web.Response:
    return error_response(exc.http_status, str(exc), exc.code)


def producer_status(service: ProducerService) -> ProducerStatus:
    """What `GET /status` answers (also read by `trainer_exit`)."""
    b = service.baseline
    return ProducerStatus(
        producer=service.producer,
        committed_version=service.committed.version,
        committed_baseline=service.committed.baseline_id,
        candidate_version=service.candidate_version,
        pending_attempt=b.pending_attempt,
        producers=b.producers,
        export_chunk_bytes=b.chunk_bytes,
        baseline_ready=service.baseline_ready,
        baseline_fingerprint=service.baseline_fingerprint,
        settings=service.settings,
        transport_problem=service.transport_problem(),
        fixed=FixedSettings(
            chunk_bytes=b.config.export_chunk_bytes,
            baseline_storage="memory" if b.config.in_memory else "file",
        ),
    )
