"""The `zmq` transport kind: the ZeroMQ relay tree (paper §7.1). Each payload crosses the link
between the clusters once, to the attempt's root relay; the rollout nodes forward it to one
another down a balanced binary tree."""

from __future__ import annotations

from refit_protocol.kit.auth import endpoint_host
from refit_protocol.kit.tokens import TokenRing
from refit_protocol.producer_api import AttemptPlan
from refit_sidecar.transport.base import SendObserver, Transport
from refit_sidecar.transport.inbound import Inbound, PayloadSink
from refit_sidecar.transport.plugin import InboundContext, ReceiverUrls, TransportPlugin
from refit_sidecar.transport.relay.config import RelayConfig
from refit_sidecar.transport.relay.inbound import RelayInbound
from refit_sidecar.transport.relay.transport import RelayTransport, RelayTransportConfig


class RelayPlugin(TransportPlugin[RelayTransportConfig, RelayConfig]):
    kind = "zmq"
    title = "the ZeroMQ relay tree"
    sender_config = RelayTransportConfig
    receiver_field = "relay"

    def sender(
        self,
        config: RelayTransportConfig,
        *,
        observer: SendObserver | None = None,
        tokens: TokenRing | None = None,
    ) -> Transport:
        return RelayTransport(config, observer=observer, tokens=tokens)

    def destination(
        self,
        template: RelayTransportConfig,
        plan: AttemptPlan,
        receiver_urls: ReceiverUrls | None,
    ) -> str:
        """The plan's root relay (membership changes between attempts), else the template's."""
        root = plan.relay_tree[0] if plan.relay_tree else template.root
        if not root:
            raise ValueError(f"attempt {plan.attempt} names no relay tree")
        return root

    def at(self, template: RelayTransportConfig, destination: str) -> RelayTransportConfig:
        return template.model_copy(update={"root": destination})

    def inbound(self, settings: RelayConfig, sink: PayloadSink, context: InboundContext) -> Inbound:
        return RelayInbound(settings, sink, context)

    def listen_hosts(self, settings: RelayConfig) -> list[str]:
        """The CurveZMQ ROUTER's host and the MAC-only one's, if any."""
        binds = [settings.bind, *([settings.mac_bind] if settings.mac_bind else [])]
        return [endpoint_host(b) for b in binds]
