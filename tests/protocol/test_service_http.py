"""What every HTTP plane shares: `/readyz` runs one check at a time on its own thread and
reuses the answer briefly (callers without a token cannot hammer the dependencies or tie up
the service's threads), with a deadline; aiohttp's own refusals keep their headers; the probe
routes and the bearer guard are one skeleton."""

from __future__ import annotations

import asyncio
import threading

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry, Counter

from refit_protocol.kit.auth import http_bearer
from refit_protocol.kit.service_http import (
    Readiness,
    ReadinessProbe,
    add_probe_routes,
    bearer_guard,
    json_errors,
)
from refit_protocol.kit.tokens import TokenRing


class _TtlClock:
    """The probe's answer-reuse clock, advanced by the test; its deadline stays real time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def ttl_clock() -> _TtlClock:
    return _TtlClock()


async def test_one_check_at_a_time_on_its_own_thread_with_a_deadline(ttl_clock: _TtlClock) -> None:
    calls: list[str] = []
    release = threading.Event()

    def slow_checks() -> list[tuple[str, bool, str]]:
        calls.append(threading.current_thread().name)
        release.wait(30)
        return [("vllm", True, "answers")]

    probe = ReadinessProbe(slow_checks, timeout_s=0.2, ttl_s=0.5, blocking=True, clock=ttl_clock)
    try:
        answers = await asyncio.gather(*(probe() for _ in range(20)))
        assert all(not a.ready for a in answers)  # past the deadline: not ready, says why
        assert "took over 0.2s" in answers[0].missing()[0]
        assert len(calls) == 1  # one check for twenty callers
        assert calls[0].startswith("readyz")  # on its own thread
        assert not (await probe()).ready  # the "not ready" is reused within the TTL
        assert len(calls) == 1
    finally:
        release.set()
        probe.close()


async def test_an_answer_is_reused_for_its_ttl(ttl_clock: _TtlClock) -> None:
    calls: list[str] = []

    def checks() -> list[tuple[str, bool, str]]:
        calls.append(threading.current_thread().name)
        return [("vllm", True, "answers")]

    probe = ReadinessProbe(checks, timeout_s=60, ttl_s=0.5, blocking=True, clock=ttl_clock)
    try:
        assert (await probe()).ready
        assert len(calls) == 1
        for _ in range(5):  # within the TTL: the same answer, no new check
            ttl_clock.now += 0.09
            assert (await probe()).ready
        assert len(calls) == 1
        ttl_clock.now += 0.06  # 0.51 s after the check: a fresh one
        assert (await probe()).ready
        assert len(calls) == 2
    finally:
        probe.close()


async def test_a_refusal_keeps_its_headers() -> None:
    async def handler(_: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application(middlewares=[json_errors])
    app.router.add_get("/only-get", handler)
    async with TestClient(TestServer(app)) as client:
        resp = await client.post("/only-get")
        assert resp.status == 405
        assert resp.headers["Allow"] == "GET,HEAD" or "GET" in resp.headers["Allow"]
        assert (await resp.json())["code"]


async def test_the_probe_routes_behind_the_bearer_guard() -> None:
    """The skeleton every service shares: liveness and readiness open (the kubelet has no
    token), metrics and everything else behind a token the ring accepts, in either form."""
    registry = CollectorRegistry()
    Counter("kuberefit_test_total", "A counter.", registry=registry).inc()
    ready = [False]

    async def readiness() -> Readiness:
        return Readiness.of([("dependency", ready[0], "answers" if ready[0] else "missing")])

    async def other(_: web.Request) -> web.Response:
        return web.json_response({"other": True})

    token = "t" * 32
    app = web.Application(middlewares=[json_errors, bearer_guard(TokenRing(token))])
    add_probe_routes(app, readiness, registry, alive={"node": "n0"})
    app.router.add_get("/v1/other", other)
    async with TestClient(TestServer(app)) as client:
        assert await (await client.get("/healthz")).json() == {"ok": True, "node": "n0"}
        not_ready = await client.get("/readyz")
        assert not_ready.status == 503
        assert (await not_ready.json())["checks"]["dependency"]["detail"] == "missing"
        ready[0] = True
        assert (await client.get("/readyz")).status == 200
        for path in ("/metrics", "/v1/other"):
            refused = await client.get(path)
            assert refused.status == 401
            assert refused.headers["WWW-Authenticate"].startswith("Bearer")
            wrong = await client.get(path, headers={"Authorization": "Bearer " + "x" * 32})
            assert wrong.status == 401
        for form in (token, http_bearer(token)):
            answer = await client.get("/metrics", headers={"Authorization": f"Bearer {form}"})
            assert answer.status == 200
            assert "kuberefit_test_total 1.0" in await answer.text()
