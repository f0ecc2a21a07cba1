"""❺ the receiving side of a transport, and the one sink every transport delivers into.

A transport has two sides (`plugin.TransportPlugin`): the producer's `base.Transport` and an
`Inbound` every rollout node runs (the relay tree's node, the S3 downloads). An inbound turns
what arrives (relay frames, manifest pointers to objects) into a `PayloadIdent` and bytes and
hands both to the node's `PayloadSink`, the receiver's intake, which decides admission,
deduplicates and stages. The sink never learns how bytes travelled; an inbound never learns
how they are applied.

A delivery is claimed first (`claim`: admitted, deduplicated and counted against the
producer's quota, atomically), then its bytes are staged (`stage`) or the claim is withdrawn.
The relay claims and stages a received frame at once; the S3 inbound claims a manifest entry,
downloads, then stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from refit_protocol.compat import StrEnum

if TYPE_CHECKING:
    from aiohttp import web

    from refit_protocol.receiver_api import PrepareRequest


class AckStatus(StrEnum):
    """What a receiver did with a payload offer (a relay frame, a probe, a manifest entry)."""

    STAGED = "staged"  # registered, local staging and child forwards submitted (the staged ACK)
    DUPLICATE = "duplicate"  # same id and digest seen before: ignored, acknowledged again
    WAIT = "wait"  # queue full: not taken, offer it again later (backpressure)
    READY = "ready"  # answer to a probe: send the body now
    OBSOLETE = "obsolete"  # a later prepare replaced the attempt (or it was stopped): dropped
    UNKNOWN_ATTEMPT = "unknown_attempt"  # not prepared here (yet): retry a little later
    REJECTED = "rejected"  # failed a check; the attempt has failed on this node


#: A receiver's answer to a payload offer: what happened, and why when it was refused.
Verdict = tuple[AckStatus, str]


@dataclass(frozen=True)
class PayloadIdent:
    """What arrives with a payload, before its bytes are trusted."""

    attempt: str
    producer: int
    payload_id: int
    order: int
    digest: bytes
    size: int

    def label(self) -> str:
        return f"{self.producer}/{self.payload_id} (order {self.order})"


class Claim(Protocol):
    """A payload the sink admitted and registered (`PayloadSink.claim`); opaque otherwise."""

    @property
    def ident(self) -> PayloadIdent: ...


class PayloadSink(Protocol):
    """What an inbound hands payloads to (implemented by the receiver's `Intake`)."""

    @property
    def node(self) -> str:
        """This node's name (in logs and answers)."""
        ...

    def attempt_request(self, attempt: str) -> PrepareRequest | None:
        """The prepare of `attempt` when it is the node's current attempt (routing: the relay
        tree it names), else None."""
        ...

    def check(self, ident: PayloadIdent, *, probe: bool) -> Verdict | None:
        """Cheap pre-check of an offer; None: new and admissible now (READY for a probe)."""
        ...

    def claim(self, ident: PayloadIdent, *, forwards: int = 0) -> Verdict | Claim:
        """Admit and register an offer atomically, or the verdict refusing it. `forwards`: how
        many child forwards will report back through `forwarded` before it is released."""
        ...

    def stage(
        self, claim: Claim, body: bytes | memoryview, *, verified: bool, keep: object = None
    ) -> None:
        """Queue a claimed payload's bytes for validation and staging (returns at once).
        `verified`: the inbound already checked identity, size and MAC or digest against the
        claim; otherwise the sink does. `keep` keeps a zero-copy receive buffer alive."""
        ...

    def live(self, claim: Claim) -> bool:
        """Whether the claim's attempt still wants its bytes."""
        ...

    def withdraw(self, claim: Claim, reason: str | None) -> None:
        """Give a claim up: `reason` None, quietly (its attempt is over); else its delivery
        failed, which fails the attempt on this node."""
        ...

    def forwarded(self, ident: PayloadIdent, error: str | None) -> None:
        """One child forward of a claimed payload finished (error: it failed)."""
        ...

    def end(self, attempt: str, producer: int, total: int) -> Verdict:
        """A producer's stream of `attempt` is complete with `total` payloads."""
        ...

    def fail(self, attempt: str, reason: str) -> None:
        """Something that arrived for `attempt` failed a check: the attempt fails here."""
        ...


@runtime_checkable
class Inbound(Protocol):
    """The receiving side of one transport on one node (made by its plug-in, driven by the
    node's control calls)."""

    kind: str

    def start(self) -> Inbound:
        """Bind, connect or start threads; raise a one-line `ConfigError` when it cannot."""
        ...

    def refusal(self, req: PrepareRequest) -> str:
        """Why this node cannot take part in `req` over this transport ("" admits)."""
        ...

    def drain(self, attempt: str, timeout: float) -> list[str]:
        """The arrival barrier's wait: transport work of `attempt` this node still owes
        (forwards to children) is done or failed; returns the errors seen."""
        ...

    def abort(self, attempt: str) -> None:
        """Stop moving `attempt`'s payloads now (stop, or a replacing prepare)."""
        ...

    def forget(self, attempt: str) -> None:
        """Drop everything kept about `attempt` (cleanup)."""
        ...

    def readiness(self) -> tuple[str, bool, str]:
        """One `/readyz` check: (name, ok, detail)."""
        ...

    def routes(self) -> list[web.RouteDef]:
        """HTTP routes this inbound serves on the node's authenticated control plane."""
        ...

    def close(self) -> None: ...


__all__ = ["AckStatus", "Claim", "Inbound", "PayloadIdent", "PayloadSink", "Verdict"]
