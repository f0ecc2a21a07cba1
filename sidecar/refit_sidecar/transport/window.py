"""The send window every transport shares: per-attempt in-flight accounting.

`send` admits a payload only while fewer than `max_in_flight` of the attempt's payloads are
unacknowledged and, past the first two, while their bytes stay within `window_bytes` (this is
the pipeline's backpressure), counts acknowledgments, keeps the first failure so later sends fail
fast, and `stop_and_wait` drains it. Transports only say how a payload travels; this bookkeeping
is written once.

Why bytes as well as a count: a payload leaves the window when its ACK comes back, a round trip
after its last byte left. To keep a link busy the window must hold the link's bandwidth-delay
product (100 Mbit/s x 50 ms = 625 KB; 10 Gbit/s x 100 ms = 125 MB), whatever the payload size: a
count alone is either too small for small payloads on a long link or too much memory for large
ones. Two payloads are always admitted, however large, so sending overlaps validation.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from refit_sidecar.transport.base import TransportSummary
from refit_sidecar.transport.errors import TransportError, TransportStoppedError


@dataclass
class AttemptSends:
    """One attempt's sends on one transport (read or change it under the window's lock)."""

    sent: int = 0
    bytes_sent: int = 0
    acked: int = 0
    in_flight: int = 0
    in_flight_bytes: int = 0
    stopped: bool = False
    ended: bool = False  # the stream-end mark was acknowledged
    error: BaseException | None = None
    errors: list[str] = field(default_factory=list)
    producers: set[int] = field(default_factory=set)

    def end_producer(self, configured: int | None) -> int | None:
        """Whose stream ends: the producer seen in the payloads, else the configured one."""
        return next(iter(self.producers)) if self.producers else configured


class SendWindow:
    """Thread-safe; one per transport instance."""

    def __init__(self, max_in_flight: int, window_bytes: int | None = None) -> None:
        """`window_bytes`: None bounds the payloads by count alone."""
        self.max_in_flight = max_in_flight
        self.window_bytes = window_bytes
        self.lock = threading.Condition()
        self._attempts: dict[str, AttemptSends] = {}

    def state(self, attempt: str) -> AttemptSends:
        with self.lock:
            return self._attempts.setdefault(attempt, AttemptSends())

    def admit(self, attempt: str, producer: int, size: int) -> None:
        """Wait for room in the window; raise at once if the attempt failed or stopped."""
        with self.lock:
            st = self._attempts.setdefault(attempt, AttemptSends())
            while True:
                if st.error is not None:
                    raise st.error
                if st.stopped:
                    raise TransportStoppedError(f"{attempt}: stopped; no more sends")
                if self._room(st, size):
                    break
                self.lock.wait(0.5)
            st.in_flight += 1
            st.in_flight_bytes += size
            st.sent += 1
            st.bytes_sent += size
            st.producers.add(producer)

    def _room(self, st: AttemptSends, size: int) -> bool:
        if st.in_flight >= self.max_in_flight:
            return False
        if self.window_bytes is None or st.in_flight < 2:
            return True
        return st.in_flight_bytes + size <= self.window_bytes

    def settle(self, attempt: str, exc: BaseException | None, size: int) -> None:
        """A send of `size` bytes finished: acknowledged, or failed with `exc` (the first
        failure is kept)."""
        with self.lock:
            st = self._attempts.get(attempt)
            if st is None:
                return  # cleaned up meanwhile
            st.in_flight -= 1
            st.in_flight_bytes -= size
            if exc is None:
                st.acked += 1
            else:
                st.errors.append(str(exc))
                if st.error is None:
                    st.error = exc if isinstance(exc, TransportError) else TransportError(repr(exc))
            self.lock.notify_all()

    def note(self, st: AttemptSends, error: str) -> None:
        with self.lock:
            st.errors.append(error)

    def stop(self, attempt: str) -> None:
        """No more sends for `attempt` (waiting senders raise TransportStoppedError)."""
        with self.lock:
            self._attempts.setdefault(attempt, AttemptSends()).stopped = True
            self.lock.notify_all()

    def stop_and_drain(self, attempt: str, deadline: float) -> AttemptSends:
        """No more sends; wait until nothing is in flight or `deadline` (then `in_flight > 0`)."""
        with self.lock:  # a re-entrant Condition: `stop` takes the same lock
            self.stop(attempt)
            st = self._attempts[attempt]
            while st.in_flight and time.monotonic() < deadline:
                self.lock.wait(min(0.5, max(deadline - time.monotonic(), 0.0)))
            return st

    def summary(self, attempt: str, st: AttemptSends) -> TransportSummary:
        with self.lock:
            return TransportSummary(attempt, st.sent, st.bytes_sent, st.acked, tuple(st.errors))

    def forget(self, attempt: str) -> None:
        with self.lock:
            st = self._attempts.pop(attempt, None)
            if st is not None:
                st.stopped = True
            self.lock.notify_all()
