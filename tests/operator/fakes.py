"""Fault-injecting fakes of the coordinator's ports (named as fakes: they only inject faults the
real sidecars cannot produce on demand). Each fake receiver models its weights as a label:
the version it holds, "partial" after an interrupted apply, or "CORRUPT" when a mixed (XOR)
attempt is applied on top of bits other than the attempt's base version."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from refit_operator.ports import ReceiverClient, TransitionProgress
from refit_protocol.commit import CommitRecord
from refit_protocol.errors import EndpointError
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


@dataclass
class FakeReceiver:
    node: str
    bits: str = "v0"  # what the weights hold
    held_version: int | None = 0
    dead: bool = False
    reject_prepare: str = ""
    fail_flush_times: int = 0  # flushes that fail after a partial apply
    die_on_flush: bool = False
    #: Once dead, its container restarts in its pod: it answers again after this many calls
    #: (0: it stays dead), holding nothing (the fault the real part gives: tests/e2e).
    restarts_after: int = 0
    hang_flush_times: int = 0  # flushes that wait forever (a node waiting for a dead peer)
    #: A stop that arrives during an apply call answers only when the call ends, this long
    #: after the first stop (a vLLM rank waiting for a dead host's payload file); its status
    #: shows the attempt stopped meanwhile, as the real receiver's does.
    stop_drain_s: float = 0.0
    stops: int = 0  # stop calls received
    drained_at: float | None = None  # when the apply call a stop waits for ends (loop time)
    die_on_notice: bool = False  # dies after its flush, before the commit notice arrives
    reject_overwrite: str = ""  # rejects overwrite prepares (restarted between attempts)
    prewarmed: bool = True
    server: str | None = None  # a multi-host server's name, with this node's role in it
    server_role: Literal["leader", "host"] | None = None
    gate_closed: bool = False
    gate_released: str | None = None  # reopened its gate without a coordinator (absence)
    attempt: str | None = None
    mode: str = ""
    from_version: int = 0
    target: int = 0
    phase: str = "idle"
    log: list[str] = field(default_factory=list)
    prepares: list[PrepareRequest] = field(default_factory=list)

    def _alive(self) -> None:
        if self.dead and self.restarts_after > 0:
            self.restarts_after -= 1
            if self.restarts_after == 0:  # restarted: a new process, knowing no version
                self.dead, self.die_on_flush = False, False
                self.held_version, self.attempt, self.phase = None, None, "idle"
                self.prewarmed = False
        if self.dead:
            raise EndpointError(f"{self.node}: connection refused")

    @property
    def url(self) -> str:
        return f"http://{self.node}.invalid:9"  # never called: fakes take no payload offers

    async def status(self) -> ReceiverStatus:
        self._alive()
        return ReceiverStatus(
            node=self.node,
            held_version=self.held_version,
            attempt=self.attempt,
            phase=self.phase,
            gate_closed=self.gate_closed,
            prewarmed=self.prewarmed,
            gate_released=self.gate_released,
            server=self.server,
            server_role=self.server_role,
        )

    async def prepare(self, req: PrepareRequest) -> PrepareResponse:
        self._alive()
        self.log.append(f"prepare:{req.mode}")
        self.prepares.append(req)
        if self.reject_prepare:
            return PrepareResponse(node=self.node, accepted=False, reason=self.reject_prepare)
        if self.reject_overwrite and req.mode == "overwrite":
            return PrepareResponse(node=self.node, accepted=False, reason=self.reject_overwrite)
        if req.mode == "mixed" and self.bits != f"v{req.from_version}":
            return PrepareResponse(
                node=self.node, accepted=False, reason=f"holds {self.bits}, not v{req.from_version}"
            )
        self.attempt, self.mode, self.phase = req.attempt, req.mode, "prepared"
        self.from_version, self.target = req.from_version, req.target_version
        self.gate_released = None  # as the real receiver: a prepare clears the note
        return PrepareResponse(node=self.node, accepted=True, held_version=self.held_version)

    async def gate(self, req: GateRequest) -> None:
        self._alive()
        self.gate_closed = req.closed
        self.log.append("gate:" + ("close" if req.closed else "open"))

    async def open_apply(self, attempt: str) -> None:
        self._alive()
        if not self.gate_closed:  # as the real receiver (sync mode): apply only behind the gate
            raise EndpointError(f"{self.node}: the request gate is open: close it first")

    async def relay_flush(self, req: RelayFlushRequest) -> RelayFlushResponse:
        self._alive()
        return RelayFlushResponse(
            node=self.node, attempt=req.attempt, ok=True, staged=sum(req.expected.values())
        )

    async def flush(self, req: FlushRequest) -> FlushResponse:
        self._alive()
        assert req.attempt == self.attempt
        if self.hang_flush_times:
            self.hang_flush_times -= 1
            await asyncio.Event().wait()
        self.held_version = None
        if self.die_on_flush:
            self.bits, self.dead = "partial", True
            raise EndpointError(f"{self.node}: connection reset")
        if self.fail_flush_times:
            self.fail_flush_times -= 1
            self.bits = "partial"
            return FlushResponse(
                node=self.node,
                attempt=req.attempt,
                ok=False,
                applied=1,
                staged=2,
                errors=["apply failed after a partial write"],
            )
        if self.mode == "mixed" and self.bits != f"v{self.from_version}":
            self.bits = "CORRUPT"
        else:
            self.bits = f"v{self.target}"
        n = sum(req.expected.values())
        self.phase = "flushed"
        return FlushResponse(node=self.node, attempt=req.attempt, ok=True, applied=n, staged=n)

    async def stop(self, attempt: str) -> StopResponse:
        self._alive()
        self.stops += 1
        if self.attempt == attempt and self.phase != "flushed":
            self.phase = "stopped"
        if self.stop_drain_s:
            loop = asyncio.get_running_loop()
            if self.drained_at is None:
                self.drained_at = loop.time() + self.stop_drain_s
            await asyncio.sleep(max(0.0, self.drained_at - loop.time()))
        return StopResponse(node=self.node, attempt=attempt, drained=True)

    async def cleanup(self, attempt: str) -> None:
        self._alive()

    async def commit_notice(self, attempt: str, version: int) -> None:
        if self.die_on_notice:
            self.dead = True
        self._alive()
        self.held_version = version


@dataclass
class FakeProducer:
    producer: int
    fail_sends: int = 0
    lost_state: bool = False
    stall_sends: int = 0  # streams that never finish (their relay root died; ACKs never come)
    kill_on_stall: FakeReceiver | None = None  # ... because this receiver dies meanwhile
    baseline: CommitRecord = field(default_factory=lambda: CommitRecord(0, "b0"))
    started: list[AttemptPlan] = field(default_factory=list)
    updates: list[tuple[str, CommitRecord]] = field(default_factory=list)

    async def start(self, plan: AttemptPlan) -> None:
        self.started.append(plan)

    async def wait_sent(self, attempt: str) -> SentReport:
        if self.lost_state:
            raise EndpointError(f"producer {self.producer} lost its pending delta")
        if self.fail_sends:
            self.fail_sends -= 1
            raise EndpointError(f"producer {self.producer}: send failed")
        if self.stall_sends:
            self.stall_sends -= 1
            if self.kill_on_stall is not None:
                self.kill_on_stall.dead = True
            await asyncio.Event().wait()
        return SentReport(
            producer=self.producer,
            payloads=3,
            wire_bytes=3000,
            changed_elements=10,
            total_elements=1000,
        )

    async def stop_and_wait(self, attempt: str) -> None:
        pass

    async def cleanup(self, attempt: str) -> None:
        pass

    async def update_baseline(self, attempt: str, record: CommitRecord) -> None:
        self.updates.append((attempt, record))
        self.baseline = record


@dataclass
class FakeMembership:
    members: list[FakeReceiver]
    confirmed: set[str] = field(default_factory=set)
    hosts_gone: set[str] = field(default_factory=set)
    restored: list[str] = field(default_factory=list)

    async def receivers(self) -> list[ReceiverClient]:
        return list(self.members)

    async def relay_tree(self, nodes: Sequence[str]) -> list[str]:
        return [f"tcp://{n}" for n in nodes]

    async def relay_mac_tree(self, nodes: Sequence[str]) -> list[str]:
        return [f"tcp://{n}-mac" for n in nodes]

    async def confirmed_dead(self, node: str) -> bool:
        return node in self.confirmed

    async def host_gone(self, node: str) -> bool:
        return node in self.hosts_gone

    async def restore(self, receiver: ReceiverClient, record: CommitRecord) -> None:
        assert isinstance(receiver, FakeReceiver)
        await receiver.status()  # as the real one: a receiver that does not answer fails it
        receiver.bits, receiver.held_version = f"v{record.version}", record.version
        receiver.prewarmed, receiver.gate_closed = True, False  # as the real /v1/restore
        receiver.reject_overwrite = ""  # restored: it holds a known version again
        self.restored.append(receiver.node)


@dataclass
class RecordingSink:
    phases: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)
    notices: list[tuple[str, str]] = field(default_factory=list)

    async def update(self, progress: TransitionProgress) -> None:
        self.phases.append(progress.phase)
        self.messages.append(progress.message)
        self.notices = list(progress.notices)
