"""The producer's HTTP surface (issue 19): `/readyz` names a missing inbox, a missing reference
checkpoint refuses the start with one line, `/metrics` counts what an attempt did (its payloads
over the real S3 transport to a real receiver node), and every refusal carries the one error
body (`ErrorBody`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from pydantic import SecretStr
from safetensors.torch import save_file

from refit_operator.producer_client import HttpProducerClient
from refit_protocol.commit import CommitRecord
from refit_protocol.errors import ErrorBody
from refit_protocol.kit.cli import startup_error_message
from refit_protocol.kit.metrics import parse_exposition
from refit_protocol.kit.service_http import Readiness
from refit_protocol.producer_api import AttemptPlan
from refit_sidecar.baseline.chunks import chunk_export
from refit_sidecar.producer.http import create_producer_app
from refit_sidecar.producer.main import ProducerProcessConfig, build, serve
from refit_sidecar.producer.service import ProducerService
from tests.harness.procs import free_port
from tests.harness.readyz import readyz_becomes
from tests.harness.s3_payloads import S3Delivery
from tests.harness.web import serve_app
from tests.sidecar.producer.http_app import AUTH, TOKEN
from tests.sidecar.producer.states import bump, state


def config(tmp_path: Path, reference: Path | None = None) -> ProducerProcessConfig:
    staging: dict[str, str] = {
        "inbox": str(tmp_path / "inbox"),
        "candidate_dir": str(tmp_path / "candidates"),
    }
    if reference is not None:
        staging["reference_checkpoint"] = str(reference)
    return ProducerProcessConfig(
        port=free_port(),
        token=SecretStr(TOKEN),
        baseline={"directory": str(tmp_path / "baseline")},
        staging=staging,
    )


async def test_readyz_names_a_missing_inbox(tmp_path: Path, session: aiohttp.ClientSession) -> None:
    reference = tmp_path / "v0"
    reference.mkdir()
    save_file(state(0), str(reference / "model.safetensors"))
    process = await asyncio.to_thread(build, config(tmp_path, reference))
    runner, url = await serve_app(create_producer_app(process.service, token=process.tokens))
    try:
        async with session.get(url + "/readyz") as resp:  # open: a probe has no token
            assert resp.status == 200, await resp.text()
            ready = Readiness.model_validate(await resp.json())
        assert ready.checks["inbox"].ok
        assert ready.checks["reference_checkpoint"].ok
        (tmp_path / "inbox").rmdir()  # e.g. someone removed it
        ready = await readyz_becomes(session, url, 503)
        async with session.get(url + "/healthz") as resp:
            assert resp.status == 200  # alive all the same
    finally:
        await runner.cleanup()
        process.close()
    assert not ready.ready
    assert ready.checks["inbox"].ok is False
    assert f"staging.inbox {tmp_path / 'inbox'} is missing" in ready.checks["inbox"].detail
    assert ready.missing() == [f"inbox: {ready.checks['inbox'].detail}"]


async def test_a_missing_reference_checkpoint_refuses_the_start(tmp_path: Path) -> None:
    missing = tmp_path / "ckpt" / "v0"
    with pytest.raises(ValueError, match=r"staging\.reference_checkpoint") as caught:
        await serve(config(tmp_path, missing))
    line = startup_error_message(caught.value)
    assert line == (
        f"staging.reference_checkpoint {missing} is missing (the checkpoint the rollout "
        "engines started from)"
    )
    missing.mkdir(parents=True)  # a directory without safetensors files
    with pytest.raises(ValueError, match=r"holds no \*\.safetensors files"):
        await serve(config(tmp_path, missing))


async def test_metrics_count_an_attempt(
    served: tuple[str, ProducerService], session: aiohttp.ClientSession, delivery: S3Delivery
) -> None:
    url, service = served
    v1 = bump(state(0), 1)
    service.stage_candidate(1, lambda: list(chunk_export(v1.items(), 20000)))
    client = HttpProducerClient(0, url, token=TOKEN, session=session)
    plan = AttemptPlan(
        attempt="a1", from_version=0, target_version=1, baseline_id="g1", mode="mixed"
    )
    await client.start(plan)
    sent = await client.wait_sent("a1")
    await client.update_baseline("a1", CommitRecord(1, "g1"))
    async with session.get(url + "/metrics", headers=AUTH) as resp:
        assert resp.status == 200
        families = parse_exposition(await resp.text())

    def value(name: str, **labels: str) -> float:
        f = families[name]
        return next(
            v
            for s, lab, v in zip(f.samples, f.labels, f.values, strict=True)
            if s == name and labels.items() <= lab.items()
        )

    assert value("kuberefit_producer_attempts_total", mode="mixed", outcome="sent") == 1
    assert value("kuberefit_producer_attempts_total", mode="overwrite", outcome="sent") == 0
    payloads = delivery.payloads("a1")
    assert value("kuberefit_producer_wire_bytes_total") == sent.wire_bytes > 0
    assert sent.wire_bytes == sum(p.size for p in payloads)
    assert value("kuberefit_producer_payloads_total") == sent.payloads == len(payloads)
    assert 0 < value("kuberefit_producer_last_changed_fraction") <= 1
    compare = families["kuberefit_producer_stage_seconds"]
    counts = [
        v
        for s, lab, v in zip(compare.samples, compare.labels, compare.values, strict=True)
        if s.endswith("_count") and lab["stage"] == "compare"
    ]
    assert counts == [1.0]
    assert value("kuberefit_producer_baseline_version") == 1
    assert value("kuberefit_producer_last_commit_timestamp_seconds") > 0
    assert value("kuberefit_producer_candidate_version") == -1  # committed: no candidate left


async def test_refusals_carry_the_error_body(
    served: tuple[str, ProducerService], session: aiohttp.ClientSession
) -> None:
    url, _ = served
    async with session.get(url + "/v1/producer/status") as resp:
        assert resp.status == 401
        body = ErrorBody.model_validate(await resp.json())
        assert body.code == "unauthorized"
    async with session.post(
        url + "/v1/producer/start", data=b'{"attempt": 1}', headers=AUTH
    ) as resp:
        assert resp.status == 400
        body = ErrorBody.model_validate(await resp.json())
        assert body.code == "bad_request"
        assert body.details["errors"], body
        assert body.error.startswith("invalid request: ")
    plan = AttemptPlan(
        attempt="a9", from_version=0, target_version=1, baseline_id="g", mode="mixed"
    )
    async with session.post(
        url + "/v1/producer/start", data=plan.model_dump_json(), headers=AUTH
    ) as resp:
        assert resp.status == 409
        body = ErrorBody.model_validate(await resp.json())
        assert (body.code, body.error) == ("conflict", "producer 0 has no candidate export of v1")
    async with session.get(url + "/v1/producer/nothing", headers=AUTH) as resp:
        assert resp.status == 404
        assert ErrorBody.model_validate(await resp.json()).code == "not_found"
    async with session.get(url + "/metrics", headers=AUTH) as resp:
        text = await resp.text()
    assert 'kuberefit_producer_attempts_total{mode="mixed",outcome="refused"} 1.0' in text
    assert 'kuberefit_producer_http_requests_total{code="401",path="/v1/producer/status"} 1.0' in (
        text
    )
