"""One rollout node's receiver, assembled from its parts without any network listener.

- `node_state.NodeState`: what the node holds, under one condition variable;
- `intake.Intake`: ❺ payloads in (the sink of every transport's inbound), checked,
  deduplicated, staged;
- `apply_loop`: ❻ one thread per attempt applies the queue in declared order;
- `control.ReceiverControl`: the control state machine the coordinator drives;
- `absence`: what the node does when no coordinator calls any more.

`open_inbounds` makes the receiving side of every transport the settings turn on (the
relay-tree node, the S3 downloads: `transport.plugin`); `ReceiverNode` (`node.py`) starts them
and adds the HTTP plane. Tests use the core in process.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from refit_protocol.kit.tokens import TokenRing
from refit_sidecar import transport
from refit_sidecar.receiver.appliers.base import Applier
from refit_sidecar.receiver.config import ReceiverConfig
from refit_sidecar.receiver.control import ReceiverControl
from refit_sidecar.receiver.intake import Intake
from refit_sidecar.receiver.metrics import ReceiverMetrics
from refit_sidecar.receiver.node_state import NodeState
from refit_sidecar.transport.inbound import Inbound
from refit_sidecar.transport.plugin import InboundContext, TransportPlugin


def receiving(config: ReceiverConfig) -> list[tuple[TransportPlugin[Any, Any], BaseModel]]:
    """Each transport this node receives over, with its settings (its field is set)."""
    out = []
    for plugin in transport.plugins():
        settings = getattr(config, plugin.receiver_field, None)
        if settings is not None:
            out.append((plugin, settings))
    return out


class ReceiverCore:
    """State, intake and control of one node, wired together."""

    def __init__(
        self,
        config: ReceiverConfig,
        applier: Applier,
        *,
        metrics: ReceiverMetrics | None = None,
    ) -> None:
        self.config = config
        self.node = config.node
        self.applier = applier
        self.metrics = metrics or ReceiverMetrics()
        self.state = NodeState(config.node, config.held_version, applier, self.metrics)
        self.intake = Intake(self.state, config)
        #: The receiving side of each transport this node runs (`open_inbounds`).
        self.inbounds: list[Inbound] = []
        self.control = ReceiverControl(self.state, self.intake, config, self.inbounds)

    def open_inbounds(self, tokens: TokenRing) -> list[Inbound]:
        """Make (not start) the inbound of every transport whose settings field is set."""
        context = InboundContext(
            node=self.node,
            tokens=tokens,
            registry=self.metrics.registry,
            workers=self.config.download_workers,
            retries=self.config.download_retries,
            offer_wait_s=self.config.manifest_wait_s,
        )
        for plugin, settings in receiving(self.config):
            self.inbounds.append(plugin.inbound(settings, self.intake, context))
        return self.inbounds

    def readiness(self) -> list[tuple[str, bool, str]]:
        """What `/readyz` reports: the applier's dependencies (an applier with
        `readiness_checks()`, e.g. the vLLM server and its refit extension; any other is ready
        once built) and each inbound (the relay-tree node bound, the S3 downloads started).
        Blocking (it may ask the serving runtime): call it off the event loop."""
        checks = getattr(self.applier, "readiness_checks", None)
        if callable(checks):
            out: list[tuple[str, bool, str]] = list(checks())
        else:
            kind = self.config.applier.kind
            out = [("applier", True, f"{kind} applier {type(self.applier).__name__} built")]
        out.extend(inbound.readiness() for inbound in self.inbounds)
        absent = self.control.absence()
        if absent is not None:  # operator absence: out of service, or a gate reopened
            out.append(("coordinator", *absent))
        return out

    def close(self) -> None:
        self.control.close()
        for inbound in self.inbounds:
            inbound.close()
        self.intake.close()
