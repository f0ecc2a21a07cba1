"""The receiver's `/readyz` means ready (issue 19): with vLLM down it answers 503 and names the
server and why, while `/healthz` (liveness) stays 200; against a server without the refit
extension it says which vLLM option is missing; the control path's `/status` reports what the
engine runs. And every refusal carries the one error body (`ErrorBody`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from pydantic import SecretStr

from refit_operator.receiver_client import ReceiverHttpClient, ReceiverHttpError
from refit_protocol.errors import ErrorBody
from refit_protocol.kit.service_http import Readiness
from refit_protocol.pod_contract import VLLM_MIDDLEWARE, VLLM_WORKER_EXTENSION
from refit_protocol.receiver_api import FlushRequest
from refit_sidecar.receiver.appliers.vllm_http import VllmHttpApplier
from refit_sidecar.receiver.config import ApplierConfig, ReceiverConfig
from refit_sidecar.receiver.node import ReceiverNode
from refit_sidecar.vllm.control_path import PREFIX, RefitControlMiddleware
from refit_sidecar.vllm.worker_extension import RefitWorkerExtension
from tests.harness.procs import free_port
from tests.harness.web import serve_app
from tests.sidecar.receiver.models import NODE_TOKEN

pytestmark = pytest.mark.timeout(120)


async def get_json(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as resp:
        return resp.status, await resp.json()


async def test_readyz_names_vllm_when_it_is_down(
    tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    vllm = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = ReceiverConfig(
        node="n0",
        port=0,
        token=SecretStr(NODE_TOKEN),
        held_version=0,
        applier={"kind": "vllm", "vllm_url": vllm, "shm_dir": str(tmp_path / "shm")},
    )
    node = ReceiverNode(cfg)  # starts although vLLM is down: it may come up later
    await node.start()
    try:
        base = f"http://127.0.0.1:{node.port}"
        status, body = await get_json(session, base + "/readyz")  # no token: a probe
        alive, health = await get_json(session, base + "/healthz")
    finally:
        await node.close()
    assert status == 503, body
    ready = Readiness.model_validate(body)
    assert not ready.ready
    assert ready.checks["vllm"].ok is False
    assert ready.checks["vllm"].detail == f"vLLM at {vllm} unreachable: connection refused"
    assert ready.checks["refit_extension"].ok is False
    assert (alive, health) == (200, {"ok": True, "node": "n0"})  # liveness claims no more


async def test_readyz_of_an_in_process_node(
    node: ReceiverNode, session: aiohttp.ClientSession
) -> None:
    status, body = await get_json(session, f"http://127.0.0.1:{node.port}/readyz")
    assert status == 200, body
    assert body["ready"] is True
    assert body["checks"]["applier"]["ok"] is True


class VllmStatusFake:
    """Fault injection: a vLLM server's answer to POST .../status, set per case (`answer`):
    servers started without the refit middleware or worker extension, with another token,
    whose engine died, or whose vLLM lacks an API the bundle needs (states a real server of the
    tested version reaches only misconfigured or crashed), and, for
    contrast, two servers the receiver takes as ready. `tests/test_operator_e2e.py` checks the
    ready answer of a real vLLM server."""

    def __init__(self) -> None:
        self.answer: tuple[int, dict[str, Any]] = (404, {"detail": "Not Found"})
        self.url = ""

    def app(self) -> web.Application:
        async def status(_: web.Request) -> web.Response:
            code, body = self.answer
            return web.json_response(body, status=code)

        app = web.Application()
        app.router.add_post(f"{PREFIX}/status", status)
        return app


@pytest.fixture
async def vllm_status() -> AsyncIterator[VllmStatusFake]:
    fake = VllmStatusFake()
    runner, fake.url = await serve_app(fake.app())
    yield fake
    await runner.cleanup()


@pytest.mark.parametrize(
    ("answer", "ready", "says"),
    [
        ((404, {"detail": "Not Found"}), False, f"--middleware {VLLM_MIDDLEWARE}"),
        (  # a vLLM whose engine lacks an API the bundle needs (api_check): NotReady, why
            (
                200,
                {
                    "engine_healthy": True,
                    "worker_extension": VLLM_WORKER_EXTENSION,
                    "refit_extension": True,
                    "refit_unavailable": "vLLM 0.9.0 lacks AsyncLLM.pause_generation(): refit off",
                },
            ),
            False,
            "lacks AsyncLLM.pause_generation(): refit off",
        ),
        ((401, {"error": "missing or invalid bearer token"}), False, "refused this receiver's"),
        (
            (200, {"engine_healthy": True, "worker_extension": "", "refit_extension": False}),
            False,
            f"--worker-extension-cls {VLLM_WORKER_EXTENSION}",
        ),
        (
            (
                200,
                {
                    "engine_healthy": False,
                    "engine_error": "EngineDeadError: gone",
                    "worker_extension": VLLM_WORKER_EXTENSION,
                    "refit_extension": True,
                },
            ),
            False,
            "engine failed: EngineDeadError: gone",
        ),
        (
            (
                200,
                {
                    "engine_healthy": True,
                    "worker_extension": VLLM_WORKER_EXTENSION,
                    "refit_extension": True,
                },
            ),
            True,
            "loaded",
        ),
        (
            (
                200,
                {
                    "engine_healthy": True,
                    "worker_extension": "team.ext.Combined",
                    "refit_extension": None,  # the server cannot import it to tell
                },
            ),
            True,
            "the server cannot import it to check",
        ),
    ],
)
async def test_readiness_says_what_vllm_lacks(
    vllm_status: VllmStatusFake,
    tmp_path: Path,
    answer: tuple[int, dict[str, Any]],
    ready: bool,
    says: str,
) -> None:
    vllm_status.answer = answer
    applier = VllmHttpApplier(
        ApplierConfig(kind="vllm", vllm_url=vllm_status.url, shm_dir=tmp_path / "shm")
    )
    try:
        checks = await asyncio.to_thread(applier.readiness_checks)
    finally:
        applier.close()
    result = Readiness.of(checks)
    assert result.ready is ready, result
    assert any(says in c.detail for c in result.checks.values()), result
    assert all(vllm_status.url in c.detail for c in result.checks.values() if not c.ok), result


def _asgi_status(mw: RefitControlMiddleware, app: Any) -> tuple[int, dict[str, Any]]:
    scope = {
        "type": "http",
        "path": f"{PREFIX}/status",
        "method": "POST",
        "headers": [(b"authorization", f"Bearer {NODE_TOKEN}".encode())],
        "client": ("127.0.0.1", 40000),
        "query_string": b"",
        "app": app,
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(mw(scope, receive, send))
    return sent[0]["status"], json.loads(sent[1]["body"])


class CombinedExtension(RefitWorkerExtension):
    """A user's worker extension combined with ours (vLLM takes one class)."""

    def my_method(self) -> None: ...


class EngineClientFake:
    """Fault injection: the engine client the control path's status reads, with a chosen worker
    extension setting (missing, foreign, not importable here) and, for one case, an engine core
    that died (a real one dies only by crashing)."""

    def __init__(self, extension: str, dead: bool = False) -> None:
        self.dead = dead
        self.vllm_config = SimpleNamespace(
            parallel_config=SimpleNamespace(worker_extension_cls=extension)
        )

    async def check_health(self) -> None:
        if self.dead:
            raise RuntimeError("engine core died")


@pytest.mark.parametrize(
    ("engine", "healthy", "refit"),
    [
        (EngineClientFake(VLLM_WORKER_EXTENSION), True, True),
        (EngineClientFake(""), True, False),
        (EngineClientFake("collections.OrderedDict"), True, False),  # imports, no refit methods
        (EngineClientFake(f"{__name__}.CombinedExtension"), True, True),  # a user's, with ours
        (EngineClientFake("other.module.Ext"), True, None),  # cannot import it here: cannot tell
        (EngineClientFake(VLLM_WORKER_EXTENSION, dead=True), False, True),
    ],
)
def test_control_path_status(engine: EngineClientFake, healthy: bool, refit: bool | None) -> None:
    async def never(*_: Any) -> None:
        raise AssertionError("the status must not reach vLLM's routes")

    mw = RefitControlMiddleware(never, token=NODE_TOKEN)
    app = SimpleNamespace(state=SimpleNamespace(engine_client=engine))
    status, body = _asgi_status(mw, app)
    assert status == 200, body
    assert body["engine_healthy"] is healthy
    assert body["refit_extension"] is refit
    assert body["worker_extension"] == engine.vllm_config.parallel_config.worker_extension_cls
    if not healthy:
        assert "engine core died" in body["engine_error"]


async def test_refusals_carry_the_error_body(
    node: ReceiverNode, session: aiohttp.ClientSession
) -> None:
    base = f"http://127.0.0.1:{node.port}"
    auth = {"Authorization": f"Bearer {NODE_TOKEN}"}
    async with session.get(base + "/v1/status") as resp:
        assert resp.status == 401
        body = ErrorBody.model_validate(await resp.json())
        assert (body.code, body.error) == ("unauthorized", "missing or invalid bearer token")
    async with session.get(base + "/v1/nothing-here", headers=auth) as resp:
        assert resp.status == 404
        assert ErrorBody.model_validate(await resp.json()).code == "not_found"
    async with session.get(base + "/v1/prepare", headers=auth) as resp:
        assert resp.status == 405
        assert ErrorBody.model_validate(await resp.json()).code == "method_not_allowed"
    async with session.post(base + "/v1/flush", data=b"{}", headers=auth) as resp:
        assert resp.status == 400
        body = ErrorBody.model_validate(await resp.json())
        assert body.code == "bad_request"
        assert {e["loc"][0] for e in body.details["errors"]} == {"attempt", "expected"}
    client = ReceiverHttpClient("n0", base, token=NODE_TOKEN, session=session)
    with pytest.raises(ReceiverHttpError) as caught:
        await client.flush(FlushRequest(attempt="never-prepared", expected={0: 1}))
    assert caught.value.status == 409
    assert caught.value.reason == "unknown_attempt"
    assert "never-prepared was not prepared" in str(caught.value)


def test_clients_read_older_and_foreign_error_bodies() -> None:
    old = ErrorBody.parse(b'{"error": "attempt a is obsolete", "status": "obsolete"}', 409)
    assert (old.error, old.code) == ("attempt a is obsolete", "obsolete")
    page = ErrorBody.parse(b"<html>502 Bad Gateway</html>", 502)
    assert page.error == "<html>502 Bad Gateway</html>"
    assert page.code == "error"
    assert ErrorBody.parse(b"", 503).code == "unavailable"
