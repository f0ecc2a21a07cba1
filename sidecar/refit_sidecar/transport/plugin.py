"""❹–❺ one transport, both sides: the base class every transport kind implements.

In the style of vLLM's model loaders: a small base class, one strategy per kind in its own
files, a registry (`transport.__init__`). A kind names
- its sending side: the settings model a producer is configured with (`sender_config`), the
  factory of its `Transport` (`sender`), and where one attempt's payloads go (`destination`:
  the relay tree's root, or the receivers that download; `at` fills it into the settings);
- its receiving side: the field of the receiver's settings that turns it on for a node
  (`receiver_field`: a node runs the inbound of every kind whose field is set) and the factory
  of its `Inbound` (`inbound`), which delivers into the node's one `PayloadSink`.

Nothing outside a kind's own files and the registry spells its name or its classes: the
producer, the receiver and the selector ask the registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

from pydantic import BaseModel

from refit_protocol.kit.tokens import TokenRing

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from refit_protocol.producer_api import AttemptPlan
    from refit_sidecar.transport.base import SendObserver, Transport
    from refit_sidecar.transport.inbound import Inbound, PayloadSink

#: Maps a plan's node names to the base URLs of their receivers (`TransportSelector`).
ReceiverUrls = Callable[[Sequence[str]], list[str]]
SenderT = TypeVar("SenderT", bound=BaseModel)
ReceiverT = TypeVar("ReceiverT", bound=BaseModel)


@dataclass(frozen=True)
class InboundContext:
    """What every inbound of a node shares: its name, its tokens (payload MACs, link keys),
    its metrics registry, and the node's limits for work the inbound runs itself."""

    node: str
    tokens: TokenRing
    registry: CollectorRegistry | None = None
    #: Threads fetching payloads the node must get itself (S3 downloads).
    workers: int = 4
    #: Retries of one fetch before the payload fails its attempt.
    retries: int = 3
    #: How long an offer over HTTP waits for room in the node's queue before it is told WAIT.
    offer_wait_s: float = 10.0


class TransportPlugin(ABC, Generic[SenderT, ReceiverT]):
    """A transport kind's two sides (one subclass per kind, registered by name)."""

    #: The name users write (`spec.transport`, `--transport`): `refit_protocol.transports`.
    kind: ClassVar[str]
    #: What `kuberefit` prints for it ("the ZeroMQ relay tree").
    title: ClassVar[str]
    #: The producer's settings model for this kind.
    sender_config: ClassVar[type[BaseModel]]
    #: The receiver settings field that holds this kind's node settings (None: off).
    receiver_field: ClassVar[str]
    #: Paths its inbound serves on the node's HTTP plane; a node without this kind answers
    #: them with a refusal naming the missing settings (not a bare 404).
    http_paths: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def sender(
        self,
        config: SenderT,
        *,
        observer: SendObserver | None = None,
        tokens: TokenRing | None = None,
    ) -> Transport:
        """One producer transport to the destination `config` names."""

    @abstractmethod
    def destination(
        self, template: SenderT, plan: AttemptPlan, receiver_urls: ReceiverUrls | None
    ) -> str:
        """Where `plan`'s payloads go, as one string (a producer keeps one transport per
        destination). Raises ValueError when the plan names none."""

    @abstractmethod
    def at(self, template: SenderT, destination: str) -> SenderT:
        """`template` with `destination` filled in."""

    @abstractmethod
    def inbound(self, settings: ReceiverT, sink: PayloadSink, context: InboundContext) -> Inbound:
        """The node's receiving side (not started)."""

    def probe(self, template: SenderT) -> str:
        """Why a producer configured with `template` cannot send ("": it can, as far as a
        cheap check shows); reported in its status, so the operator names the cause. Kinds
        whose medium needs no credentials check nothing."""
        return ""

    def leftovers(self, template: SenderT, attempt: str) -> None:
        """Delete what `attempt` left in a shared medium (objects), for a producer that no
        longer holds the attempt's transport (restarted since). Idempotent."""

    def listen_hosts(self, settings: ReceiverT) -> list[str]:
        """Hosts the inbound listens on besides the node's HTTP plane: the node refuses to
        start without a token unless every one is loopback."""
        return []
