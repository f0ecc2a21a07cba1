"""The loop's probe of a policy's trainer sidecars returns a value: the clients in index order
once every expected producer answers and agrees, or the one-line reason the Ready condition
shows. The sidecars here are stand-ins serving a chosen `/status` over real sockets
(`fake_status_sidecars`): each case is a misconfiguration a real deployment can reach (two pods
given one index, a pod created under another producer count) but that takes a whole trainer
pod to reproduce."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import aiohttp
import pytest
from aiohttp import web

from refit_operator.discovery import Discovered, PodView
from refit_operator.pod_settings import FixedSettingsWatch
from refit_operator.policy_producers import probe_producers
from refit_operator.policy_spec import parse_spec
from refit_protocol.commit import CommitRecord
from refit_protocol.producer_api import PRODUCER_PREFIX, ProducerStatus
from tests.harness.web import serve_app

RECORD = CommitRecord(4, "g-4")


def status(producer: int, **fields: object) -> ProducerStatus:
    base: dict[str, object] = {
        "producer": producer,
        "committed_version": 4,
        "committed_baseline": "g-4",
        "producers": 2,
        "baseline_ready": True,
        "candidate_version": 5,
    }
    return ProducerStatus.model_validate({**base, **fields})


async def fake_status_sidecars(
    statuses: Sequence[ProducerStatus],
) -> AsyncIterator[Discovered]:
    runners, pods = [], []
    for i, answer in enumerate(statuses):

        async def handle(_: web.Request, answer: ProducerStatus = answer) -> web.Response:
            return web.json_response(answer.model_dump(mode="json"))

        app = web.Application()
        app.router.add_get(f"{PRODUCER_PREFIX}/status", handle)
        runner, url = await serve_app(app)
        runners.append(runner)
        port = int(url.rsplit(":", 1)[1])
        pods.append(
            PodView(
                "ns", f"trainer-{i}", f"uid-{i}", "trainer", "p", ip="127.0.0.1",
                phase="Running", control_port=port,
            )
        )  # fmt: skip
    try:
        yield Discovered(trainers=tuple(pods), rollouts=())
    finally:
        for runner in runners:
            await runner.cleanup()


@pytest.mark.parametrize(
    ("statuses", "problem"),
    [
        ([status(0), status(1)], ""),
        ([status(0)], "report producer indices [0]; spec.producers is 2"),
        ([status(0), status(0)], "trainer pod trainer-1 reports producer index 0, which another"),
        ([status(0), status(1, producers=3)], "splits the checkpoint among 3 producers"),
        ([status(1), status(0, candidate_version=None)], ""),
    ],
)
async def test_the_probe_names_what_disagrees(statuses: list[ProducerStatus], problem: str) -> None:
    spec = parse_spec({"tokenSecret": {"name": "t"}, "producers": 2})
    async with aiohttp.ClientSession() as session:
        async for found in fake_status_sidecars(statuses):
            probe = await probe_producers(
                session, found, spec, "token", RECORD, FixedSettingsWatch()
            )
    if problem:
        assert probe.clients is None
        assert problem in probe.error
        assert not probe.all_staged(5)
        return
    assert probe.error == ""
    assert probe.clients is not None
    assert [c.producer for c in probe.clients] == [0, 1]  # index order, whatever pod order
    staged = [s.candidate_version for s in statuses]
    assert probe.all_staged(5) == (staged == [5, 5])


async def test_a_producer_that_cannot_send_is_named_with_its_credentials_source() -> None:
    """A trainer sidecar whose store refuses its keys reports it in its status; the policy's
    Ready condition then says so, with the Secret the keys came from (the user's fix)."""
    spec = parse_spec(
        {
            "tokenSecret": {"name": "t"},
            "producers": 2,
            "transport": "s3",
            "s3": {"bucket": "payloads", "credentialsSecret": "s3-keys"},
        }
    )
    refused = "S3 bucket payloads at AWS us-east-1 refuses the credentials (InvalidAccessKeyId)"
    async with aiohttp.ClientSession() as session:
        async for found in fake_status_sidecars([status(0), status(1, transport_problem=refused)]):
            probe = await probe_producers(
                session, found, spec, "token", RECORD, FixedSettingsWatch()
            )
    assert probe.clients is None
    assert probe.reason == "TransportUnavailable"
    assert probe.error.startswith(f"trainer pod trainer-1 cannot send: {refused}")
    assert "Secret s3-keys" in probe.error
