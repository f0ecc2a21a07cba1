"""One coordinator task per RefitPolicy, started and stopped from watch events, with no finalizer.

Why not a kopf daemon: kopf guards every object that has a daemon with a finalizer, so once the
operator is uninstalled (or scaled to zero) a RefitPolicy could no longer be deleted. A
coordinator has nothing to do at its policy's deletion: it keeps no state of its own (the
PolicyVersion is the record) and a transition cut short is taken over like any other. So the
policy's watch events drive its task: the first event starts it, later ones refresh the body it
reads, and the DELETED event (or a deletion timestamp set for someone else's finalizer) stops it.

Stopping gives the loop `grace_s` to finish its pass (its `stopped()` turns true), then cancels it
and waits up to `cancel_s` more. A loop that fails is restarted after `restart_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger("kuberefit.operator")

Key = tuple[str, str]  # (namespace, name)
#: Runs one policy's loop until `stopped()` is true: (namespace, name, body, stopped).
PolicyLoop = Callable[
    [str, str, Callable[[], Mapping[str, Any]], Callable[[], bool]], Awaitable[None]
]


@dataclass
class _Running:
    uid: str
    body: Mapping[str, Any]
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class PolicyTasks:
    """The running coordinator loops of this operator replica, by policy."""

    def __init__(
        self,
        loop: PolicyLoop,
        *,
        grace_s: float = 10.0,
        cancel_s: float = 10.0,
        restart_s: float = 10.0,
    ) -> None:
        self._loop = loop
        self.grace_s, self.cancel_s, self.restart_s = grace_s, cancel_s, restart_s
        self._running: dict[Key, _Running] = {}

    def running(self) -> list[Key]:
        return sorted(key for key, run in self._running.items() if not run.stop.is_set())

    async def observe(self, body: Mapping[str, Any], *, deleted: bool) -> bool:
        """Follow one watch event of a policy. Returns True when it stopped a loop for good
        (the policy is gone or going)."""
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        uid = str(meta.get("uid", ""))
        current = self._running.get(key)
        if current is not None and current.uid != uid:  # deleted and re-created meanwhile
            await self.stop(key)
            current = None
        if deleted or meta.get("deletionTimestamp"):
            return await self.stop(key)
        if current is None:
            current = self._running[key] = _Running(uid=uid, body=body)
            current.task = asyncio.create_task(
                self._keep_running(key, current), name=f"policy {key}"
            )
        current.body = body
        return False

    async def stop(self, key: Key) -> bool:
        """Stop `key`'s loop: `grace_s` to finish its pass, then cancelled. False if none ran."""
        run = self._running.pop(key, None)
        if run is None or run.task is None:
            return False
        run.stop.set()
        done, _ = await asyncio.wait({run.task}, timeout=self.grace_s)
        if not done:
            run.task.cancel()
            await asyncio.wait({run.task}, timeout=self.cancel_s)
            if not run.task.done():
                log.error("policy.stop_timeout", namespace=key[0], policy=key[1])
        return True

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(key) for key in list(self._running)))

    async def _keep_running(self, key: Key, run: _Running) -> None:
        while not run.stop.is_set():
            try:
                await self._loop(key[0], key[1], lambda: run.body, run.stop.is_set)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a loop that crashed is restarted, never left dead
                log.exception("policy.crashed", namespace=key[0], policy=key[1], error=str(exc))
            if not run.stop.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(run.stop.wait(), self.restart_s)
