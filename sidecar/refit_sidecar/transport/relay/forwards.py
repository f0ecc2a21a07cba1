"""The child forwards a relay has in flight, per attempt: the relay-flush barrier.

Why on its own: forwards are counted on the ROUTER thread and finish on the DEALERs' I/O threads,
while the flush (`drain`) waits on a third. The rules are bookkeeping, no socket: a child that
failed one forward of an attempt is skipped for the rest of it (its error is reported once), a
forward that finishes after its attempt was forgotten (replaced) leaves no trace, and `drain`
returns when none is left or its time is up. Here they can be checked without any relay.
"""

from __future__ import annotations

import collections
import threading
import time


class ForwardLedger:
    """Forwards started and not yet finished, failed children and their errors; thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: collections.Counter[str] = collections.Counter()
        self._errors: dict[str, list[str]] = collections.defaultdict(list)
        self._dead: dict[str, set[str]] = collections.defaultdict(set)

    def start(self, attempt: str, child: str) -> bool:
        """Count a forward of `attempt` to `child`; False (nothing counted, skip it) when that
        child already failed a forward of the attempt."""
        with self._cond:
            if child in self._dead[attempt]:
                return False
            self._pending[attempt] += 1
            return True

    def finish(self, attempt: str, child: str, error: str | None) -> tuple[str | None, bool]:
        """A forward counted by `start` ended (`error`: it failed). Returns the error to report
        (None also when the attempt was forgotten meanwhile) and whether it is the child's
        first failure in the attempt (then its other forwards of the attempt should stop)."""
        with self._cond:
            if attempt not in self._pending:  # forgotten (replaced) attempt: no bookkeeping
                error = None
            else:
                self._pending[attempt] -= 1
            first = error is not None and child not in self._dead[attempt]
            if first:
                self._dead[attempt].add(child)
                self._errors[attempt].append(str(error))
            self._cond.notify_all()
        return error, first

    def drain(self, attempt: str, timeout: float) -> list[str]:
        """Wait until no forward of `attempt` is pending; the forwarding errors seen."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending[attempt] > 0 and time.monotonic() < deadline:
                self._cond.wait(min(0.2, max(deadline - time.monotonic(), 0.0)))
            errors = list(self._errors.get(attempt, []))
            if self._pending[attempt] > 0:
                errors.append(
                    f"{self._pending[attempt]} forwards still pending after {timeout:.1f}s"
                )
        return errors

    def forget(self, attempt: str) -> None:
        """Drop what is known of `attempt`: forwards still running leave no trace."""
        with self._cond:
            self._pending.pop(attempt, None)
            self._errors.pop(attempt, None)
            self._dead.pop(attempt, None)
