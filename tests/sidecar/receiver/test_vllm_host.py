"""The receiver of another host of a multi-host vLLM server (`appliers.vllm_host`): its settings
are checked when loaded, `/readyz` names the leader's receiver when it does not answer, and a
worker waits for its own host's payload file only as long as it was told (issue 31). The whole
path, with two hosts and real vLLM ranks, is `tests/e2e/test_multi_host_server.py`."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pydantic import SecretStr, ValidationError

from refit_sidecar.receiver.config import ApplierConfig, ReceiverConfig
from refit_sidecar.receiver.node import ReceiverNode
from refit_sidecar.vllm.worker_extension import PayloadNotStagedError, _staged
from tests.harness.procs import free_port
from tests.sidecar.receiver.models import NODE_TOKEN

pytestmark = pytest.mark.timeout(120)


def test_settings_that_cannot_work_are_refused_with_the_fix() -> None:
    with pytest.raises(ValidationError, match="vllm_host needs leader_url"):
        ApplierConfig(kind="vllm_host")
    with pytest.raises(ValidationError, match=r"stage_wait_s \(30\) must be less"):
        ApplierConfig(kind="vllm", stage_wait_s=30, rpc_timeout_s=30)
    ok = ApplierConfig(kind="vllm_host", leader_url="http://leader:8470", stage_wait_s=5)
    assert ok.stage_wait_s == 5


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
