"""The payload wire format v1: its layout, identity and the sizes a decoder may trust.

docs/wire-format.md is the normative description. A payload is a plain preamble (magic,
version, flags, identity, sizes, digest, attempt id and, when flag bit 0 is set, a 32-byte MAC)
followed by one zstd frame. The frame holds a copy of the identity, the group and item tables,
the location groups and the value groups. The BLAKE2b-128 digest covers the compressed body
(dedup and announcements key on it), and the identity copy inside it binds the plain header to
the digest. The MAC is keyed BLAKE3 (key: `refit_protocol.keys.payload_mac_key` of the policy's
token) over the preamble before it and the compressed body, so only a holder of the token can
make a payload a keyed receiver accepts. `encode` writes it (❸), `decode` validates and reads it
(❺); this module holds what both agree on, and reads the plain preamble (`peek_header`) without
trusting anything else.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from dataclasses import dataclass
from typing import Any

import blake3
from pydantic import BaseModel, ConfigDict, Field

from refit_protocol.limits import MAX_NAME_BYTES, MAX_NDIM
from refit_sidecar.codec.errors import (
    BadMagic,
    SchemaError,
    SizeLimitExceeded,
    TruncatedPayload,
    UnsupportedVersion,
)
from refit_sidecar.codec.records import Item

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("the KubeRefit codec needs a little-endian host")

MAGIC = b"KRFP"
BODY_MAGIC = b"KRB1"
CODEC_VERSION = 1
DIGEST_SIZE = 16
#: Preamble flag bit 0: a MAC of `MAC_SIZE` bytes follows the attempt id. Other bits: reserved.
FLAG_MAC = 1
MAC_SIZE = 32
MAX_ATTEMPT_BYTES = 1024
#: A zstd block of at most 128 KiB can be stored in 4 bytes (RLE), so no frame expands more.
ZSTD_MAX_RATIO = 32768
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

PRE_ID = struct.Struct("<4sH")  # magic, codec version
PRE_REST = struct.Struct("<HIQQQQ16sH")  # flags, producer, payload, order, raw, comp, digest, |a|
PREAMBLE_SIZE = PRE_ID.size + PRE_REST.size
BODY_HEAD = struct.Struct("<4sHIQQIBBH")  # magic, |attempt|, producer, payload, order, items,
#                                            location groups, value groups, reserved
GROUP_ROW = struct.Struct("<BB6xQ")  # width or dtype code, shuffled, element count
ITEM_ROW = struct.Struct("<HBBBBBxQQQQ")  # |name|, dtype, op, loc kind, loc width, ndim, count,
#                                        start, location offset, value offset
DIM = struct.Struct("<Q")
ALIGN = 8


class CodecConfig(BaseModel):
    """Encoder settings. Decoding needs none: everything it needs is in the payload."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    zstd_level: int = Field(default=1, ge=1, le=22, description="zstd level; 1 as in the paper.")
    zstd_threads: int | None = Field(
        default=None,
        ge=0,
        description="zstd worker threads per payload; 0 compresses in the calling thread. None: "
        "0 for a single payload, and in the pipeline one per compare thread when there are "
        "several (on one core, extra zstd threads only contend). The bytes are the same for "
        "every value >= 1.",
    )
    shuffle: bool = Field(
        default=True,
        description="Byte-plane shuffle multi-byte location and value groups before zstd "
        "(smaller payloads, see docs/performance.md).",
    )


class DecodeLimits(BaseModel):
    """Upper bounds a receiver enforces on untrusted payloads before allocating anything."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_raw_bytes: int = Field(default=16 << 30, gt=0, description="Largest decompressed body.")
    max_items: int = Field(default=1 << 20, gt=0, description="Most items in one payload.")
    max_name_bytes: int = Field(
        default=MAX_NAME_BYTES, gt=0, description="Longest UTF-8 tensor name."
    )
    max_ndim: int = Field(default=MAX_NDIM, ge=0, description="Most dimensions of a tensor.")


DEFAULT_CODEC = CodecConfig()
DEFAULT_LIMITS = DecodeLimits()


@dataclass(frozen=True)
class PayloadHeader:
    """Identity of a payload: dedup key (attempt, producer, payload_id) and application order."""

    codec_version: int
    attempt: str
    producer: int
    payload_id: int
    order: int

    def __post_init__(self) -> None:
        if len(self.attempt.encode()) > MAX_ATTEMPT_BYTES:
            raise ValueError(f"attempt id longer than {MAX_ATTEMPT_BYTES} bytes")
        if not 0 <= self.producer < 1 << 32:
            raise ValueError("producer must fit in 32 bits")
        if not (0 <= self.payload_id < 1 << 64 and 0 <= self.order < 1 << 64):
            raise ValueError("payload_id and order must fit in 64 bits")
        if not 0 <= self.codec_version < 1 << 16:
            raise ValueError("codec_version must fit in 16 bits")


@dataclass(frozen=True)
class EncodedPayload:
    """A payload ready to send: `body` is the full wire bytes, `digest` its compressed body's."""

    header: PayloadHeader
    body: bytes
    digest: bytes
    raw_size: int = 0  # decompressed body bytes, for metrics (0 when unknown)

    @property
    def size(self) -> int:
        return len(self.body)


@dataclass(frozen=True)
class DecodedPayload:
    """A validated payload: its identity and items in encoded order."""

    header: PayloadHeader
    items: list[Item]
    digest: bytes
    raw_size: int


# ---------------------------------------------------------------------- the plain preamble
class Reader:
    """Bounds-checked cursor over untrusted bytes."""

    def __init__(self, buf: memoryview, what: str) -> None:
        self.buf = buf
        self.pos = 0
        self.what = what

    def unpack(self, st: struct.Struct) -> tuple[Any, ...]:
        return st.unpack(self.take(st.size))

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.buf):
            raise TruncatedPayload(
                f"{self.what}: needs {n} bytes at offset {self.pos}, "
                f"only {len(self.buf) - self.pos} left"
            )
        out = self.buf[self.pos : end]
        self.pos = end
        return out

    def align(self) -> None:
        self.take(-self.pos % ALIGN)

    @property
    def left(self) -> int:
        return len(self.buf) - self.pos


@dataclass(frozen=True)
class Preamble:
    """The plain preamble. `signed_len`: bytes before the MAC field (what the MAC covers besides
    the compressed body); `mac`: the MAC, None when flag bit 0 is clear; `body_offset`: where the
    compressed body starts."""

    header: PayloadHeader
    raw_len: int
    comp_len: int
    digest: bytes
    signed_len: int
    mac: bytes | None
    body_offset: int


def read_preamble(mv: memoryview) -> Preamble:
    r = Reader(mv, "preamble")
    magic, version = r.unpack(PRE_ID)
    if magic != MAGIC:
        raise BadMagic(f"not a KubeRefit payload (magic {bytes(mv[:4])!r})")
    if version != CODEC_VERSION:
        raise UnsupportedVersion(f"codec version {version}; this decoder reads {CODEC_VERSION}")
    flags, producer, payload_id, order, raw_len, comp_len, digest, alen = r.unpack(PRE_REST)
    if flags & ~FLAG_MAC:
        raise SchemaError(f"unknown preamble flags {flags:#x}")
    if alen > MAX_ATTEMPT_BYTES:
        raise SizeLimitExceeded(f"attempt id of {alen} bytes")
    attempt = utf8(r.take(alen), "attempt id")
    header = PayloadHeader(version, attempt, producer, payload_id, order)
    signed_len = r.pos
    mac = bytes(r.take(MAC_SIZE)) if flags & FLAG_MAC else None
    return Preamble(header, raw_len, comp_len, bytes(digest), signed_len, mac, r.pos)


def peek_header(data: bytes | bytearray | memoryview) -> PayloadHeader:
    """The payload's identity from the plain preamble, without checking or decompressing."""
    return read_preamble(memoryview(data).cast("B")).header


def compressed_body(data: bytes | bytearray | memoryview) -> memoryview:
    """The bytes after the preamble, attempt id and MAC: what the digest is taken of (a view;
    its length is checked against `comp_len` by the decoder, not here)."""
    mv = memoryview(data).cast("B")
    return mv[read_preamble(mv).body_offset :]


def body_digest(body: bytes | bytearray | memoryview) -> bytes:
    """BLAKE2b-128 of the payload's compressed body (what the codec and manifests announce)."""
    return hashlib.blake2b(compressed_body(body), digest_size=DIGEST_SIZE).digest()


#: Bodies of at least this many bytes are hashed on BLAKE3's own thread pool: the MAC check is
#: most of a MAC-only relay hop's work, and BLAKE3 splits a long input into independent chunks
#: (the digest does not depend on the thread count). Below it, threads cost more than they save.
MAC_THREADS_FROM = 1 << 20


def payload_mac(key: bytes, signed: bytes | memoryview, comp: bytes | memoryview) -> bytes:
    """Keyed BLAKE3 (32-byte key, 32-byte output) of `signed` (the preamble bytes before the
    MAC field) followed by `comp` (the compressed body). Raises ValueError for a key that is
    not 32 bytes (a configuration error, not a property of the payload)."""
    if len(key) != MAC_SIZE:
        raise ValueError(f"a payload MAC key has {MAC_SIZE} bytes, not {len(key)}")
    size = comp.nbytes if isinstance(comp, memoryview) else len(comp)
    threads = blake3.blake3.AUTO if size >= MAC_THREADS_FROM else 1
    h = blake3.blake3(key=key, max_threads=threads)
    h.update(signed)
    h.update(comp)
    return h.digest()


def utf8(buf: memoryview, what: str) -> str:
    try:
        return bytes(buf).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SchemaError(f"{what} is not valid UTF-8") from exc
