"""The transport adapter: the three calls the producer pipeline and the coordinator use.

Real transports (ZeroMQ relay tree, S3) implement this protocol; the pipeline only calls `send`,
from its send thread, and never looks inside a transport. Table B.1 of the paper.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from refit_sidecar.codec.wire import EncodedPayload


@dataclass(frozen=True)
class TransportSummary:
    """What `stop_and_wait` reports for an attempt once its transport work has drained."""

    attempt: str
    payloads_sent: int
    bytes_sent: int
    payloads_acknowledged: int
    errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class SendInterval:
    """One payload's transport interval (paper Appendix C): from its submission to the wire
    (admitted into the send window) until the sending endpoint got its queueing ACK, or failed.
    Times are `time.monotonic()`, comparable across the processes of one host."""

    attempt: str
    payload_id: int
    size: int
    submitted: float
    settled: float
    ok: bool


#: Called once per payload when its interval ends (from a transport thread: keep it short).
SendObserver = Callable[[SendInterval], None]


@runtime_checkable
class Transport(Protocol):
    """Moves a producer's payloads to the receivers of an attempt."""

    def send(self, attempt: str, payload: EncodedPayload) -> None:
        """Hand one payload over; returns once the transport has queued it (its staged ACK).

        Blocking here is the pipeline's backpressure. Raising fails the attempt.
        """
        ...

    def stop_and_wait(self, attempt: str) -> TransportSummary:
        """Stop sending for `attempt`, wait for in-flight transport work, report counts."""
        ...

    def cleanup(self, attempt: str) -> None:
        """Release everything the attempt left in the transport (objects, sockets, buffers)."""
        ...


@runtime_checkable
class AbandoningTransport(Transport, Protocol):
    """A transport that can give up on an obsolete attempt's in-flight sends at once.

    The coordinator stops an attempt only after marking it obsolete, so nothing in flight can
    still be useful; waiting for its acknowledgments (up to the stop timeout when the node that
    should acknowledge was killed) only delays the retry. Transports whose in-flight work must
    finish before `cleanup` can delete it (S3 uploads) do not implement this.
    """

    def abandon(self, attempt: str) -> None:
        """Stop sending for `attempt` and fail its unacknowledged sends now."""
        ...


class TransportMedium(Protocol):
    """What a producer asks of its transport kind beyond one attempt's transport
    (`TransportSelector`)."""

    def problem(self) -> str:
        """Why nothing could be sent now ("" : nothing known to be wrong)."""
        ...

    def leftovers(self, attempt: str) -> None:
        """Delete what `attempt` left in the medium; idempotent."""
        ...
