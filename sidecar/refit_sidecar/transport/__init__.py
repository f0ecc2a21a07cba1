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
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, BeforeValidator, PlainSerializer, SerializationInfo

from refit_protocol.kit.config_files import KindChoice
from refit_protocol.kit.tokens import TokenRing
from refit_protocol.transports import TransportKind
from refit_sidecar.transport.base import SendObserver, Transport, TransportSummary

if TYPE_CHECKING:
    from refit_sidecar.transport.plugin import TransportPlugin

__all__ = [
    "PLUGINS",
    "SendObserver",
    "SenderSettings",
    "Transport",
    "TransportSummary",
    "by_kind",
    "for_sender",
    "make",
    "plugins",
]

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
    kind: TransportKind,
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


def _sender_settings(value: Any) -> Any:
    """A producer's transport settings as a settings file spells them: `kind` (default
    `zmq`) names the plug-in whose `sender_config` validates the rest."""
    if isinstance(value, BaseModel):
        try:
            for_sender(value)  # a model of no registered kind is refused
        except TypeError as exc:
            raise ValueError(str(exc)) from None
        return value
    if not isinstance(value, dict):
        raise ValueError("transport settings must be an object with a `kind`")
    data = dict(value)
    kind = data.pop("kind", "zmq")
    return by_kind(str(kind)).sender_config.model_validate(data)


def _with_kind(value: BaseModel, info: SerializationInfo) -> dict[str, Any]:
    """The settings' own fields (not the declared `BaseModel`'s, which has none) and `kind`."""
    mode = "json" if info.mode_is_json() else "python"
    out = value.model_dump(mode=mode, by_alias=info.by_alias, exclude_none=info.exclude_none)
    return {"kind": for_sender(value).kind, **out}


def _sender_models() -> dict[str, type[BaseModel]]:
    return {p.kind: p.sender_config for p in plugins()}


#: A settings field holding one producer transport's settings, of any registered kind: read
#: from `{"kind": "s3", ...}` (no `kind`: `zmq`), written back with its `kind`.
SenderSettings = Annotated[
    BaseModel,
    BeforeValidator(_sender_settings),
    PlainSerializer(_with_kind),
    KindChoice(_sender_models, "zmq"),
]
