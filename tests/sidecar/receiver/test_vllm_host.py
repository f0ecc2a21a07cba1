"""The receiver of another host of a multi-host vLLM server (`appliers.vllm_host`): its settings
are checked when loaded, `/readyz` names the leader's receiver when it does not answer, and a
worker waits for its own host's payload file only as long as it was told (issue 31). The whole
path, with two hosts and real vLLM ranks, is `tests/e2e/test_multi_host_server.py`."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from pydantic import SecretStr, ValidationError

from refit_protocol.kit.auth import ring_accepts_bearer
from refit_protocol.kit.tokens import as_ring
from refit_sidecar.codec.wire import PayloadHeader
from refit_sidecar.receiver.appliers.base import StagedPayload
from refit_sidecar.receiver.appliers.vllm_host import LeaderProgressError, VllmHostApplier
from refit_sidecar.receiver.config import ApplierConfig, ReceiverConfig
from refit_sidecar.receiver.node import ReceiverNode
from refit_sidecar.vllm.worker_extension import PayloadNotStagedError, _staged
from tests.harness.procs import free_port
from tests.harness.web import serve_app
from tests.sidecar.receiver.models import NODE_TOKEN

pytestmark = pytest.mark.timeout(120)


def test_settings_that_cannot_work_are_refused_with_the_fix() -> None:
    with pytest.raises(ValidationError, match="vllm_host needs leader_url"):
        ApplierConfig(kind="vllm_host")
    with pytest.raises(ValidationError, match=r"stage_wait_s \(30\) must be less"):
        ApplierConfig(kind="vllm", stage_wait_s=30, rpc_timeout_s=30)
    ok = ApplierConfig(kind="vllm_host", leader_url="http://leader:8470", stage_wait_s=5)
    assert ok.stage_wait == 5
    # A short call timeout chosen for a one-host server stays valid: the default wait follows.
    assert ApplierConfig(kind="vllm", rpc_timeout_s=30).stage_wait == 15


async def test_readyz_names_the_leader_when_it_does_not_answer(tmp_path: Path) -> None:
    leader = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = ReceiverConfig(
        node="host-b",
        port=0,
        token=SecretStr(NODE_TOKEN),
        held_version=0,
        server="big-server",
        applier={"kind": "vllm_host", "leader_url": leader, "shm_dir": str(tmp_path / "shm")},
    )
    node = ReceiverNode(cfg)
    await node.start()
    try:
        base = f"http://127.0.0.1:{node.port}"
        auth = {"Authorization": f"Bearer {NODE_TOKEN}"}
        async with aiohttp.ClientSession() as session:
            async with session.get(base + "/readyz") as resp:
                ready: dict[str, Any] = await resp.json()
                assert resp.status == 503, ready
            async with session.get(base + "/v1/status", headers=auth) as resp:
                status = await resp.json()
            async with session.get(base + "/v1/progress") as resp:
                assert resp.status == 401  # a peer's call, but authenticated like any other
    finally:
        await node.close()
    check = ready["checks"]["server_leader"]
    assert not check["ok"]
    assert leader in check["detail"], check
    assert (status["server"], status["server_role"]) == ("big-server", "host")


async def test_a_hosts_restore_reads_no_checkpoint(tmp_path: Path) -> None:
    """A host's sidecar does not mount the checkpoint (only vLLM containers read it): its
    restore, to rejoin, loads and reads nothing, and the node then holds the version."""
    cfg = ReceiverConfig(
        node="host-b",
        port=0,
        token=SecretStr(NODE_TOKEN),
        server="big-server",
        applier={
            "kind": "vllm_host",
            "leader_url": f"http://127.0.0.1:{free_port()}",
            "shm_dir": str(tmp_path / "shm"),
        },
    )
    node = ReceiverNode(cfg)
    await node.start()
    try:
        base = f"http://127.0.0.1:{node.port}/v1"
        auth = {"Authorization": f"Bearer {NODE_TOKEN}"}
        metas = [{"name": "model.embed_tokens.weight", "shape": [4, 2], "dtype": "bfloat16"}]
        body = {"version": 3, "source": "/not/in/this/pod/v3", "metas": metas}
        async with aiohttp.ClientSession() as session:
            async with session.post(base + "/restore", json=body, headers=auth) as resp:
                assert resp.status == 200, await resp.text()
            async with session.get(base + "/status", headers=auth) as resp:
                status = await resp.json()
    finally:
        await node.close()
    assert (status["held_version"], status["server_role"]) == (3, "host")


def test_a_worker_waits_for_its_hosts_payload_file_then_fails_clearly(tmp_path: Path) -> None:
    path = tmp_path / "payload.krd"
    timer = threading.Timer(0.2, path.write_bytes, args=(b"staged",))
    timer.start()
    try:
        assert _staged(path, wait_s=10) == path  # it came while the rank waited
    finally:
        timer.cancel()
    with pytest.raises(PayloadNotStagedError, match=r"not staged on host .* within 0\.3s"):
        _staged(tmp_path / "never.krd", wait_s=0.3)


class LeaderProgressFake:
    """Fault injection: a leader receiver's `GET /v1/progress`, answering from a script (the
    real leader runs in tests/e2e/test_multi_host_server.py; these are the answers it gives
    only when it fails or restarts, on demand)."""

    def __init__(self, answers: list[dict[str, Any]]) -> None:
        self.answers, self.calls = answers, 0

    async def progress(self, request: web.Request) -> web.Response:
        assert ring_accepts_bearer(as_ring(NODE_TOKEN), request.headers["Authorization"])
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        return web.json_response({"node": "host-a", **answer})


async def _host_apply(tmp_path: Path, answers: list[dict[str, Any]]) -> tuple[Path, Any, int]:
    """Stage one payload file as a host would and apply it against the scripted leader."""
    fake = LeaderProgressFake(answers)
    app = web.Application()
    app.router.add_get("/v1/progress", fake.progress)
    runner, url = await serve_app(app)
    config = ApplierConfig(
        kind="vllm_host", leader_url=url, shm_dir=tmp_path, stage_wait_s=0.5, rpc_timeout_s=1
    )
    applier = VllmHostApplier(config)
    applier.tokens = as_ring(NODE_TOKEN)
    path = tmp_path / "staged.krd"
    path.write_bytes(b"decoded payload")
    staged = StagedPayload(PayloadHeader(1, "a1", 0, 0, 0), 15, path=path)
    try:
        outcome: Any = await asyncio.to_thread(applier.apply, [staged], 0)
    except LeaderProgressError as exc:
        outcome = exc
    finally:
        applier.close()
        await runner.cleanup()
    return path, outcome, fake.calls


async def test_a_host_releases_a_payload_file_once_the_leader_applied_it(tmp_path: Path) -> None:
    applying = {"attempt": "a1", "phase": "applying", "applied": 0}
    path, outcome, calls = await _host_apply(
        tmp_path, [applying, applying, applying | {"applied": 1}]
    )
    assert outcome.payloads == 1
    assert calls == 3
    assert not path.exists()  # released: every rank has read it


@pytest.mark.parametrize(
    ("leader", "says"),
    [
        ({"attempt": "a1", "phase": "failed", "applied": 0}, "failed attempt a1"),
        ({"attempt": None, "phase": "idle", "applied": 0}, "is on attempt None, not a1"),
        ({"attempt": "a1", "phase": "applying", "applied": 0}, "when this host stopped waiting"),
    ],
)
async def test_a_host_fails_its_part_when_the_leader_will_not_apply(
    tmp_path: Path, leader: dict[str, Any], says: str
) -> None:
    """The leader failed the attempt, restarted (no attempt), or never got there in time."""
    _, outcome, _ = await _host_apply(tmp_path, [leader])
    assert isinstance(outcome, LeaderProgressError)
    assert says in str(outcome)
