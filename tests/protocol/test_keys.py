"""Keys derived from the policy token: deterministic, 32 bytes, separated by purpose."""

from __future__ import annotations

import hashlib

import pytest

from refit_protocol.keys import PAYLOAD_MAC_PERSON, payload_mac_key


def test_payload_mac_key_is_the_documented_derivation() -> None:
    key = payload_mac_key("s3cr3t")
    assert len(key) == 32
    assert key == hashlib.blake2b(b"s3cr3t", digest_size=32, person=b"kr-payload-mac").digest()
    assert key == payload_mac_key("s3cr3t")  # both ends derive it without exchanging anything
    assert len(PAYLOAD_MAC_PERSON) <= 16


def test_keys_differ_by_token_and_never_equal_plain_hashes_of_it() -> None:
    keys = {payload_mac_key(t) for t in ("a", "b", "a ", "é", "x" * 4096)}
    assert len(keys) == 5
    assert payload_mac_key("a") != hashlib.blake2b(b"a", digest_size=32).digest()
    assert payload_mac_key("a") != hashlib.sha256(b"a").digest()


def test_an_empty_token_has_no_key() -> None:
    with pytest.raises(ValueError, match="empty token"):
        payload_mac_key("")
