"""The producer side of the ZeroMQ relay tree: `Transport` over one DEALER to the assigned root.

Each payload is sent once to the root relay, which stages it and forwards it down the tree; the
root's staged ACK completes the send. Up to `max_in_flight` payloads, and past the first two up
to `window_bytes`, are on the wire at once (`window.py`: a window that holds the link's
bandwidth-delay product keeps a long link busy), so payload N+1 travels while N is validated.
`send` blocks while the window is full (the pipeline's backpressure) and raises the first
delivery error of the attempt. `stop_and_wait` drains the window and, when every payload was
acknowledged, announces the stream end (the producer's total) so receivers know its declared
order is complete.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import structlog
import zmq
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from refit_protocol.kit.tokens import TokenRing
from refit_protocol.sizes import ByteSize
from refit_sidecar.codec.wire import EncodedPayload
from refit_sidecar.transport.base import SendInterval, SendObserver, TransportSummary
from refit_sidecar.transport.relay.config import DealerConfig, RootDealerConfig
from refit_sidecar.transport.relay.dealer import RelayDealer
from refit_sidecar.transport.relay.frames import FrameMeta, LinkSecurity
from refit_sidecar.transport.window import AttemptSends, SendWindow

log = structlog.get_logger("kuberefit.transport.zmq")


class RelayTransportConfig(BaseModel):
    """Where a producer sends (its root relay) and how patiently."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    root: str = Field(description="ZeroMQ endpoint of the assigned root relay, tcp://host:port.")
    token: SecretStr | None = Field(default=None, description="Shared token put in every frame.")
    link: LinkSecurity = Field(
        default=LinkSecurity.CURVE,
        description="How the root is reached: curve (CurveZMQ, the only sound choice from "
        "another cluster) or mac (plain TCP, frames tagged: for a producer inside the rollout "
        "cluster's network; `root` is then the root's MAC-only endpoint, docs/security.md).",
    )
    producer: int | None = Field(
        default=None,
        ge=0,
        description="This producer's id, for the stream-end mark of an attempt that sent no "
        "payload (otherwise taken from the payload headers).",
    )
    max_in_flight: int = Field(
        default=16, ge=1, description="Payloads sent and not yet staged by the root, at most."
    )
    window_bytes: ByteSize = Field(
        default=128 << 20,
        gt=0,
        description="Bytes sent and not yet staged by the root (two payloads are always "
        "allowed, however large). Size it to the link's bandwidth-delay product: 10 Gbit/s "
        "with a 100 ms round trip is 125 MB. The producer holds these bytes in memory.",
    )
    stop_timeout_s: float = Field(
        default=60.0, gt=0, description="How long stop_and_wait waits for outstanding ACKs."
    )
    client: RootDealerConfig = Field(
        default_factory=RootDealerConfig, description="Window and retries of the sends to the root."
    )

    @field_validator("client", mode="before")
    @classmethod
    def _root_hop_defaults(cls, value: Any) -> Any:
        """A plain `DealerConfig` keeps what it sets; the rest takes the root hop's defaults."""
        if isinstance(value, DealerConfig) and not isinstance(value, RootDealerConfig):
            return value.model_dump(exclude_unset=True)
        return value


class RelayTransport:
    """`Transport` implementation for one producer (thread-safe)."""

    def __init__(
        self,
        config: RelayTransportConfig,
        *,
        context: zmq.Context[Any] | None = None,
        observer: SendObserver | None = None,
        tokens: TokenRing | None = None,
    ) -> None:
        """`observer` receives every payload's transport interval (benchmarks measure the
        transport lower bound with it). `tokens`: the process's token ring, followed across
        rotations (instead of the config's fixed `token`)."""
        self.config = config
        self._observer = observer
        token = config.token.get_secret_value() if config.token else None
        self._client = RelayDealer(
            config.root,
            token=tokens if tokens is not None else token,
            config=config.client,
            context=context,
            name="zmq-producer",
            link=config.link,
        )
        self._window = SendWindow(config.max_in_flight, config.window_bytes)

    # -- Transport --------------------------------------------------------------------------------
    def send(self, attempt: str, payload: EncodedPayload) -> None:
        h = payload.header
        if h.attempt != attempt:
            raise ValueError(f"payload of attempt {h.attempt!r} sent as {attempt!r}")
        self._window.admit(attempt, h.producer, payload.size)
        meta = FrameMeta.of(payload)
        submitted = time.monotonic()
        fut = self._client.submit_data(meta, payload.body)
        fut.add_done_callback(lambda f: self._settled(meta, submitted, f))

    def stop_and_wait(self, attempt: str) -> TransportSummary:
        deadline = time.monotonic() + self.config.stop_timeout_s
        st = self._window.stop_and_drain(attempt, deadline)
        if st.in_flight:
            self._client.abort(attempt, "stop_and_wait timed out waiting for ACKs")
            self._window.note(st, f"{st.in_flight} payloads unacknowledged at stop")
        if not st.errors and not st.ended and len(st.producers) <= 1:
            self._announce_end(attempt, st, deadline)
        return self._window.summary(attempt, st)

    def abandon(self, attempt: str) -> None:
        """The attempt is obsolete: no more sends, and its unacknowledged frames fail now
        (frames already on the wire are dropped by relays that learned the attempt is stopped)."""
        self._window.stop(attempt)
        self._client.abort(attempt, "attempt abandoned")

    def cleanup(self, attempt: str) -> None:
        self._client.abort(attempt, "cleaned up")
        self._window.forget(attempt)

    def close(self) -> None:
        """Close the socket (end of the producer's life, not of an attempt)."""
        self._client.close()

    # -- internals --------------------------------------------------------------------------------
    def _settled(self, meta: FrameMeta, submitted: float, fut: Future[Any]) -> None:
        settled = time.monotonic()
        exc = fut.exception()
        self._window.settle(meta.attempt, exc, meta.size)
        if self._observer is not None:
            self._observer(
                SendInterval(
                    meta.attempt, meta.payload_id, meta.size, submitted, settled, exc is None
                )
            )

    def _announce_end(self, attempt: str, st: AttemptSends, deadline: float) -> None:
        producer = st.end_producer(self.config.producer)
        if producer is None:
            return  # nothing sent, producer unknown: the flush's expected totals tell receivers
        fut = self._client.submit_end(FrameMeta(attempt=attempt, producer=producer, total=st.sent))
        try:
            fut.result(timeout=max(deadline - time.monotonic(), 1.0))
            st.ended = True
        except Exception as exc:
            self._window.note(st, f"stream end not acknowledged: {exc}")
