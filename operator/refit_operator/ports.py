"""What the coordinator talks to, as typed ports: producers, receivers, membership, progress.

Real implementations speak HTTP to the sidecars (or call them in-process in local mode); tests
plug in fault-injecting fakes. No payload bytes cross these ports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from refit_protocol.commit import AttemptMode, CommitRecord
from refit_protocol.producer_api import AttemptPlan, SentReport
from refit_protocol.receiver_api import (
    FlushRequest,
    FlushResponse,
    GateRequest,
    PrepareRequest,
    PrepareResponse,
    ReceiverStatus,
    RelayFlushRequest,
    RelayFlushResponse,
    StopResponse,
)


class ProducerClient(Protocol):
    @property
    def producer(self) -> int: ...

    async def start(self, plan: AttemptPlan) -> None:
        """Begin streaming the attempt (compare + encode + send), returns at once."""
        ...

    async def wait_sent(self, attempt: str) -> SentReport:
        """Wait until the producer sent its last payload; raises EndpointError on failure."""
        ...

    async def stop_and_wait(self, attempt: str) -> None: ...

    async def cleanup(self, attempt: str) -> None: ...

    async def update_baseline(self, attempt: str, record: CommitRecord) -> None:
        """Apply the pending delta to the baseline now that `record` names its version."""
        ...


class ReceiverClient(Protocol):
    @property
    def node(self) -> str: ...

    @property
    def url(self) -> str:
        """Base URL of the node's control plane (where producers announce S3 payloads)."""
        ...

    async def status(self) -> ReceiverStatus: ...

    async def prepare(self, req: PrepareRequest) -> PrepareResponse: ...

    async def gate(self, req: GateRequest) -> None: ...

    async def open_apply(self, attempt: str) -> None: ...

    async def relay_flush(self, req: RelayFlushRequest) -> RelayFlushResponse: ...

    async def flush(self, req: FlushRequest) -> FlushResponse: ...

    async def stop(self, attempt: str) -> StopResponse:
        """mark_obsolete + stop_and_wait on this node: drop the attempt, drain its writes."""
        ...

    async def cleanup(self, attempt: str) -> None: ...

    async def commit_notice(self, attempt: str, version: int) -> None: ...


class Membership(Protocol):
    """Which receivers take part; changes only between attempts."""

    async def receivers(self) -> list[ReceiverClient]: ...

    async def confirmed_dead(self, node: str) -> bool:
        """True once the node's process and pending writes cannot resume (safe to retire)."""
        ...

    async def host_gone(self, node: str) -> bool:
        """True when the node's host is gone or replaced (its pod deleted or recreated), not
        only its receiver process: what a restarted receiver drove there (a multi-host
        server's vLLM ranks) is gone too. False where this cannot be known."""
        ...

    async def restore(self, receiver: ReceiverClient, record: CommitRecord) -> None:
        """Dense refit of a new or restarted receiver to the committed version, then prewarm."""
        ...

    async def relay_tree(self, nodes: Sequence[str]) -> list[str]:
        """Relay endpoints of `nodes`, in tree order (empty when the transport has no tree)."""
        ...

    async def relay_mac_tree(self, nodes: Sequence[str]) -> list[str]:
        """The MAC-only relay endpoints of the same nodes, in the same order ("" for a node
        without one; empty when none has one or there is no tree)."""
        ...


class ProgressSink(Protocol):
    async def update(self, progress: TransitionProgress) -> None: ...


@dataclass
class TransitionProgress:
    """What `kubectl get refittransitions` and the demo's progress line show."""

    policy: str
    from_version: int
    to_version: int
    phase: str = "Pending"
    attempt: int = 0
    attempt_id: str = ""
    mode: AttemptMode = "mixed"
    payloads: int = 0
    wire_bytes: int = 0
    changed_elements: int = 0
    total_elements: int = 0
    message: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    #: What nodes reported when they joined, for a sink to announce once each: (reason,
    #: "node: text"), e.g. GateReleased, a request gate reopened without a coordinator.
    notices: list[tuple[str, str]] = field(default_factory=list)
