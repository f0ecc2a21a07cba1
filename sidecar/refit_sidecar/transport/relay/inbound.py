"""The relay tree's receiving side on one node: its ROUTER (`node.RelayNode`) and the adapter
from relay frames to the node's transport-neutral sink.

`RelayNode` asks a `RelaySink` about frames (`relay_check`, `relay_stage`, ...); this module
answers by turning each frame's metadata into a `PayloadIdent` and calling the node's
`PayloadSink`, and reads the attempt's tree from its prepare (`relay_tree`, else the node's
configured `nodes`). It is also the kind's `Inbound`: a prepare whose tree does not name this
node is refused, a stop aborts the attempt's forwards, and the relay-flush barrier waits for
them (`drain`).
"""

from __future__ import annotations

import zmq
from aiohttp import web

from refit_protocol.errors import listen_error
from refit_protocol.receiver_api import PrepareRequest
from refit_sidecar.transport.inbound import AckStatus, PayloadIdent, PayloadSink, Verdict
from refit_sidecar.transport.plugin import InboundContext
from refit_sidecar.transport.relay.config import RelayConfig
from refit_sidecar.transport.relay.frames import FrameMeta
from refit_sidecar.transport.relay.node import RelayNode


def ident_of(meta: FrameMeta) -> PayloadIdent:
    """The identity a DATA or PROBE frame announces."""
    return PayloadIdent(
        meta.attempt,
        meta.producer,
        meta.payload_id,
        meta.order,
        bytes.fromhex(meta.digest),
        meta.size,
    )


class RelayInbound:
    """One node's relay-tree ROUTER (`transport.inbound.Inbound`; `node.RelaySink` for it)."""

    kind = "zmq"

    def __init__(self, config: RelayConfig, sink: PayloadSink, context: InboundContext) -> None:
        self.config = config
        self.sink = sink
        self.context = context
        self.relay: RelayNode | None = None

    @property
    def node(self) -> str:
        return self.sink.node

    # -- Inbound ----------------------------------------------------------------------------------
    def start(self) -> RelayInbound:
        node = RelayNode(
            self.config, self, token=self.context.tokens, registry=self.context.registry
        )
        try:
            self.relay = node.start()
        except zmq.ZMQError as exc:
            raise listen_error("relay.bind", self.config.bind, exc) from exc
        return self

    def refusal(self, req: PrepareRequest) -> str:
        me = self.config.endpoint
        if req.relay_tree and me not in req.relay_tree:
            return f"this node's relay {me} is not in relay_tree"
        return ""

    def drain(self, attempt: str, timeout: float) -> list[str]:
        return self.relay.drain(attempt, timeout) if self.relay is not None else []

    def abort(self, attempt: str) -> None:
        if self.relay is not None:
            self.relay.abort(attempt)

    def forget(self, attempt: str) -> None:
        if self.relay is not None:
            self.relay.forget(attempt)

    def readiness(self) -> tuple[str, bool, str]:
        if self.relay is None:
            return ("relay", False, f"relay-tree node not started (relay.bind {self.config.bind})")
        return ("relay", True, f"relay-tree node bound at {self.relay.bound}")

    def routes(self) -> list[web.RouteDef]:
        return []  # frames arrive on the ROUTER, not over HTTP

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()

    # -- RelaySink --------------------------------------------------------------------------------
    def relay_tree(self, attempt: str) -> list[str]:
        """Read on every frame: the prepare's own list (or the configured one), not a copy."""
        req = self.sink.attempt_request(attempt)
        if req is None:
            return []
        return req.relay_tree or self.config.nodes

    def relay_mac_tree(self, attempt: str) -> list[str]:
        req = self.sink.attempt_request(attempt)
        return req.relay_mac_tree if req is not None and req.relay_tree else []

    def relay_check(self, meta: FrameMeta, *, probe: bool) -> Verdict | None:
        return self.sink.check(ident_of(meta), probe=probe)

    def relay_stage(
        self, meta: FrameMeta, body: memoryview, keep: object, children: int
    ) -> Verdict:
        claim = self.sink.claim(ident_of(meta), forwards=children)
        if isinstance(claim, tuple):
            return claim
        self.sink.stage(claim, body, verified=True, keep=keep)
        return (AckStatus.STAGED, "")

    def relay_release(self, meta: FrameMeta, error: str | None) -> None:
        self.sink.forwarded(ident_of(meta), error)

    def relay_end(self, meta: FrameMeta) -> Verdict:
        if meta.total is None:
            return (AckStatus.REJECTED, "END without a total")
        return self.sink.end(meta.attempt, meta.producer, meta.total)

    def relay_fail(self, attempt: str, reason: str) -> None:
        self.sink.fail(attempt, reason)
