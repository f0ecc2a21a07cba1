"""The coordinator's producer client against a producer of the previous release: a plan without
stream settings is sent without the field, which that release's model (extra fields forbidden)
would refuse. Over a real socket, with the body as the server received it."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from refit_operator.producer_client import HttpProducerClient
from refit_protocol.errors import EndpointError
from refit_protocol.producer_api import PRODUCER_PREFIX, AttemptPlan, StreamSettings
from tests.harness.web import serve_app

#: What a producer of the release before `AttemptPlan.settings` accepted.
PREVIOUS_FIELDS = set(AttemptPlan.model_fields) - {"settings"}


async def test_a_plan_without_settings_is_what_the_previous_release_accepts() -> None:
    received: list[dict[str, Any]] = []

    async def start(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        received.append(body)
        if not set(body) <= PREVIOUS_FIELDS:
            return web.json_response({"error": "extra fields not permitted"}, status=400)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post(f"{PRODUCER_PREFIX}/start", start)
    runner, url = await serve_app(app)
    plan = AttemptPlan(
        attempt="a1", from_version=0, target_version=1, baseline_id="g1", mode="mixed"
    )
    try:
        async with aiohttp.ClientSession() as session:
            client = HttpProducerClient(0, url, token="t", session=session)
            await client.start(plan)  # accepted: nothing it does not know
            assert "settings" not in received[0]
            # With settings the previous release refuses the plan: why plans carry them only
            # when every producer reports its settings (pod_settings.FixedSettingsWatch).
            chosen = StreamSettings(zstd_level=3, shuffle=False, bucket_bytes=1 << 20)
            with pytest.raises(EndpointError, match="HTTP 400"):
                await client.start(plan.model_copy(update={"settings": chosen}))
            assert received[1]["settings"] == {
                "zstd_level": 3, "shuffle": False, "bucket_bytes": 1048576
            }  # fmt: skip
    finally:
        await runner.cleanup()
