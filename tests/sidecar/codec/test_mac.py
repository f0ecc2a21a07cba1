"""Issue 15 (hostile input), part A: payloads authenticated with a keyed MAC.

The unkeyed BLAKE2b-128 digest lets anyone on the path forge or swap a payload (recompute the
digest, done). A payload sealed with the policy's key carries a keyed BLAKE3 MAC of the preamble
before it and of the compressed body; a keyed decoder checks it before it hashes or decompresses
anything, and refuses payloads without one.
"""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch
import zstandard

from refit_sidecar.codec import (
    AuthenticationError,
    CodecError,
    DecompressionError,
    DigestMismatch,
    EncodedPayload,
    Item,
    Op,
    PayloadHeader,
    SchemaError,
    TensorMeta,
    decode_payload,
    encode_payload,
    peek_header,
    seal_body,
    verify_mac,
)
from refit_sidecar.codec.wire import compressed_body
from tests.sidecar.codec.craft import (
    DIGEST_AT,
    FLAGS_AT,
    HEADER,
    KEY,
    MAC_SIZE,
    OTHER_KEY,
    PREAMBLE,
    PRODUCER_AT,
    body_offset,
    claim_frame,
    payload,
)
from tests.sidecar.codec.items import same_bits


def _items(seed: int = 0) -> list[Item]:
    g = torch.Generator().manual_seed(seed)
    a = TensorMeta("a", (40, 30), torch.bfloat16)
    b = TensorMeta("b", (500,), torch.uint8)
    return [
        Item(
            a,
            Op.XOR,
            None,
            torch.tensor([1, 7, 300, 1199]),
            torch.randint(-(2**15), 2**15, (4,), generator=g, dtype=torch.int16),
        ),
        Item(b, Op.OVERWRITE, 10, None, torch.randint(0, 255, (50,), generator=g).to(torch.uint8)),
    ]


KEYED = encode_payload(HEADER, _items(), mac_key=KEY)
PLAIN = encode_payload(HEADER, _items())
SIGNED = PREAMBLE + len(HEADER.attempt)  # bytes covered by the MAC before the MAC field


def test_keyed_round_trip_is_bit_exact_and_the_digest_is_unchanged() -> None:
    body = KEYED.body
    assert struct.unpack_from("<H", body, FLAGS_AT)[0] == 1
    assert body_offset(body) == SIGNED + MAC_SIZE
    assert len(body) == len(PLAIN.body) + MAC_SIZE
    # Same compressed body and digest with and without a key: dedup and announcements agree.
    assert (
        KEYED.digest
        == PLAIN.digest
        == hashlib.blake2b(body[SIGNED + 32 :], digest_size=16).digest()
    )
    assert bytes(compressed_body(body)) == bytes(compressed_body(PLAIN.body))
    assert peek_header(body) == HEADER
    for decoded in (
        decode_payload(body, mac_key=KEY, expected_digest=KEYED.digest),
        decode_payload(body),  # a decoder without a key skips the MAC
    ):
        assert same_bits(decoded.items, _items())
    verify_mac(body, KEY)


def test_without_a_key_both_forms_decode_with_a_key_only_the_sealed_one() -> None:
    assert same_bits(decode_payload(PLAIN.body).items, _items())
    with pytest.raises(AuthenticationError, match="no MAC"):
        decode_payload(PLAIN.body, mac_key=KEY)
    with pytest.raises(AuthenticationError, match="no MAC"):
        verify_mac(PLAIN.body, KEY)


def test_a_wrong_key_is_refused() -> None:
    with pytest.raises(AuthenticationError):
        decode_payload(KEYED.body, mac_key=OTHER_KEY)
    with pytest.raises(AuthenticationError):
        verify_mac(KEYED.body, OTHER_KEY)


def test_every_flipped_bit_of_the_identity_sizes_and_digest_is_refused() -> None:
    """Producer, payload id, order, raw and compressed sizes, digest: every bit is covered."""
    data = bytearray(KEYED.body)
    for pos in range(PRODUCER_AT, DIGEST_AT + 16):
        for bit in range(8):
            data[pos] ^= 1 << bit
            with pytest.raises(AuthenticationError):
                decode_payload(bytes(data), mac_key=KEY)
            data[pos] ^= 1 << bit


def test_flipped_attempt_bits_and_flags_are_refused() -> None:
    data = bytearray(KEYED.body)
    for pos in range(PREAMBLE, SIGNED):  # the attempt id (bits that keep it valid UTF-8)
        for bit in range(7):
            data[pos] ^= 1 << bit
            with pytest.raises(AuthenticationError):
                decode_payload(bytes(data), mac_key=KEY)
            data[pos] ^= 1 << bit
    unflagged = bytearray(KEYED.body)
    unflagged[FLAGS_AT] = 0  # "no MAC": the MAC bytes become part of the body
    with pytest.raises(AuthenticationError, match="no MAC"):
        decode_payload(bytes(unflagged), mac_key=KEY)
    unknown = bytearray(KEYED.body)
    unknown[FLAGS_AT] |= 2
    with pytest.raises(SchemaError):
        decode_payload(bytes(unknown), mac_key=KEY)


def test_every_flipped_bit_of_the_mac_and_the_body_is_refused() -> None:
    data = bytearray(KEYED.body)
    for pos in range(SIGNED, len(data)):
        for bit in range(8):
            data[pos] ^= 1 << bit
            with pytest.raises(AuthenticationError):
                decode_payload(bytes(data), mac_key=KEY)
            data[pos] ^= 1 << bit


def test_appended_or_removed_bytes_are_refused() -> None:
    for data in (KEYED.body + b"\0", KEYED.body[:-1], KEYED.body[: SIGNED + MAC_SIZE]):
        with pytest.raises(AuthenticationError):
            decode_payload(data, mac_key=KEY)
    with pytest.raises(CodecError):  # too short to hold the MAC the flags announce
        decode_payload(KEYED.body[: SIGNED + 5], mac_key=KEY)


def test_a_body_swapped_in_from_another_payload_is_refused_even_with_a_recomputed_digest() -> None:
    other = encode_payload(HEADER, _items(seed=1), mac_key=KEY)
    body = other.body[SIGNED + MAC_SIZE :]
    # What an on-path attacker can do without the key: the other body, with the sizes and the
    # digest of the preamble fixed up to match it, and the original MAC.
    forged = bytearray(KEYED.body[: SIGNED + MAC_SIZE] + body)
    forged[:SIGNED] = other.body[:SIGNED]
    forged[SIGNED : SIGNED + MAC_SIZE] = KEYED.body[SIGNED : SIGNED + MAC_SIZE]
    with pytest.raises(AuthenticationError):
        decode_payload(bytes(forged), mac_key=KEY)
    # The same forgery against the digest alone succeeds: the reason for the MAC.
    unsigned = bytes(other.body[:SIGNED]) + body
    unsigned = unsigned[:FLAGS_AT] + b"\0\0" + unsigned[FLAGS_AT + 2 :]
    assert same_bits(decode_payload(unsigned).items, _items(seed=1))
    with pytest.raises(AuthenticationError):
        decode_payload(unsigned, mac_key=KEY)


def test_the_mac_is_checked_before_the_digest_and_before_decompression() -> None:
    """A body that is not zstd and whose frame would claim 64 MiB: with the key that sealed it
    the decoder gets to decompression (and fails there); with another key it never does."""
    garbage = b"\x28\xb5\x2f\xfd" + bytes(range(256)) * 8  # a zstd magic, then nonsense
    sealed = payload(garbage, 64 << 20, key=KEY)
    with pytest.raises(DecompressionError):
        decode_payload(sealed, mac_key=KEY)
    with pytest.raises(AuthenticationError):
        decode_payload(sealed, mac_key=OTHER_KEY)
    claim = payload(claim_frame(64 << 20, b"x" * 2000), 64 << 20, key=OTHER_KEY)
    with pytest.raises(AuthenticationError):
        decode_payload(claim, mac_key=KEY)
    # a wrong digest and a wrong MAC: the MAC is what is reported
    bad_digest = bytearray(KEYED.body)
    bad_digest[DIGEST_AT] ^= 1
    with pytest.raises(DigestMismatch):
        decode_payload(bytes(bad_digest))
    with pytest.raises(AuthenticationError):
        decode_payload(bytes(bad_digest), mac_key=KEY)


def test_verify_mac_checks_bytes_without_decoding() -> None:
    sealed = payload(b"not even zstd", 100, key=KEY)
    verify_mac(sealed, KEY)  # authentic bytes; whether they decode is the receiver's business
    with pytest.raises(DecompressionError):
        decode_payload(sealed, mac_key=KEY)
    with pytest.raises(ValueError, match="32 bytes"):
        verify_mac(sealed, KEY[:16])
    with pytest.raises(CodecError):
        verify_mac(b"NOPE" + sealed[4:], KEY)


def test_seal_body_and_hand_crafted_payloads_agree_on_the_mac() -> None:
    """The test's own reading of the spec (craft.payload) and the encoder make the same MAC."""
    raw = zstandard.ZstdDecompressor().decompress(PLAIN.body[SIGNED:])
    sealed = seal_body(HEADER, [raw], mac_key=KEY)
    comp = sealed.body[SIGNED + MAC_SIZE :]
    assert sealed.body == payload(comp, len(raw), key=KEY)
    assert isinstance(sealed, EncodedPayload)
    assert decode_payload(sealed.body, mac_key=KEY).items


def test_keys_of_other_lengths_are_configuration_errors() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        encode_payload(PayloadHeader(1, "a", 0, 0, 0), _items(), mac_key=b"short")
    with pytest.raises(ValueError, match="32 bytes"):
        decode_payload(KEYED.body, mac_key=b"short")
