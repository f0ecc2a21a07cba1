"""`curl /metrics` on every KubeRefit process follows one set of Prometheus conventions
(`refit_protocol.kit.metrics`; issue 19): a real receiver (with its relay node), a real producer
and a real coordinator process are scraped over HTTP before any refit happened, and the
operator's registry is checked as it is; the checker itself catches each breach."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import SecretStr
from safetensors.torch import save_file

from refit_operator import metrics as operator_metrics
from refit_operator.coordinator_service import CoordinatorServiceConfig, serve
from refit_protocol.kit.metrics import (
    BUILD_INFO,
    add_build_info,
    convention_problems,
    parse_exposition,
    preset,
    registry_problems,
)
from refit_sidecar.producer.http import create_producer_app
from refit_sidecar.producer.main import ProducerProcessConfig, build
from refit_sidecar.receiver.config import ReceiverConfig
from refit_sidecar.receiver.node import ReceiverNode
from tests.harness.procs import free_port
from tests.harness.web import serve_app
from tests.sidecar.receiver.models import RecordingApplier, TinyModel, canonical

TOKEN = "metrics-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

RECEIVER_FAMILIES = [
    "kuberefit_receiver_payloads_total",
    "kuberefit_receiver_payloads_dropped_total",
    "kuberefit_receiver_attempts_total",
    "kuberefit_receiver_apply_seconds",
    "kuberefit_receiver_stage_seconds",
    "kuberefit_receiver_gate_closed",
    "kuberefit_receiver_gate_releases_total",
    "kuberefit_receiver_held_version",
    "kuberefit_receiver_last_commit_version",
    "kuberefit_receiver_last_commit_timestamp_seconds",
    "kuberefit_receiver_http_requests_total",
    "kuberefit_relay_frames_total",
    "kuberefit_relay_frames_dropped_total",
    "kuberefit_relay_payload_bytes_total",
    "kuberefit_relay_forwards_total",
]
PRODUCER_FAMILIES = [
    "kuberefit_producer_attempts_total",
    "kuberefit_producer_wire_bytes_total",
    "kuberefit_producer_payloads_total",
    "kuberefit_producer_changed_fraction",
    "kuberefit_producer_last_changed_fraction",
    "kuberefit_producer_attempt_seconds",
    "kuberefit_producer_stage_seconds",
    "kuberefit_producer_candidates_staged_total",
    "kuberefit_producer_staged_bytes_total",
    "kuberefit_producer_baseline_version",
    "kuberefit_producer_candidate_version",
    "kuberefit_producer_last_commit_timestamp_seconds",
    "kuberefit_producer_http_requests_total",
]
COORDINATOR_FAMILIES = [
    "kuberefit_coordinator_committed_version",
    "kuberefit_coordinator_last_commit_timestamp_seconds",
    "kuberefit_coordinator_transitions_total",
    "kuberefit_coordinator_attempts_total",
    "kuberefit_coordinator_transition_latency_seconds",
    "kuberefit_coordinator_transition_stage_seconds",
    "kuberefit_coordinator_wire_bytes_total",
    "kuberefit_coordinator_changed_fraction",
]


async def scrape(session: aiohttp.ClientSession, base: str) -> str:
    async with session.get(base + "/metrics") as resp:
        assert resp.status == 401, "/metrics needs the token"
    async with session.get(base + "/metrics", headers=AUTH) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return await resp.text()


def exposition(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def labels_of(text: str, family: str, label: str) -> set[str]:
    return {lab[label] for lab in parse_exposition(text)[family].labels if label in lab}


async def test_receiver_metrics(tmp_path: Path, session: aiohttp.ClientSession) -> None:
    relay = f"tcp://127.0.0.1:{free_port()}"
    cfg = ReceiverConfig(
        node="n0",
        port=0,
        token=SecretStr(TOKEN),
        held_version=0,
        relay={"bind": relay, "nodes": [relay]},
    )
    node = ReceiverNode(cfg, RecordingApplier(TinyModel(canonical(0)), str(tmp_path / "log")))
    await node.start()
    try:
        text = await scrape(session, f"http://127.0.0.1:{node.port}")
    finally:
        await node.close()
    assert convention_problems(text, required=RECEIVER_FAMILIES, component="receiver") == []
    assert "http_unauthorized" not in text  # counted as http_requests_total{code="401"}
    outcomes = labels_of(text, "kuberefit_receiver_attempts_total", "outcome")
    assert outcomes == {"prepared", "rejected", "flushed", "failed", "stopped"}
    assert labels_of(text, "kuberefit_receiver_stage_seconds", "stage") == {
        "decode",
        "apply",
        "sync",
    }
    assert "/v1/prepare" in labels_of(text, "kuberefit_receiver_http_requests_total", "path")


async def test_producer_metrics(tmp_path: Path, session: aiohttp.ClientSession) -> None:
    config = ProducerProcessConfig(
        token=SecretStr(TOKEN),
        baseline={"directory": str(tmp_path / "baseline")},
        staging={"inbox": str(tmp_path / "inbox"), "candidate_dir": str(tmp_path / "cand")},
    )
    process = await asyncio.to_thread(build, config)
    runner, url = await serve_app(create_producer_app(process.service, token=process.tokens))
    try:
        text = await scrape(session, url)
    finally:
        await runner.cleanup()
        process.close()
    assert convention_problems(text, required=PRODUCER_FAMILIES, component="producer") == []
    attempts = parse_exposition(text)["kuberefit_producer_attempts_total"].labels
    assert {(a["mode"], a["outcome"]) for a in attempts} == {
        (m, o) for m in ("mixed", "overwrite") for o in ("sent", "failed", "refused")
    }
    stages = labels_of(text, "kuberefit_producer_stage_seconds", "stage")
    assert {"compare", "compress", "send"} <= stages
    assert "kuberefit_producer_baseline_version -1.0" in text  # no baseline before the trainer


async def test_coordinator_metrics(tmp_path: Path, session: aiohttp.ClientSession) -> None:
    (tmp_path / "v0").mkdir()
    save_file(canonical(0, tensors=2, numel=8), str(tmp_path / "v0" / "model.safetensors"))
    port = free_port()
    config = CoordinatorServiceConfig(
        policy="p",
        store_path=tmp_path / "store.sqlite",
        producers=[f"http://127.0.0.1:{free_port()}"],  # nobody: it waits for a candidate
        nodes=[],
        token=SecretStr(TOKEN),
        checkpoint_template=str(tmp_path / "v{version}"),
        metrics_port=port,
    )
    task = asyncio.ensure_future(serve(config))
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(base + "/readyz") as resp:
                    if resp.status == 200:
                        break
            assert not task.done(), task.result()
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the coordinator never became ready")
        text = await scrape(session, base)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert convention_problems(text, required=COORDINATOR_FAMILIES, component="coordinator") == []
    assert "kuberefit_coordinator_committed_version 0.0" in text
    assert labels_of(text, "kuberefit_coordinator_transition_stage_seconds", "stage") == {
        "construct",
        "transport",
        "apply",
        "finalize",
    }
    assert labels_of(text, "kuberefit_coordinator_transitions_total", "outcome") == {
        "committed",
        "rejected",
        "conflict",
        "aborted",
    }


def test_operator_registry_follows_the_conventions() -> None:
    """The operator's /metrics (the global registry): the per-policy families get their series
    when a policy's loop starts (`preset_policy`), so only those may be empty before."""
    per_policy = [
        "kuberefit_operator_transitions_total",
        "kuberefit_operator_attempts_total",
        "kuberefit_operator_transition_latency_seconds",
        "kuberefit_operator_transition_stage_seconds",
        "kuberefit_operator_last_commit_timestamp_seconds",
        "kuberefit_operator_wire_bytes_total",
        "kuberefit_operator_changed_fraction",
        "kuberefit_operator_transition_changed_fraction",
        "kuberefit_operator_takeovers_total",
        "kuberefit_operator_restores_total",
        "kuberefit_operator_committed_version",
        "kuberefit_operator_policy_leader",
        "kuberefit_operator_audits_total",
        "kuberefit_operator_audited_version",
    ]
    assert (
        registry_problems(
            REGISTRY,
            component="operator",
            may_be_empty=per_policy,
            required=[*per_policy, "kuberefit_webhook_admissions_total"],
        )
        == []
    )
    operator_metrics.preset_policy("ns", "conventions-test")
    text = exposition(REGISTRY)
    assert 'kuberefit_operator_transitions_total{namespace="ns",outcome="committed"' in text


def test_the_checker_names_every_breach() -> None:
    reg = CollectorRegistry()
    Counter("kuberefit_ok", "fine", ["x"], registry=reg).labels("a")
    Gauge("kuberefit_bad_total", "a gauge named like a counter", registry=reg)
    Histogram("kuberefit_apply_latency", "no unit", registry=reg)
    Gauge("kuberefit_staged_mib", "not a base unit", registry=reg)
    Gauge("kuberefit_last_commit_timestamp", "no unit", registry=reg)
    Counter("kuberefit_unlabelled_yet", "no series", ["outcome"], registry=reg)
    Counter("other_library_total", "not ours: left alone", ["x"], registry=reg)
    problems = registry_problems(reg, required=["kuberefit_missing_total"])
    joined = "\n".join(problems)
    for expected in (
        "kuberefit_bad_total: only counters end `_total`",
        "kuberefit_apply_latency: a duration ends `_seconds`",
        "kuberefit_staged_mib: use base units (bytes)",
        "kuberefit_last_commit_timestamp: a Unix time ends `_timestamp_seconds`",
        "kuberefit_unlabelled_yet_total: no series",
        f"{BUILD_INFO}: missing",
        "kuberefit_missing_total: missing",
    ):
        assert expected in joined, joined
    assert "kuberefit_ok" not in joined
    assert "other_library" not in joined
    created = (
        "# TYPE kuberefit_x_total counter\nkuberefit_x_total 1.0\n"
        "# TYPE kuberefit_x_created gauge\nkuberefit_x_created 1.7e9\n"
    )
    assert any("`_created` series" in p for p in convention_problems(created))


def test_build_info_and_no_created_series() -> None:
    reg = CollectorRegistry()
    add_build_info(reg, "tester")
    preset(Counter("kuberefit_events", "events", ["kind"], registry=reg), "a", "b")
    assert registry_problems(reg, component="tester") == []
    text = exposition(reg)
    assert "_created" not in text
    assert 'kuberefit_build_info{component="tester"' in text
