"""Operator absence: what a rollout node does when no coordinator calls any more.

A coordinator talks to every node of a transition all along: prepare, gate, status polls every
few seconds while payloads stream, flush, commit. If it vanishes (the operator uninstalled, or
down for good), a node can be left with its request gate closed by an attempt (sync RL) and no
one to reopen it. After `gate_release_s` without a coordinator call (`CoordinatorContact`):

- a node whose bits are still its committed version (the attempt wrote nothing) retires the
  attempt and reopens its gate: it serves its committed weights again, and says so in its status
  (`gate_released`) and readiness; the next coordinator posts it as an Event;
- a node holding partial writes keeps its gate closed and reports NotReady naming the attempt:
  it never serves partial weights, and the next coordinator restores it densely (or repairs it
  with the overwrite retry of the same transition).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


class CoordinatorContact:
    """When a coordinator last called this node: a call in flight counts as contact (a flush
    may legitimately wait for minutes). Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = 0
        self._last = clock()

    def begin(self) -> None:
        with self._lock:
            self._in_flight += 1
            self._last = self._clock()

    def end(self) -> None:
        with self._lock:
            self._in_flight = max(0, self._in_flight - 1)
            self._last = self._clock()

    def silent_for(self) -> float:
        """Seconds since the last coordinator call ended (0 while one is in flight)."""
        with self._lock:
            return 0.0 if self._in_flight else max(0.0, self._clock() - self._last)


@dataclass(frozen=True)
class Held:
    """What the node holds when the check runs (read under the node's condition)."""

    gate_closed: bool
    held_version: int | None  # None: unknown bits (a restarted sidecar), never released
    dirty: bool  # partial writes since held_version
    attempt: str | None


def may_release(held: Held, silent_s: float, limit_s: float) -> bool:
    """Whether a closed gate may reopen: nothing was written since the committed version and
    no coordinator called for `limit_s` (0 disables the release)."""
    return (
        limit_s > 0
        and silent_s >= limit_s
        and held.gate_closed
        and held.held_version is not None
        and not held.dirty
    )


def stranded(held: Held, silent_s: float, limit_s: float) -> str | None:
    """Why the node is out of service without a coordinator (its readiness), or None."""
    if limit_s <= 0 or silent_s < limit_s or not held.dirty:
        return None
    return (
        f"holds partial writes of attempt {held.attempt or '(retired)'} over "
        f"v{held.held_version} and no coordinator called for {silent_s:.0f} s: its gate stays "
        "closed (it never serves partial weights) until a coordinator restores it densely"
    )


def release_message(held: Held, silent_s: float) -> str:
    """What the node says (status, readiness, the coordinator's Event) after reopening."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return (
        f"request gate reopened at {stamp} after {silent_s:.0f} s without a coordinator call: "
        f"attempt {held.attempt or '(none)'} had written nothing, so the node serves its "
        f"committed v{held.held_version}"
    )
