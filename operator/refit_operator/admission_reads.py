"""Policy reads for admission: one API read per policy however many reviews ask, each review
bounded by its own deadline.

A burst of pod creations (a Deployment scaled to 40) sends 40 reviews for the same RefitPolicy
at once. Each review waits for the one read in flight for that policy (single flight) and keeps
its answer for `ttl_s`, so a burst costs one read; reads of different policies run at most
`at_once` at a time (the API client runs them in worker threads the policy loops share). A
review waits no longer than its own deadline, the wait for a free slot included; the read goes
on without it and serves the reviews after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

#: A policy read: the RefitPolicy object, or NotFoundError / any API error raised.
Read = Callable[[str, str], Awaitable[dict[str, Any]]]


class PolicyReads:
    """Single-flight, briefly cached RefitPolicy reads (see the module docstring)."""

    def __init__(self, read: Read, *, at_once: int = 8, ttl_s: float = 1.0) -> None:
        self._read = read
        self._limit = asyncio.Semaphore(at_once)
        self._ttl_s = ttl_s
        self._flights: dict[tuple[str, str], asyncio.Task[dict[str, Any]]] = {}
        self._done_at: dict[tuple[str, str], float] = {}

    async def get(self, namespace: str, name: str, deadline_s: float) -> dict[str, Any]:
        """The policy, read at most `ttl_s` ago; raises TimeoutError after `deadline_s` (the
        read continues for later reviews) and what the read raised otherwise."""
        key = (namespace, name)
        task = self._flights.get(key)
        fresh = task is not None and (
            not task.done() or time.monotonic() - self._done_at.get(key, 0.0) < self._ttl_s
        )
        if task is None or not fresh:
            task = asyncio.get_running_loop().create_task(self._one_read(key))
            task.add_done_callback(_retrieve)  # every review may have left before it failed
            self._flights[key] = task
        return await asyncio.wait_for(asyncio.shield(task), max(0.0, deadline_s))

    async def _one_read(self, key: tuple[str, str]) -> dict[str, Any]:
        try:
            async with self._limit:
                return await self._read(*key)
        finally:
            self._done_at[key] = time.monotonic()
            self._forget_stale()

    def _forget_stale(self) -> None:
        """Drop finished reads past their ttl (a failed one too: the next review reads again)."""
        now = time.monotonic()
        for key, task in list(self._flights.items()):
            if task.done() and now - self._done_at.get(key, 0.0) >= self._ttl_s:
                del self._flights[key]
                self._done_at.pop(key, None)


def _retrieve(task: asyncio.Task[dict[str, Any]]) -> None:
    if not task.cancelled():
        task.exception()


def review_deadline(timeout_query: str | None, default_s: float) -> float:
    """Seconds a review may spend reading its policy: most of what the API server waits for the
    webhook (its `?timeout=5s` query; `default_s` without one), leaving a margin to answer."""
    total = default_s
    if timeout_query and timeout_query.endswith("s"):
        with contextlib.suppress(ValueError):
            total = float(timeout_query[:-1])
    total = min(max(total, 1.0), 30.0)  # the API server allows 1..30 s
    return max(0.5, 0.8 * total - 0.25)
