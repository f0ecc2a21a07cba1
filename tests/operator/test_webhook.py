"""The webhook under a burst, over real HTTP: every review is answered within the API server's
deadline however slow the policy read, and a burst for one policy costs one read.

The API server's own call to the webhook is exercised by tests/test_helm_journey.py; here the
policy reads go to `SlowApiServerFault`, a fake KubeApi that only injects what the harness API
server cannot produce on demand: a read that takes seconds.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import ssl
import time
import uuid
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web
from kubernetes.client.rest import ApiException

from refit_operator.admission_reads import PolicyReads, review_deadline
from refit_operator.injection import InjectionConfig
from refit_operator.kube.api import KubeApi, NotFoundError
from refit_operator.webhook import PATH, POLICY_READS_AT_ONCE, serve_webhook, webhook_app
from tests.harness.pki import TestCA

BURST = 40


class SlowApiServerFault:
    """`get_policy` answers after `delay_s` (an API server under load); counts reads and the
    most in flight at once. Policies named `missing-*` do not exist."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.reads = 0
        self.in_flight = 0
        self.most_in_flight = 0

    async def get_policy(self, namespace: str, name: str) -> dict[str, Any]:
        self.reads += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        if name.startswith("missing-"):
            raise NotFoundError(f"refitpolicies {name} not found")
        return {"metadata": {"name": name}, "spec": {"tokenSecret": {"name": f"{name}-token"}}}


def _review(policy: str) -> bytes:
    pod = {
        "metadata": {
            "generateName": "rollout-",
            "annotations": {"kuberefit.io/inject": "rollout", "kuberefit.io/policy": policy},
        },
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai", "args": ["m"]}]},
    }
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "namespace": "rl",
            "operation": "CREATE",
            "object": pod,
        },
    }
    return json.dumps(review).encode()


async def _burst(
    api: SlowApiServerFault, policies: list[str]
) -> list[tuple[float, dict[str, Any]]]:
    """Post one review per policy at once, as the API server does with `?timeout=5s`; returns
    (seconds to answer, response) per review."""
    runner = web.AppRunner(webhook_app(api, InjectionConfig()))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    url = f"http://127.0.0.1:{port}{PATH}?timeout=5s"
    try:
        async with aiohttp.ClientSession() as session:

            async def one(policy: str) -> tuple[float, dict[str, Any]]:
                start = time.monotonic()
                async with session.post(url, data=_review(policy)) as response:
                    assert response.status == 200
                    body = await response.json()
                return time.monotonic() - start, body["response"]

            return await asyncio.gather(*(one(p) for p in policies))
    finally:
        await runner.cleanup()


def _patched_token_secret(response: dict[str, Any]) -> str:
    patch = json.loads(base64.b64decode(response["patch"]))
    text = json.dumps(patch)
    return "alpha-token" if "alpha-token" in text else "kuberefit-token"


async def test_a_burst_for_one_policy_is_one_read_and_answered_in_time() -> None:
    api = SlowApiServerFault(delay_s=2.0)
    answers = await _burst(api, ["alpha"] * BURST)
    assert api.reads == 1
    assert max(seconds for seconds, _ in answers) < 4.0  # the API server waits 5 s
    for _, response in answers:
        assert response["allowed"] is True
        assert _patched_token_secret(response) == "alpha-token"  # the policy's, not the default


async def test_a_slow_api_server_gets_every_review_answered_within_its_deadline() -> None:
    """40 distinct policies, each read taking 10 s (the old webhook answered the last after
    15 s, with the defaults): every review is answered before the API server's 5 s are up,
    refused with a message that says why; reads stay bounded."""
    api = SlowApiServerFault(delay_s=10.0)
    started = time.monotonic()
    answers = await _burst(api, [f"p{i}" for i in range(BURST)])
    assert time.monotonic() - started < 5.0
    deadline = review_deadline("5s", 5.0)
    for seconds, response in answers:
        assert seconds < 5.0
        assert response["allowed"] is False
        message = response["status"]["message"]
        assert f"no answer within {deadline:.1f} s" in message, message
        assert "Its controller retries" in message
    assert api.most_in_flight <= POLICY_READS_AT_ONCE


async def test_a_policy_created_after_its_pods_gives_the_chart_defaults() -> None:
    api = SlowApiServerFault(delay_s=0.0)
    [(_, response)] = await _burst(api, ["missing-alpha"])
    assert response["allowed"] is True
    assert _patched_token_secret(response) == "kuberefit-token"


async def test_reads_are_shared_for_their_ttl_then_repeated() -> None:
    api = SlowApiServerFault(delay_s=0.0)
    reads = PolicyReads(api.get_policy, ttl_s=0.2)
    await asyncio.gather(*(reads.get("rl", "alpha", 1.0) for _ in range(5)))
    await reads.get("rl", "alpha", 1.0)
    assert api.reads == 1
    await asyncio.sleep(0.25)
    await reads.get("rl", "alpha", 1.0)
    assert api.reads == 2
    with pytest.raises(NotFoundError):
        await reads.get("rl", "missing-beta", 1.0)


def test_review_deadline_leaves_a_margin_of_the_api_servers_timeout() -> None:
    assert review_deadline("5s", 10.0) == pytest.approx(3.75)
    assert review_deadline(None, 5.0) == pytest.approx(3.75)
    assert review_deadline("30s", 5.0) == pytest.approx(23.75)
    assert review_deadline("1s", 5.0) == pytest.approx(0.55)
    assert review_deadline("junk", 5.0) == pytest.approx(3.75)
    assert review_deadline("0s", 5.0) == pytest.approx(0.55)  # clamped to the API's 1 s floor


class ForbiddenApiServerFault:
    """`get_policy` refused with 403, as for a namespace outside operator.watchNamespaces
    (the real refusal is the harness API server's, in the Helm journey's RBAC; here only its
    shape, an ApiException with status 403)."""

    async def get_policy(self, namespace: str, name: str) -> dict[str, Any]:
        raise ApiException(status=403, reason="Forbidden")


async def test_a_namespace_the_operator_does_not_serve_is_refused_with_the_fix() -> None:
    [(_, response)] = await _burst(ForbiddenApiServerFault(), ["alpha"])
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert message.startswith("KubeRefit does not serve namespace rl"), message
    assert "operator.watchNamespaces" in message


async def test_a_stopping_webhook_answers_through_its_drain_closing_each_connection(
    tmp_path: Path,
) -> None:
    """The API server keeps connections to a pod that has left the Service; one closed just as
    a review is sent on it fails the review (`failurePolicy: Ignore`: a pod without its
    sidecar). So a stopping webhook answers for its drain, new connections included, each answer
    with `Connection: close`, and only then closes."""
    ca = TestCA(tmp_path / "pki")
    pair = ca.issue("webhook")
    cert_dir = tmp_path / "tls"
    cert_dir.mkdir()
    shutil.copy(pair.cert_path, cert_dir / "tls.crt")
    shutil.copy(pair.key_path, cert_dir / "tls.key")
    server = await serve_webhook(
        cast(KubeApi, SlowApiServerFault(0.0)), InjectionConfig(), "127.0.0.1", 0, cert_dir
    )
    port = server.runner.addresses[0][1]
    url = f"https://127.0.0.1:{port}{PATH}?timeout=5s"
    tls = ssl.create_default_context(cafile=str(ca.cert_path))

    async def review(session: aiohttp.ClientSession) -> tuple[str, dict[str, Any]]:
        async with session.post(url, data=_review("alpha"), ssl=tls) as response:
            assert response.status == 200
            answer = (await response.json())["response"]
            return response.headers.get("Connection", "keep-alive").lower(), answer

    async with aiohttp.ClientSession() as pooled, aiohttp.ClientSession() as fresh:
        connection, answer = await review(pooled)
        assert connection == "keep-alive"  # serving: connections are reused
        assert answer["allowed"] is True
        started = time.monotonic()
        stopping = asyncio.create_task(server.stop(drain_s=1.5))
        await asyncio.sleep(0.2)
        for session in (pooled, fresh):  # the kept connection, and one opened while draining
            connection, answer = await review(session)
            assert connection == "close"
            assert answer["allowed"] is True
            assert _patched_token_secret(answer) == "alpha-token"
        assert not stopping.done()
        await stopping
        assert time.monotonic() - started >= 1.5
        with pytest.raises(aiohttp.ClientConnectionError):
            await review(fresh)
