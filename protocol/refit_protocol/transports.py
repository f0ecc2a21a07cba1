"""The payload transports by name: one spelling for every layer.

A RefitPolicy's `spec.transport`, the sidecar's transport registry (`refit_sidecar.transport`),
`kuberefit demo --transport` and `kuberefit plan --transport` all take these names: `zmq`, the
ZeroMQ relay tree (each payload crosses the link between the clusters once, then the rollout
nodes forward it to one another), and `s3`, object storage (the producer uploads, every rollout
node downloads). `relay` was the plan's name for `zmq`; the plan still accepts it.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

TransportKind = Literal["zmq", "s3"]
#: Every kind, in the order help texts list them.
TRANSPORT_KINDS: tuple[TransportKind, ...] = get_args(TransportKind)
#: Earlier names still accepted where users typed them (the plan's `--transport relay`).
ALIASES: Final[dict[str, TransportKind]] = {"relay": "zmq"}

__all__ = ["ALIASES", "TRANSPORT_KINDS", "TransportKind"]
