"""Wait for a service's `/readyz` to give an answer (it reuses an answer for up to a second,
so a change shows on a later probe, not necessarily the next one)."""

from __future__ import annotations

import asyncio

import aiohttp

from refit_protocol.kit.service_http import Readiness


async def readyz_becomes(
    session: aiohttp.ClientSession, base: str, status: int, timeout: float = 15.0
) -> Readiness:
    """The first `/readyz` answer with `status`; fails naming the last one after `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        async with session.get(base + "/readyz") as resp:
            body = await resp.json()
            if resp.status == status:
                return Readiness.model_validate(body)
        if loop.time() > deadline:
            raise AssertionError(f"/readyz not {status} within {timeout:.0f}s: {body}")
        await asyncio.sleep(0.2)
