"""❹ deliver, ❺ receive: the transports that carry payloads from producers to receivers.

Each kind is one plug-in with two sides (`plugin.TransportPlugin`): the producer's `Transport`
(`base`) and the `Inbound` every rollout node runs, which delivers into the node's one
transport-neutral sink (`inbound.PayloadSink`, the receiver's intake).

- `relay/`: `zmq`, the ZeroMQ relay tree (frames, tree geometry, one hop's dealer, the relay
  node, the producer's transport into the tree's root, the node's inbound);
- `s3/`: `s3`, object storage with manifest pointers (store, sender, inbound);
- `window`: the send window both senders share; `selector`: a producer's transport per attempt.

This module is the registry: `PLUGINS` maps each name `refit_protocol.transports` spells to the
class that implements it, imported only when asked for (importing this package pulls in
neither pyzmq nor boto3). Adding a transport adds one line here, its name there, and its own
files (docs/architecture.md, "Adding a transport").
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from refit_protocol.kit.tokens import TokenRing
from refit_protocol.transports import TRANSPORT_KINDS, TransportKind
from refit_sidecar.transport.base import SendObserver, Transport, TransportSummary

if TYPE_CHECKING:
    from pydantic import BaseModel

    from refit_sidecar.transport.plugin import TransportPlugin

__all__ = [
    "KINDS",
    "PLUGINS",
    "Kind",
    "SendObserver",
    "Transport",
    "TransportSummary",
    "by_kind",
    "for_sender",
    "make",
    "plugins",
]

Kind = TransportKind
KINDS: tuple[Kind, ...] = TRANSPORT_KINDS

#: Every kind's plug-in, as "module:Class".
PLUGINS: dict[str, str] = {
    "zmq": "refit_sidecar.transport.relay.plugin:RelayPlugin",
    "s3": "refit_sidecar.transport.s3.plugin:S3Plugin",
}


@functools.cache
def by_kind(kind: str) -> TransportPlugin[Any, Any]:
    """The plug-in of `kind` (imported on first use)."""
    try:
        where = PLUGINS[kind]
    except KeyError:
        raise ValueError(f"unknown transport kind {kind!r}; known: {', '.join(PLUGINS)}") from None
    module, _, name = where.partition(":")
    made: TransportPlugin[Any, Any] = getattr(importlib.import_module(module), name)()
    if made.kind != kind:
        raise ValueError(f"{where} implements {made.kind!r}, registered as {kind!r}")
    return made


def plugins() -> Iterator[TransportPlugin[Any, Any]]:
    """Every registered kind's plug-in, in registry order."""
    return (by_kind(kind) for kind in PLUGINS)


def for_sender(config: BaseModel) -> TransportPlugin[Any, Any]:
    """The plug-in whose sending side `config` configures."""
    for p in plugins():
        if isinstance(config, p.sender_config):
            return p
    raise TypeError(f"no transport is configured by {type(config).__name__}")


def make(
    kind: Kind,
    config: BaseModel,
    *,
    observer: SendObserver | None = None,
    tokens: TokenRing | None = None,
) -> Transport:
    """One producer transport of `kind` from its configuration model. `tokens`: the process's
    token ring, followed across rotations (instead of the config's fixed `token`)."""
    p = by_kind(kind)
    if not isinstance(config, p.sender_config):
        raise TypeError(
            f"transport {kind!r} needs a {p.sender_config.__name__}, got {type(config).__name__}"
        )
    return p.sender(config, observer=observer, tokens=tokens)
