"""One rollout node's receiver, assembled from its parts without any network listener.

- `node_state.NodeState`: what the node holds, under one condition variable;
- `intake.Intake`: ❺ payloads in (relay sink, S3 manifests), checked, deduplicated, staged;
- `apply_loop`: ❻ one thread per attempt applies the queue in declared order;
- `control.ReceiverControl`: the control state machine the coordinator drives.

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

    def close(self) -> None:
        self.control.close()
        self.intake.close()
