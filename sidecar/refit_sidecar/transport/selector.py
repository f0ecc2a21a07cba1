"""A producer's transport for each attempt: where its payloads go is named by the attempt plan.

On the relay tree a producer sends to the tree's root, which the coordinator names per attempt
(`AttemptPlan.relay_tree[0]`, since membership changes between attempts); over S3 it announces
each payload to the attempt's receivers. One transport is made per destination (`transport.make`)
and reused by later attempts to the same place; `close` closes them all.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from refit_protocol.kit.tokens import TokenRing
from refit_protocol.producer_api import AttemptPlan
from refit_sidecar.transport import Kind, make
from refit_sidecar.transport.base import SendObserver, Transport
from refit_sidecar.transport.relay.transport import RelayTransportConfig
from refit_sidecar.transport.s3 import S3TransportConfig

ReceiverUrls = Callable[[Sequence[str]], list[str]]


class TransportSelector:
    """Callable as `ProducerService`'s transport factory: `selector(plan) -> Transport`.

    `template` holds every setting but the destination: its `root` (relay) is used when a plan
    names no relay tree ("" refuses such plans); its `receivers` (S3) when no `receiver_urls`
    resolver is given, else the resolver maps the plan's node names to their URLs."""

    def __init__(
        self,
        template: RelayTransportConfig | S3TransportConfig,
        *,
        receiver_urls: ReceiverUrls | None = None,
        observer: SendObserver | None = None,
        tokens: TokenRing | None = None,
    ) -> None:
        self.template = template
        self._tokens = tokens
        self.kind: Kind = "zmq" if isinstance(template, RelayTransportConfig) else "s3"
        self._receiver_urls = receiver_urls
        self._observer = observer
        self._made: dict[str, Transport] = {}
        self._lock = threading.Lock()

    def __call__(self, plan: AttemptPlan) -> Transport:
        if isinstance(self.template, RelayTransportConfig):
            root = plan.relay_tree[0] if plan.relay_tree else self.template.root
            if not root:
                raise ValueError(f"attempt {plan.attempt} names no relay tree")
            return self.to(root)
        urls = (
            self._receiver_urls(plan.receivers)
            if self._receiver_urls is not None
            else list(self.template.receivers)
        )
        return self.to(" ".join(urls))

    def to(self, destination: str) -> Transport:
        """The transport to `destination`: a root relay endpoint, or space-separated receiver
        URLs (made on first use)."""
        with self._lock:
            if destination not in self._made:
                field = "root" if self.kind == "zmq" else "receivers"
                value = destination if self.kind == "zmq" else destination.split()
                config = self.template.model_copy(update={field: value})
                self._made[destination] = make(
                    self.kind, config, observer=self._observer, tokens=self._tokens
                )
            return self._made[destination]

    def close(self) -> None:
        with self._lock:
            made, self._made = list(self._made.values()), {}
        for t in made:  # `close` is not a Transport call: both kinds have one
            close = getattr(t, "close", None)
            if close is not None:
                close()
