"""The coordinator process's HTTP surface and start-up checks (issue 19): it refuses to start
when the committed version's checkpoint is missing, its `/readyz` names that checkpoint when it
disappears later, `/metrics` needs the token and counts transitions by outcome, attempt and
stage; refusals carry the one error body."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import generate_latest
from pydantic import SecretStr
from safetensors.torch import save_file

from refit_operator.coordinator_service import CoordinatorServiceConfig, serve
from refit_operator.metrics import CoordinatorMetrics
from refit_operator.ports import TransitionProgress
from refit_operator.transition_types import TransitionResult
from refit_protocol.errors import ErrorBody
from refit_protocol.kit.cli import startup_error_message
from refit_protocol.kit.metrics import parse_exposition, registry_problems
from refit_protocol.kit.service_http import Readiness
from tests.harness.procs import free_port
from tests.harness.readyz import readyz_becomes
from tests.sidecar.receiver.models import canonical

TOKEN = "coordinator-token"


def config(tmp_path: Path, **fields: object) -> CoordinatorServiceConfig:
    values: dict[str, object] = {
        "policy": "p",
        "store_path": tmp_path / "store.sqlite",
        "producers": [f"http://127.0.0.1:{free_port()}"],  # nobody: it waits for a candidate
        "nodes": [],
        "token": SecretStr(TOKEN),
        "checkpoint_template": str(tmp_path / "ckpt" / "v{version}"),
        "metrics_port": free_port(),
    }
    return CoordinatorServiceConfig.model_validate(values | fields)


def write_v0(tmp_path: Path) -> Path:
    v0 = tmp_path / "ckpt" / "v0"
    v0.mkdir(parents=True)
    save_file(canonical(0, tensors=2, numel=8), str(v0 / "model.safetensors"))
    return v0


async def test_a_missing_initial_checkpoint_refuses_the_start(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    with pytest.raises(ValueError, match="checkpoint") as caught:
        await serve(cfg)
    v0 = tmp_path / "ckpt" / "v0"
    assert startup_error_message(caught.value) == (
        "the checkpoint of committed version 0 (checkpoint_template) is missing: "
        f"{v0} does not exist"
    )
    v0.mkdir(parents=True)
    with pytest.raises(ValueError, match=r"holds no \*\.safetensors files"):
        await serve(cfg)
    # Nothing listened meanwhile: the port is still free.
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", cfg.metrics_port or 0))


async def test_readyz_names_a_checkpoint_that_disappeared(
    tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    v0 = write_v0(tmp_path)
    cfg = config(tmp_path)
    base = f"http://127.0.0.1:{cfg.metrics_port}"
    task = asyncio.ensure_future(serve(cfg))
    try:
        ready = await wait_ready(session, base, task)
        assert ready.checks["commit_store"].ok
        assert "version 0 committed" in ready.checks["commit_store"].detail
        assert ready.checks["coordinator"].ok
        shutil.rmtree(v0)  # e.g. the checkpoint volume was unmounted
        ready = await readyz_becomes(session, base, 503)
        async with session.get(base + "/healthz") as resp:
            assert resp.status == 200
        async with session.get(base + "/metrics") as resp:
            assert resp.status == 401
            assert ErrorBody.model_validate(await resp.json()).code == "unauthorized"
        async with session.get(base + "/nothing", headers=auth()) as resp:
            assert resp.status == 404
            assert ErrorBody.model_validate(await resp.json()).code == "not_found"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert not ready.ready
    assert ready.checks["checkpoint"].ok is False
    assert str(v0) in ready.checks["checkpoint"].detail
    assert "committed version 0" in ready.checks["checkpoint"].detail


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


async def wait_ready(
    session: aiohttp.ClientSession, base: str, task: asyncio.Future[int]
) -> Readiness:
    for _ in range(200):
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(base + "/readyz") as resp:
                body = Readiness.model_validate(await resp.json())
                if body.ready:
                    assert resp.status == 200
                    return body
                assert resp.status == 503
        assert not task.done(), task.result()
        await asyncio.sleep(0.05)
    raise AssertionError("the coordinator never became ready")


async def test_no_http_server_unless_asked_and_none_beyond_loopback_without_a_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert CoordinatorServiceConfig.model_fields["metrics_port"].default is None
    write_v0(tmp_path)
    monkeypatch.delenv("KUBEREFIT_TOKEN", raising=False)
    monkeypatch.delenv("KUBEREFIT_TOKEN_FILE", raising=False)
    cfg = config(tmp_path, token=None, metrics_host="0.0.0.0")
    with pytest.raises(ValueError, match="refusing to listen"):
        await serve(cfg)


def test_metrics_record_a_transition() -> None:
    m = CoordinatorMetrics()
    assert registry_problems(m.registry, component="coordinator") == []
    progress = TransitionProgress(
        "p", 4, 5, wire_bytes=1000, changed_elements=5, total_elements=100
    )
    progress.timings.update(construct_s=0.5, transport_s=0.25, apply_s=1.5, finalization_s=0.1)
    m.record(
        TransitionResult(
            "committed", 5, 2, modes=["mixed", "overwrite"], progress=progress, latency_s=3.0
        )
    )
    m.record(TransitionResult("rejected", 5, 1, modes=["mixed"]))
    families = parse_exposition(generate_latest(m.registry).decode())

    def value(name: str, **labels: str) -> float:
        return next(
            v
            for f in families.values()
            for s, lab, v in zip(f.samples, f.labels, f.values, strict=True)
            if s == name and labels.items() <= lab.items()
        )

    assert value("kuberefit_coordinator_transitions_total", outcome="committed") == 1
    assert value("kuberefit_coordinator_transitions_total", outcome="rejected") == 1
    assert value("kuberefit_coordinator_transitions_total", outcome="aborted") == 0
    assert value("kuberefit_coordinator_attempts_total", mode="mixed", outcome="failed") == 1
    assert value("kuberefit_coordinator_attempts_total", mode="overwrite", outcome="committed") == 1
    assert value("kuberefit_coordinator_attempts_total", mode="mixed", outcome="rejected") == 1
    assert value("kuberefit_coordinator_committed_version") == 5
    assert value("kuberefit_coordinator_last_commit_timestamp_seconds") > 0
    assert value("kuberefit_coordinator_wire_bytes_total") == 1000
    assert value("kuberefit_coordinator_changed_fraction") == 0.05
    assert value("kuberefit_coordinator_transition_latency_seconds_sum") == 3.0
    for stage, seconds in (("construct", 0.5), ("transport", 0.25), ("apply", 1.5)):
        name = "kuberefit_coordinator_transition_stage_seconds_sum"
        assert value(name, stage=stage) == seconds
    name = "kuberefit_coordinator_transition_stage_seconds_sum"
    assert value(name, stage="finalize") == 0.1
