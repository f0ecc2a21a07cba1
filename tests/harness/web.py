"""An aiohttp app on a real 127.0.0.1 socket, for tests that talk HTTP to a service in-process."""

from __future__ import annotations

from aiohttp import web


async def serve_app(app: web.Application) -> tuple[web.AppRunner, str]:
    """`app` served on a free port the OS picks (no bind-then-release race), and its base URL;
    the caller cleans the runner up."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"
