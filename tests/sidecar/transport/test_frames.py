"""Frame metadata parsing and body verification on untrusted bytes."""

from __future__ import annotations

import pytest

from refit_protocol.kit.auth import is_loopback_host, require_token_or_loopback, tokens_equal
from refit_sidecar.codec.errors import AuthenticationError, BadMagic, DigestMismatch, HeaderMismatch
from refit_sidecar.transport.relay.frames import (
    ACK,
    DATA,
    END,
    TAG_SIZE,
    FrameMeta,
    parse_meta,
    sign_frame,
    tag_verifies,
    verify_body,
)
from tests.harness.receivers import HARNESS_MAC_KEY
from tests.sidecar.receiver.models import canonical, payloads, perturb


def _payload():  # type: ignore[no-untyped-def]
    old = canonical(0, tensors=1)
    return payloads("a", 3, old, perturb(old, 1))[0]


def meta_of(p, **kw) -> FrameMeta:  # type: ignore[no-untyped-def]
    h = p.header
    fields = {
        "attempt": h.attempt,
        "producer": h.producer,
        "payload_id": h.payload_id,
        "order": h.order,
        "digest": p.digest.hex(),
        "size": p.size,
    } | kw
    return FrameMeta(**fields)


def test_verify_accepts_the_payload_and_rejects_tampering() -> None:
    p = _payload()
    verify_body(meta_of(p), p.body)
    bad = bytearray(p.body)
    bad[-1] ^= 1
    with pytest.raises(DigestMismatch):
        verify_body(meta_of(p), bytes(bad))
    with pytest.raises(HeaderMismatch):
        verify_body(meta_of(p, payload_id=9), p.body)
    with pytest.raises(DigestMismatch):
        verify_body(meta_of(p, size=p.size + 1), p.body)
    with pytest.raises(BadMagic):
        verify_body(meta_of(p, size=0), b"X" * 64)


def test_a_sealed_payload_is_checked_by_its_mac_and_the_announced_digest() -> None:
    """With the policy's key the MAC stands for the body hash: any altered byte (body, or the
    preamble's digest) fails the MAC, and an announced digest other than the sealed one is
    still refused."""
    p = _payload()  # sealed with HARNESS_MAC_KEY
    verify_body(meta_of(p), p.body, mac_key=HARNESS_MAC_KEY)
    digest_at = 4 + 2 + 2 + 4 + 8 * 4  # magic, version, flags, producer, 4 x u64
    for at in (len(p.body) - 1, digest_at):
        bad = bytearray(p.body)
        bad[at] ^= 1
        with pytest.raises(AuthenticationError):
            verify_body(meta_of(p), bytes(bad), mac_key=HARNESS_MAC_KEY)
    with pytest.raises(DigestMismatch):
        verify_body(meta_of(p, digest="00" * 16), p.body, mac_key=HARNESS_MAC_KEY)
    with pytest.raises(AuthenticationError):
        verify_body(meta_of(p), p.body, mac_key=b"k" * 32)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"[]",
        b'{"attempt": "a", "producer": -1}',
        b'{"attempt": "a", "producer": 0, "digest": "zz"}',
        b'{"attempt": "a", "producer": 0, "evil": 1}',
        b'{"attempt": "' + b"a" * 2000 + b'", "producer": 0}',
        b" " * 20000,
    ],
)
def test_malformed_metadata_is_none(raw: bytes) -> None:
    assert parse_meta(raw) is None


def test_token_checks() -> None:
    assert tokens_equal(None, None)
    assert tokens_equal("t", "t")
    assert not tokens_equal("t", None)
    assert not tokens_equal("t", "u")
    assert is_loopback_host("127.0.0.1")
    assert is_loopback_host("::1")
    assert not is_loopback_host("0.0.0.0")
    require_token_or_loopback("x", ["127.0.0.1"], None, allow_insecure=False)
    with pytest.raises(ValueError, match="allow_insecure"):
        require_token_or_loopback("x", ["10.0.0.1"], None, allow_insecure=False)


def test_a_frame_tag_binds_the_kind_the_metadata_and_the_token() -> None:
    meta = FrameMeta(attempt="a", producer=0, payload_id=3).model_dump_json().encode()
    tag = sign_frame("tok-a", DATA, meta)
    assert len(tag) == TAG_SIZE
    assert tag_verifies(["tok-b", "tok-a"], DATA, meta, tag)  # any accepted token (rotation)
    assert not tag_verifies(["tok-b"], DATA, meta, tag)
    assert not tag_verifies(["tok-a"], END, meta, tag)  # another kind
    assert not tag_verifies(["tok-a"], ACK, meta, tag)  # a request's tag is no answer's
    assert not tag_verifies(["tok-a"], DATA, meta.replace(b'"a"', b'"b"'), tag)
    assert not tag_verifies(["tok-a"], DATA, meta, tag[:-1])
    assert sign_frame(None, DATA, meta) == b""
    assert tag_verifies([], DATA, meta, b"")  # no token: nothing is authenticated (loopback)
