"""The operator's servers survive kopf's shutdown, which cancels every task created after kopf
started (`_cancel_like_kopf` does what kopf's `run_tasks` does to them). On kopf's loop a
kept-alive connection then hangs: the API server's next review on it waits out its timeout."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from refit_operator.server_thread import ServerThread


async def _serve() -> web.AppRunner:
    async def hello(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/", hello)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


async def _cancel_like_kopf(before: set[asyncio.Task[object]]) -> None:
    """Cancel every task of this loop created since `before` (kopf's "hung tasks")."""
    hung = asyncio.all_tasks() - before - {asyncio.current_task()}
    for task in hung:
        task.cancel()
    await asyncio.gather(*hung, return_exceptions=True)


async def _kept_alive_survives(
    start: Callable[[], Awaitable[web.AppRunner]],
    cleanup: Callable[[web.AppRunner], Awaitable[None]] = lambda runner: runner.cleanup(),
) -> bool:
    """Serve, answer once on a kept-alive connection, cancel like kopf, ask again on it."""
    before = asyncio.all_tasks()
    runner = await start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/"
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(url) as response:
                assert await response.text() == "ok"
            await _cancel_like_kopf(before)
            try:
                async with session.post(url, timeout=aiohttp.ClientTimeout(total=2)) as response:
                    return await response.text() == "ok"
            except (TimeoutError, aiohttp.ClientError):
                return False
    finally:
        await cleanup(runner)


async def test_a_connection_of_a_server_on_kopfs_loop_hangs_once_kopf_stops() -> None:
    assert not await _kept_alive_survives(_serve)


async def test_a_server_on_its_own_thread_keeps_answering_on_the_same_connection() -> None:
    servers = ServerThread()
    try:
        assert await _kept_alive_survives(
            lambda: servers.call(_serve()), lambda runner: servers.call(runner.cleanup())
        )
    finally:
        await servers.close()
    assert servers.loop.is_closed()


async def test_an_error_on_the_server_loop_reaches_the_caller() -> None:
    servers = ServerThread()

    async def fails() -> None:
        raise ValueError("--webhook-cert-dir: cannot load")

    try:
        with pytest.raises(ValueError, match="cannot load"):
            await servers.call(fails())
    finally:
        await servers.close()
