"""The producer side of the ZeroMQ relay tree: `Transport` over one DEALER to the assigned root.

Each payload is sent once to the root relay, which stages it and forwards it down the tree; the
root's staged ACK completes the send. Up to `max_in_flight` payloads are on the wire at once, so
payload N+1 travels while N is being validated. `send` blocks while the window is full (the
pipeline's backpressure) and raises the first delivery error of the attempt. `stop_and_wait`
drains the window and, when every payload was acknowledged, announces the stream end (the
producer's total) so receivers know its declared order is complete.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from refit_sidecar.codec.wire import EncodedPayload
from refit_sidecar.transport.base import TransportSummary
from refit_sidecar.transport.client import RelayClient, RelayClientConfig
from refit_sidecar.transport.errors import TransportError, TransportStoppedError
from refit_sidecar.transport.frames import AckStatus, FrameMeta

log = structlog.get_logger("kuberefit.transport.zmq")


class ZmqTransportConfig(BaseModel):
    """Where a producer sends (its root relay) and how patiently."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    root: str = Field(description="ZeroMQ endpoint of the assigned root relay, tcp://host:port.")
    token: SecretStr | None = Field(default=None, description="Shared token put in every frame.")
    producer: int | None = Field(
        default=None,
        ge=0,
        description="This producer's id, for the stream-end mark of an attempt that sent no "
        "payload (otherwise taken from the payload headers).",
    )
    max_in_flight: int = Field(default=2, ge=1, description="Payloads sent and not yet staged.")
    stop_timeout_s: float = Field(
        default=60.0, gt=0, description="How long stop_and_wait waits for outstanding ACKs."
    )
    client: RelayClientConfig = Field(default_factory=RelayClientConfig)


@dataclass
class _AttemptState:
    sent: int = 0
    bytes_sent: int = 0
    acked: int = 0
    in_flight: int = 0
    stopped: bool = False
    ended: bool = False
    errors: list[str] = field(default_factory=list)
    error: BaseException | None = None
    producers: set[int] = field(default_factory=set)


class ZmqRelayTransport:
    """`Transport` implementation for one producer (thread-safe)."""

    def __init__(
        self, config: ZmqTransportConfig, *, context: zmq.Context[Any] | None = None
    ) -> None:
        self.config = config
        token = config.token.get_secret_value() if config.token else None
        self._client = RelayClient(
            config.root, token=token, config=config.client, context=context, name="zmq-producer"
        )
        self._cond = threading.Condition()
        self._attempts: dict[str, _AttemptState] = {}

    # -- Transport --------------------------------------------------------------------------------
    def send(self, attempt: str, payload: EncodedPayload) -> None:
        h = payload.header
        if h.attempt != attempt:
            raise ValueError(f"payload of attempt {h.attempt!r} sent as {attempt!r}")
        with self._cond:
            st = self._attempts.setdefault(attempt, _AttemptState())
            while True:
                self._raise_if_failed(attempt, st)
                if st.in_flight < self.config.max_in_flight:
                    break
                self._cond.wait(0.5)
            st.in_flight += 1
            st.sent += 1
            st.bytes_sent += payload.size
            st.producers.add(h.producer)
        meta = FrameMeta(
            attempt=attempt,
            producer=h.producer,
            payload_id=h.payload_id,
            order=h.order,
            digest=payload.digest.hex(),
            size=payload.size,
        )
        fut = self._client.submit_data(meta, payload.body)
        fut.add_done_callback(lambda f: self._done(attempt, f))

    def stop_and_wait(self, attempt: str) -> TransportSummary:
        deadline = time.monotonic() + self.config.stop_timeout_s
        with self._cond:
            st = self._attempts.setdefault(attempt, _AttemptState())
            st.stopped = True
            self._cond.notify_all()
            while st.in_flight and time.monotonic() < deadline:
                self._cond.wait(min(0.5, max(deadline - time.monotonic(), 0.0)))
            timed_out = st.in_flight > 0
        if timed_out:
            self._client.abort(attempt, "stop_and_wait timed out waiting for ACKs")
            with self._cond:
                st.errors.append(f"{st.in_flight} payloads unacknowledged at stop")
        if not st.errors and not st.ended and len(st.producers) <= 1:
            self._announce_end(attempt, st, deadline)
        with self._cond:
            return TransportSummary(attempt, st.sent, st.bytes_sent, st.acked, tuple(st.errors))

    def cleanup(self, attempt: str) -> None:
        self._client.abort(attempt, "cleaned up")
        with self._cond:
            st = self._attempts.pop(attempt, None)
            if st is not None:
                st.stopped = True
            self._cond.notify_all()

    def close(self) -> None:
        """Close the socket (end of the producer's life, not of an attempt)."""
        self._client.close()

    # -- internals --------------------------------------------------------------------------------
    def _raise_if_failed(self, attempt: str, st: _AttemptState) -> None:
        if st.error is not None:
            raise st.error
        if st.stopped:
            raise TransportStoppedError(f"{attempt}: stopped; no more sends")

    def _done(self, attempt: str, fut: Future[AckStatus]) -> None:
        exc = fut.exception()
        with self._cond:
            st = self._attempts.get(attempt)
            if st is None:
                return
            st.in_flight -= 1
            if exc is None:
                st.acked += 1
            else:
                st.errors.append(str(exc))
                if st.error is None:
                    st.error = exc if isinstance(exc, TransportError) else TransportError(str(exc))
            self._cond.notify_all()

    def _announce_end(self, attempt: str, st: _AttemptState, deadline: float) -> None:
        if st.producers:
            producer = next(iter(st.producers))
        elif self.config.producer is not None:
            producer = self.config.producer
        else:
            return  # nothing sent, producer unknown: the flush's expected totals tell receivers
        fut = self._client.submit_end(FrameMeta(attempt=attempt, producer=producer, total=st.sent))
        try:
            fut.result(timeout=max(deadline - time.monotonic(), 1.0))
            st.ended = True
        except Exception as exc:
            with self._cond:
                st.errors.append(f"stream end not acknowledged: {exc}")
