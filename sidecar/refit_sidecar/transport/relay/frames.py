"""ZeroMQ relay-tree frames: `[kind, JSON metadata, body]`, authenticated per link (`LinkSecurity`).

Two kinds of link carry them. A CurveZMQ link (`curve`: the link between the clusters, and every
link when a policy asks for encryption) is encrypted and mutually authenticated by the policy's
keys, and the metadata carries the token. A MAC-only link (`mac`: relay to relay inside the
rollout cluster, by default) is plain TCP: the metadata carries no token, and a frame is
`[kind, metadata, tag, body]` where `tag` is a keyed BLAKE3 of the kind and the metadata bytes
(`frame_tag`, key `refit_protocol.keys.frame_mac_key`); answers carry a tag the same way. The
body is sealed by its own payload MAC, checked before it is staged or forwarded.

Kinds sent to a relay (DEALER -> ROUTER):
- `DATA`  — one payload: metadata names it (attempt, producer, payload id, order, digest, size),
  the body frame carries the payload's wire bytes unchanged;
- `PROBE` — the same metadata without a body: "may I send it now?" after a WAIT;
- `END`   — a producer's stream of the attempt is complete with `total` payloads.
A relay answers each with one `ACK` frame pair `[b"ACK", JSON]` whose `status` says what it did.
Metadata is parsed with pydantic from bounded JSON; bodies are never unpickled, only hashed and
decoded by the codec.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from typing import Literal

import blake3
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from refit_protocol.compat import StrEnum
from refit_protocol.keys import frame_mac_key
from refit_sidecar.codec.decode import MacKeys, mac_keys, verify_mac
from refit_sidecar.codec.errors import CodecError, DigestMismatch, HeaderMismatch
from refit_sidecar.codec.wire import (
    MAX_ATTEMPT_BYTES,
    EncodedPayload,
    body_digest,
    read_preamble,
)
from refit_sidecar.transport.inbound import AckStatus, Verdict

DATA = b"DATA"
PROBE = b"PROBE"
END = b"END"
ACK = b"ACK"
REQUEST_KINDS = (DATA, PROBE, END)
#: Metadata larger than this is malformed (the real thing is a few hundred bytes).
MAX_META_BYTES = 16 << 10
#: Bytes of a frame tag on a MAC-only link (keyed BLAKE3's default output).
TAG_SIZE = 32


class LinkSecurity(StrEnum):
    """How one relay link is protected (docs/security.md, "Links")."""

    CURVE = "curve"  # CurveZMQ: encrypted and mutually authenticated; the frames carry the token
    MAC = "mac"  # plain TCP: every frame and answer tagged (keyed BLAKE3), payloads readable


FINAL_OK = frozenset({AckStatus.STAGED, AckStatus.DUPLICATE})


class FrameMeta(BaseModel):
    """Identity of a DATA/PROBE/END frame. `root` is set by the root relay for its subtree."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = 1
    attempt: str = Field(min_length=1, max_length=MAX_ATTEMPT_BYTES)
    producer: int = Field(ge=0, lt=1 << 32)
    payload_id: int = Field(default=0, ge=0, lt=1 << 64)
    order: int = Field(default=0, ge=0, lt=1 << 64)
    digest: str = Field(default="", pattern=r"^([0-9a-f]{32})?$")
    size: int = Field(default=0, ge=0)
    total: int | None = Field(default=None, ge=0)  # END only
    root: int | None = Field(default=None, ge=0)  # tree root index, set by the root relay
    token: str = Field(default="", max_length=4096)

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.attempt, self.producer, self.payload_id)

    @classmethod
    def of(cls, payload: EncodedPayload) -> FrameMeta:
        """The DATA metadata that announces `payload` (identity, digest, size)."""
        h = payload.header
        return cls(
            attempt=h.attempt,
            producer=h.producer,
            payload_id=h.payload_id,
            order=h.order,
            digest=payload.digest.hex(),
            size=payload.size,
        )


class AckMeta(BaseModel):
    """A relay's answer to one frame; echoes the identity so a DEALER can match it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["DATA", "END"]
    attempt: str
    producer: int
    payload_id: int = 0
    digest: str = ""  # echoed, so retries of other bytes under the same id stay distinct
    status: AckStatus
    error: str = ""
    node: str = ""
    token: str = Field(default="", max_length=4096)


def parse_meta(raw: bytes | memoryview) -> FrameMeta | None:
    """Metadata of an incoming frame, or None if it is malformed (the frame is dropped)."""
    if len(raw) > MAX_META_BYTES:
        return None
    try:
        return FrameMeta.model_validate_json(bytes(raw))
    except ValidationError:
        return None


def parse_ack(raw: bytes | memoryview) -> AckMeta | None:
    if len(raw) > MAX_META_BYTES:
        return None
    try:
        return AckMeta.model_validate_json(bytes(raw))
    except ValidationError:
        return None


def frame_tag(key: bytes, kind: bytes, meta: bytes | memoryview) -> bytes:
    """The tag of one frame or answer on a MAC-only link: keyed BLAKE3 of `kind`, a zero byte
    and the metadata bytes as sent. The kind is inside, so a request's tag never passes as an
    answer's; the metadata names the attempt, so a tag never passes in another attempt."""
    h = blake3.blake3(key=key)
    h.update(kind)
    h.update(b"\0")
    h.update(meta)
    return h.digest()


def sign_frame(token: str | None, kind: bytes, meta: bytes | memoryview) -> bytes:
    """The tag frame for `token` (empty without a token: a loopback setup that authenticates
    nothing, like a plain link without Curve)."""
    return frame_tag(frame_mac_key(token), kind, meta) if token else b""


def tag_verifies(
    tokens: Sequence[str], kind: bytes, meta: bytes | memoryview, tag: bytes | memoryview
) -> bool:
    """True when `tag` is `frame_tag` of the frame under the key of any of `tokens` (the
    accepted ones, several during a rotation), compared in constant time; True without any
    token (nothing is authenticated there)."""
    if not tokens:
        return True
    if len(tag) != TAG_SIZE:
        return False
    given = bytes(tag)
    return any(hmac.compare_digest(frame_tag(frame_mac_key(t), kind, meta), given) for t in tokens)


def verify_body(
    meta: FrameMeta, body: bytes | bytearray | memoryview, *, mac_key: MacKeys = None
) -> None:
    """Check that `body` is the payload `meta` names: its MAC (with the policy's key: before
    anything else, so forged bytes are neither staged nor forwarded), identity, size, digest.

    With a MAC key the digest is not computed again: the MAC covers the preamble's digest and
    every compressed byte, so once it verifies, the announced digest only has to equal the
    preamble's. Hashing the body once more (BLAKE2b, ~1 GB/s per core) on every hop would
    cost more than the MAC itself (keyed BLAKE3, several GB/s) and prove nothing new. Without
    a key (no token: loopback only) the digest is the integrity check and is recomputed.

    Raises `CodecError` (AuthenticationError for a missing or wrong MAC, DigestMismatch for
    corrupted bytes). The full decode with schema and canonical-metadata checks happens in the
    receiver before the payload is queued.
    """
    mv = memoryview(body).cast("B")
    if meta.size and len(mv) != meta.size:
        raise DigestMismatch(f"body has {len(mv)} bytes, metadata says {meta.size}")
    keys = mac_keys(mac_key)
    if keys:
        verify_mac(mv, keys)
    pre = read_preamble(mv)
    header = pre.header
    if (header.attempt, header.producer, header.payload_id, header.order) != (
        meta.attempt,
        meta.producer,
        meta.payload_id,
        meta.order,
    ):
        raise HeaderMismatch("payload header differs from the frame metadata")
    digest = pre.digest if keys else body_digest(mv)
    if digest.hex() != meta.digest:
        raise DigestMismatch("payload body does not match the announced BLAKE2b-128 digest")


__all__ = [
    "ACK",
    "DATA",
    "END",
    "FINAL_OK",
    "PROBE",
    "REQUEST_KINDS",
    "TAG_SIZE",
    "AckMeta",
    "AckStatus",
    "CodecError",
    "FrameMeta",
    "LinkSecurity",
    "Verdict",
    "body_digest",
    "frame_tag",
    "parse_ack",
    "parse_meta",
    "sign_frame",
    "tag_verifies",
    "verify_body",
]
