"""The producer's HTTP control plane on a real socket: the coordinator's client drives an
attempt end to end (payloads over the real S3 transport to a real receiver node); a missing or
wrong token is refused."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from pydantic import SecretStr

from refit_operator.producer_client import HttpProducerClient, all_staged
from refit_protocol.commit import CommitRecord
from refit_protocol.errors import ConfigurationError, EndpointError
from refit_protocol.producer_api import PRODUCER_PREFIX, AttemptPlan, ProducerStatus
from refit_sidecar.baseline.chunks import chunk_export
from refit_sidecar.baseline.config import BaselineConfig
from refit_sidecar.baseline.source import SourceBaseline
from refit_sidecar.producer.http import create_producer_app
from refit_sidecar.producer.service import ProducerService
from refit_sidecar.transport.s3 import S3Config, S3TransportConfig
from refit_sidecar.transport.selector import TransportSelector
from refit_tools.local.procs import free_port
from tests.harness.s3_payloads import S3Delivery
from tests.harness.web import serve_app
from tests.sidecar.producer.http_app import TOKEN
from tests.sidecar.producer.states import bump, replay, same, state


async def test_attempt_over_http(served, delivery: S3Delivery) -> None:  # type: ignore[no-untyped-def]
    url, service = served
    v1 = bump(state(0), 1)
    service.stage_candidate(1, lambda: list(chunk_export(v1.items(), 20000)))
    async with aiohttp.ClientSession() as session:
        client = HttpProducerClient(0, url, token=TOKEN, session=session)
        plan = AttemptPlan(
            attempt="a1",
            from_version=0,
            target_version=1,
            baseline_id="g1",
            mode="mixed",
            receivers=("r0",),
        )
        await client.start(plan)
        sent = await client.wait_sent("a1")
        payloads = delivery.payloads("a1")
        assert sent.payloads == len(payloads) > 0
        assert sent.wire_bytes == sum(p.size for p in payloads)
        assert sent.changed_elements > 0
        assert same(replay(state(0), payloads), v1)
        await client.update_baseline("a1", CommitRecord(1, "g1"))
        status = await client.status()
        assert (status.committed_version, status.committed_baseline) == (1, "g1")
        with pytest.raises(EndpointError, match="unknown attempt"):
            await client.wait_sent("nope")


@pytest.mark.parametrize("token", [None, "wrong"])
async def test_token_required(served, token: str | None) -> None:  # type: ignore[no-untyped-def]
    url, _ = served
    async with aiohttp.ClientSession() as session:
        client = HttpProducerClient(0, url, token=token, session=session)
        with pytest.raises(EndpointError, match="401"):
            await client.status()
        async with session.get(url + "/healthz") as resp:
            assert resp.status == 200


async def test_status_adds_a_transport_problem_only_when_there_is_one(  # type: ignore[no-untyped-def]
    served,
) -> None:
    """A healthy sidecar answers `/status` with the fields the previous release knew (a trainer
    image's older publisher refuses unknown ones); a store it cannot reach is named there."""
    url, service = served
    previous = set(ProducerStatus.model_fields) - {"transport_problem"}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}{PRODUCER_PREFIX}/status", headers=headers) as resp:
            assert set(await resp.json()) <= previous
        closed = f"http://127.0.0.1:{free_port()}"  # nothing listens: the store is unreachable
        store = S3Config(
            bucket="gone",
            endpoint_url=closed,
            access_key_id=SecretStr("k"),
            secret_access_key=SecretStr("s"),
        )
        medium = TransportSelector(S3TransportConfig(s3=store))
        medium.check_now()
        service.medium = medium
        async with session.get(f"{url}{PRODUCER_PREFIX}/status", headers=headers) as resp:
            problem = (await resp.json())["transport_problem"]
    assert problem.startswith(f"S3 bucket gone at {closed}: EndpointConnectionError")
    # Without any credentials the check says so before it connects.
    bare = S3TransportConfig(s3=S3Config(bucket="gone", endpoint_url=closed))
    assert "no credentials found" in TransportSelector(bare).check_now()


async def test_committed_record_learned_only_without_a_baseline(  # type: ignore[no-untyped-def]
    served, tmp_path: Path, delivery: S3Delivery
) -> None:
    url, _ = served
    async with aiohttp.ClientSession() as session:
        client = HttpProducerClient(0, url, token=TOKEN, session=session)
        await client.learn_committed(CommitRecord(0, "initial"))  # what it holds: a no-op
        with pytest.raises(EndpointError, match=r"409.*holds a baseline of v0"):
            await client.learn_committed(CommitRecord(7, "g-7"))
        assert (await client.status()).committed_version == 0
    # A restarted sidecar (no baseline yet) takes the record: the trainer's first export must
    # then be of v7.
    fresh = SourceBaseline(
        producer=0, producers=1, config=BaselineConfig(directory=tmp_path / "b2")
    )
    restarted = ProducerService(fresh, delivery.factory(fresh))
    assert not restarted.baseline_ready
    restarted.learn_committed(CommitRecord(7, "g-7"))
    assert restarted.committed == CommitRecord(7, "g-7")
    fresh.close()


async def test_producers_that_chunk_differently_stop_the_coordinator(
    tmp_path: Path, delivery: S3Delivery
) -> None:
    """Two sidecars of one policy, one sized `auto` without a reference checkpoint (256 MiB),
    one with 20000-byte chunks: ownership would overlap, so the coordinator's readiness check
    refuses with both sizes named instead of starting a transition."""
    runners, services = [], []
    urls = []
    for p, size in ((0, 20000), (1, "auto")):
        cfg = BaselineConfig(directory=tmp_path / str(p), export_chunk_bytes=size)
        baseline = SourceBaseline(producer=p, producers=2, config=cfg)
        service = ProducerService(baseline, delivery.factory(baseline))
        runner, url = await serve_app(create_producer_app(service, token=TOKEN))
        runners.append(runner)
        services.append(service)
        urls.append(url)
    try:
        async with aiohttp.ClientSession() as session:
            clients = [
                HttpProducerClient(i, u, token=TOKEN, session=session) for i, u in enumerate(urls)
            ]
            with pytest.raises(ConfigurationError) as caught:
                await all_staged(clients, 1)
            assert "producer 0: 2 producers, 20000-byte chunks" in str(caught.value)
            assert f"producer 1: 2 producers, {256 << 20}-byte chunks" in str(caught.value)
            assert await all_staged(clients[:1], 1) is False  # one alone: just not staged yet
    finally:
        for runner in runners:
            await runner.cleanup()
        for service in services:
            service.baseline.close()
