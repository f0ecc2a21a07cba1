"""An event loop on its own thread for the operator's HTTP servers (the webhook, health/metrics).

Why not kopf's loop: when kopf stops it cancels every task created after it started, and those
include each connection an HTTP server accepted meanwhile (kopf's own docstring: "there is no
way to trace who spawned what"). A cancelled connection task leaves its socket open and unread,
so a review the API server sends on that kept-alive connection waits out its whole timeout, and
`failurePolicy: Ignore` then admits the pod without its sidecar. On their own loop the servers
keep answering through kopf's shutdown and their own drain (`webhook.WebhookServer.stop`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

#: How long `close` waits for the loop's thread to end.
JOIN_S = 5.0


class ServerThread:
    """Runs coroutines on a private event loop in a daemon thread."""

    def __init__(self, name: str = "kuberefit-servers") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the server loop; await its result from the calling loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def close(self) -> None:
        """Stop the loop (after its default executor's threads end) and join its thread."""
        if self.loop.is_closed():
            return
        await asyncio.wait_for(self.call(self.loop.shutdown_default_executor()), JOIN_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        await asyncio.to_thread(self._thread.join, JOIN_S)
        if not self._thread.is_alive():
            self.loop.close()
