"""❺ validate: one payload's bytes checked, decoded once, classified and handed to the applier.

The sync path (decode as payloads arrive) and the async path (decode after the gate closes) both
end here, so a payload is decompressed and parsed exactly once on its way to the weights: the
applier receives the decoded items (in process) or writes them for the vLLM workers to read
(`codec.decoded_file`).
"""

from __future__ import annotations

from collections.abc import Mapping

from refit_sidecar.codec.decode import MacKeys, decode_payload
from refit_sidecar.codec.errors import HeaderMismatch
from refit_sidecar.codec.records import Op, TensorMeta
from refit_sidecar.codec.wire import DecodedPayload, peek_header
from refit_sidecar.receiver.appliers.base import Applier, StagedPayload
from refit_sidecar.receiver.errors import ReceptionError
from refit_sidecar.transport.inbound import PayloadIdent


def check_identity(body: bytes | memoryview, ident: PayloadIdent) -> None:
    """The payload's plain header names what it was announced as (before anything else)."""
    h = peek_header(body)
    if (h.attempt, h.producer, h.payload_id, h.order) != (
        ident.attempt,
        ident.producer,
        ident.payload_id,
        ident.order,
    ):
        raise HeaderMismatch("payload header differs from its announced identity")


def classify(
    decoded: DecodedPayload, xor_incompatible: frozenset[str], unsupported: Mapping[str, str]
) -> None:
    """Loader classification from prewarm: fail closed on unsupported names and XOR misuse."""
    for item in decoded.items:
        name = item.meta.name
        if name in unsupported:
            raise ReceptionError(
                f"{name}: the native loader cannot take it here ({unsupported[name]})"
            )
        if item.op is Op.XOR and name in xor_incompatible:
            raise ReceptionError(f"{name}: XOR item for a tensor prewarm found XOR-incompatible")


def decode_and_stage(
    body: bytes | memoryview,
    ident: PayloadIdent,
    *,
    metas: Mapping[str, TensorMeta],
    xor_incompatible: frozenset[str],
    unsupported: Mapping[str, str],
    applier: Applier,
    hashed: bool = False,
    mac_key: MacKeys = None,
    raw_limit: int | None = None,
) -> StagedPayload:
    """Decode (MAC, digest, limits, schema, canonical metadata), classify, stage. Raises a
    `CodecError` or `ReceptionError` for a payload the attempt must fail on. `hashed`: the
    caller already checked that these bytes hash to `ident.digest` (not hashed again).
    `mac_key`: the node's key(s) (from its token); the payload must then carry a MAC made with one
    (`AuthenticationError` before anything is decompressed). None (a node without a token)
    accepts payloads with or without a MAC."""
    decoded = decode_payload(
        body,
        expected_digest=ident.digest,
        body_hash=ident.digest if hashed else None,
        known=metas,
        mac_key=mac_key,
        raw_limit=raw_limit,
    )
    classify(decoded, xor_incompatible, unsupported)
    return applier.stage(decoded)
