"""❹ deliver: transports that carry payloads from producers to receivers (`base.Transport`).

- `relay/`: the ZeroMQ relay tree (frames, tree geometry, the dealer of one hop, the relay node
  every receiver runs, the producer's transport into the tree's root);
- `s3`: object storage with manifest pointers (producer upload, receiver fetch);
- `window`: the send window both share; `selector`: a producer's transport per attempt.

`make(kind, config)` is the registry: "zmq" (`RelayTransportConfig`) or "s3"
(`S3TransportConfig`), the names `refit_protocol.transports` spells for every layer. Both kinds
are imported only when made, so importing this package pulls in neither pyzmq nor boto3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from refit_protocol.kit.tokens import TokenRing
from refit_protocol.transports import TRANSPORT_KINDS, TransportKind
from refit_sidecar.transport.base import SendObserver, Transport, TransportSummary

if TYPE_CHECKING:
    from pydantic import BaseModel

__all__ = ["KINDS", "Kind", "SendObserver", "Transport", "TransportSummary", "make"]

Kind = TransportKind
KINDS: tuple[Kind, ...] = TRANSPORT_KINDS


def make(
    kind: Kind,
    config: BaseModel,
    *,
    observer: SendObserver | None = None,
    tokens: TokenRing | None = None,
) -> Transport:
    """One producer transport of `kind` from its configuration model. `tokens`: the process's
    token ring, followed across rotations (instead of the config's fixed `token`)."""
    if kind == "zmq":
        from refit_sidecar.transport.relay.transport import RelayTransport, RelayTransportConfig

        if not isinstance(config, RelayTransportConfig):
            raise TypeError(f"transport 'zmq' needs a RelayTransportConfig, got {config!r}")
        return RelayTransport(config, observer=observer, tokens=tokens)
    if kind == "s3":
        from refit_sidecar.transport.s3 import S3Transport, S3TransportConfig

        if not isinstance(config, S3TransportConfig):
            raise TypeError(f"transport 's3' needs an S3TransportConfig, got {config!r}")
        if observer is not None:
            raise ValueError("the S3 transport reports no send intervals")
        return S3Transport(config, tokens=tokens)
    raise ValueError(f"unknown transport kind {kind!r}; known: {', '.join(KINDS)}")
