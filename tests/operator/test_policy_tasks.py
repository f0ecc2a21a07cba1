"""`PolicyTasks`: watch events start, refresh and stop one coordinator loop per policy."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from refit_operator.policy_tasks import PolicyTasks


def _policy(name: str = "alpha", uid: str = "u1", **meta: Any) -> dict[str, Any]:
    return {"metadata": {"namespace": "rl", "name": name, "uid": uid, **meta}, "spec": {}}


class Loops:
    """Loop bodies that record what they saw; `mode` picks how they behave when stopped."""

    def __init__(self, mode: str = "polite") -> None:
        self.mode = mode
        self.started: list[tuple[str, str]] = []
        self.bodies: list[Mapping[str, Any]] = []
        self.finished: list[str] = []  # "stopped" or "cancelled"
        self.crashes = 0

    async def __call__(
        self, namespace: str, name: str, body: Callable[[], Mapping[str, Any]], stopped: Any
    ) -> None:
        self.started.append((namespace, name))
        if self.mode == "crash" and self.crashes == 0:
            self.crashes += 1
            raise RuntimeError("boom")
        try:
            while self.mode == "stubborn" or not stopped():
                self.bodies.append(body())
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.finished.append("cancelled")
            raise
        self.finished.append("stopped")


def test_events_start_refresh_and_stop_a_loop() -> None:
    async def scenario() -> None:
        loops = Loops()
        tasks = PolicyTasks(loops, grace_s=2.0)
        assert await tasks.observe(_policy(), deleted=False) is False
        await asyncio.sleep(0.05)
        assert loops.started == [("rl", "alpha")]
        assert tasks.running() == [("rl", "alpha")]
        newer = _policy()
        newer["spec"] = {"chunk": 7}
        await tasks.observe(newer, deleted=False)  # a second event: the same loop, a new body
        await asyncio.sleep(0.05)
        assert loops.started == [("rl", "alpha")]
        assert loops.bodies[-1]["spec"] == {"chunk": 7}
        assert await tasks.observe(newer, deleted=True) is True
        assert loops.finished == ["stopped"]
        assert tasks.running() == []
        assert await tasks.observe(newer, deleted=True) is False  # nothing left to stop

    asyncio.run(scenario())


def test_a_deletion_timestamp_stops_the_loop() -> None:
    """Someone else's finalizer keeps the object: its deletion has begun all the same."""

    async def scenario() -> None:
        loops = Loops()
        tasks = PolicyTasks(loops, grace_s=2.0)
        await tasks.observe(_policy(), deleted=False)
        await asyncio.sleep(0.02)
        gone = _policy(deletionTimestamp="2026-12-05T00:00:00Z", finalizers=["other.io/x"])
        assert await tasks.observe(gone, deleted=False) is True
        assert loops.finished == ["stopped"]
        await tasks.observe(gone, deleted=False)  # later events of a deleting policy start nothing
        assert loops.started == [("rl", "alpha")]

    asyncio.run(scenario())


def test_a_loop_that_ignores_stopped_is_cancelled_after_its_grace() -> None:
    async def scenario() -> None:
        loops = Loops("stubborn")
        tasks = PolicyTasks(loops, grace_s=0.1, cancel_s=1.0)
        await tasks.observe(_policy(), deleted=False)
        await asyncio.sleep(0.02)
        await tasks.stop(("rl", "alpha"))
        assert loops.finished == ["cancelled"]

    asyncio.run(scenario())


def test_a_crashed_loop_is_restarted() -> None:
    async def scenario() -> None:
        loops = Loops("crash")
        tasks = PolicyTasks(loops, restart_s=0.05)
        await tasks.observe(_policy(), deleted=False)
        await asyncio.sleep(0.3)
        assert loops.crashes == 1
        assert len(loops.started) == 2
        assert tasks.running() == [("rl", "alpha")]
        await tasks.stop_all()
        assert loops.finished == ["stopped"]

    asyncio.run(scenario())


def test_a_policy_recreated_under_its_name_gets_a_fresh_loop() -> None:
    """The DELETED event was missed (a watch gap): a new uid under the same name replaces the
    loop of the old object."""

    async def scenario() -> None:
        loops = Loops()
        tasks = PolicyTasks(loops, grace_s=2.0)
        await tasks.observe(_policy(uid="u1"), deleted=False)
        await tasks.observe(_policy("beta", uid="b1"), deleted=False)
        await asyncio.sleep(0.02)
        await tasks.observe(_policy(uid="u2"), deleted=False)
        await asyncio.sleep(0.02)
        assert loops.started == [("rl", "alpha"), ("rl", "beta"), ("rl", "alpha")]
        assert loops.finished == ["stopped"]
        assert tasks.running() == [("rl", "alpha"), ("rl", "beta")]
        await tasks.stop_all()
        assert loops.finished == ["stopped"] * 3
        assert tasks.running() == []

    asyncio.run(scenario())
