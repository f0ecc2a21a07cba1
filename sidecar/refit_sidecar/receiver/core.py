"""One rollout node's receiver, assembled from its parts without any network listener.

- `node_state.NodeState`: what the node holds, under one condition variable;
- `intake.Intake`: ❺ payloads in (relay sink, S3 manifests), checked, deduplicated, staged;
- `apply_loop`: ❻ one thread per attempt applies the queue in declared order;
- `control.ReceiverControl`: the control state machine the coordinator drives;
- `absence`: what the node does when no coordinator calls any more.

`ReceiverNode` (`node.py`) adds the relay-tree node and the HTTP plane; tests use this in
process.
"""

from __future__ import annotations

from refit_sidecar.receiver.appliers.base import Applier
from refit_sidecar.receiver.config import ReceiverConfig
from refit_sidecar.receiver.control import ReceiverControl
from refit_sidecar.receiver.intake import Intake
from refit_sidecar.receiver.metrics import ReceiverMetrics
from refit_sidecar.receiver.node_state import NodeState
from refit_sidecar.transport.s3 import S3Fetcher


class ReceiverCore:
    """State, intake and control of one node, wired together."""

    def __init__(
        self,
        config: ReceiverConfig,
        applier: Applier,
        *,
        metrics: ReceiverMetrics | None = None,
        fetcher: S3Fetcher | None = None,
    ) -> None:
        self.config = config
        self.node = config.node
        self.applier = applier
        self.metrics = metrics or ReceiverMetrics()
        self.state = NodeState(config.node, config.held_version, applier, self.metrics)
        self.intake = Intake(self.state, config, fetcher)
        self.control = ReceiverControl(self.state, self.intake, config)

    def readiness(self) -> list[tuple[str, bool, str]]:
        """What `/readyz` reports: the applier's dependencies (an applier with
        `readiness_checks()`, e.g. the vLLM server and its refit extension; any other is ready
        once built) and, when configured, the relay-tree node. Blocking (it may ask the
        serving runtime): call it off the event loop."""
        checks = getattr(self.applier, "readiness_checks", None)
        if callable(checks):
            out: list[tuple[str, bool, str]] = list(checks())
        else:
            kind = self.config.applier.kind
            out = [("applier", True, f"{kind} applier {type(self.applier).__name__} built")]
        relay = self.config.relay
        if relay is not None:
            node = self.control.relay
            if node is None:
                out.append(
                    ("relay", False, f"relay-tree node not started (relay.bind {relay.bind})")
                )
            else:
                out.append(("relay", True, f"relay-tree node bound at {node.bound}"))
        absent = self.control.absence()
        if absent is not None:  # operator absence: out of service, or a gate reopened
            out.append(("coordinator", *absent))
        return out

    def close(self) -> None:
        self.control.close()
        self.intake.close()
