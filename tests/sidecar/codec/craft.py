"""Hand-built payloads and zstd frames for hostile-input tests.

Everything here follows docs/wire-format.md and the zstd format (RFC 8878) directly, not the
codec's own code, so the tests read the spec independently of the implementation.
"""

from __future__ import annotations

import hashlib
import struct

import blake3

from refit_protocol.keys import payload_mac_key
from refit_sidecar.codec import PayloadHeader

HEADER = PayloadHeader(1, "att", 2, 9, 4)
KEY = payload_mac_key("policy-token")
OTHER_KEY = payload_mac_key("another-policy-token")
PRE_REST = struct.Struct("<HIQQQQ16sH")  # flags .. attempt length
PREAMBLE = 62  # bytes before the attempt id
FLAGS_AT, PRODUCER_AT, DIGEST_AT = 6, 8, 44
MAC_SIZE = 32
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def payload(
    comp: bytes,
    raw_len: int,
    *,
    header: PayloadHeader = HEADER,
    key: bytes | None = None,
    comp_len: int | None = None,
) -> bytes:
    """A payload around compressed body `comp`: the preamble with its BLAKE2b-128 digest and,
    with `key`, flag bit 0 and the keyed BLAKE3 MAC of preamble-before-MAC ‖ body."""
    attempt = header.attempt.encode()
    signed = (
        b"KRFP"
        + struct.pack("<H", header.codec_version)
        + PRE_REST.pack(
            1 if key is not None else 0,
            header.producer,
            header.payload_id,
            header.order,
            raw_len,
            len(comp) if comp_len is None else comp_len,
            hashlib.blake2b(comp, digest_size=16).digest(),
            len(attempt),
        )
        + attempt
    )
    mac = blake3.blake3(signed + comp, key=key).digest() if key is not None else b""
    return signed + mac + comp


def body_offset(data: bytes) -> int:
    """Where the compressed body starts (after the attempt id and, if flagged, the MAC)."""
    (alen,) = struct.unpack_from("<H", data, PREAMBLE - 2)
    flags = struct.unpack_from("<H", data, FLAGS_AT)[0]
    return PREAMBLE + alen + (MAC_SIZE if flags & 1 else 0)


def frame_header(content_size: int, *, checksum: bool = False) -> bytes:
    """A single-segment zstd frame header with an 8-byte content size field."""
    fhd = (3 << 6) | (1 << 5) | (4 if checksum else 0)
    return ZSTD_MAGIC + bytes([fhd]) + struct.pack("<Q", content_size)


def raw_block(data: bytes, *, last: bool = False) -> bytes:
    return (int(last) | (0 << 1) | (len(data) << 3)).to_bytes(3, "little") + data


def rle_block(byte: int, n: int, *, last: bool = False) -> bytes:
    return (int(last) | (1 << 1) | (n << 3)).to_bytes(3, "little") + bytes([byte])


def claim_frame(claim: int, real: bytes) -> bytes:
    """A frame whose header claims `claim` bytes but whose only block holds `real`."""
    return frame_header(claim) + raw_block(real, last=True)
