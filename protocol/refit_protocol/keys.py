"""Keys derived from a policy's shared token, one per purpose (domain separation).

Every KubeRefit component of one policy holds the same token (a Kubernetes Secret, see
`refit_protocol.kit.auth`). Secrets the data plane needs beyond the token itself are derived from
it here, never used raw: each purpose hashes the token under its own BLAKE2b personalization, so
a key for one purpose says nothing about the token or about the key of another purpose, and two
components that hold the same token derive the same keys without exchanging anything.

Derivations (all deterministic, no salt: the token is already a high-entropy random secret):

- `payload_mac_key`: 32 bytes, the key of the keyed BLAKE3 MAC that seals every payload
  (docs/wire-format.md, "Authentication"). BLAKE2b-256 of the UTF-8 token with
  `person=b"kr-payload-mac"`.
- `frame_mac_key`: 32 bytes, the key of the keyed BLAKE3 tag on every relay frame and answer sent
  over a MAC-only link inside the rollout cluster (docs/security.md, "Links"). BLAKE2b-256 of the
  UTF-8 token with `person=b"kr-frame-mac"`.
- `link_password`: the ZeroMQ PLAIN password a relay's MAC-only port admits connections with
  (64 hex characters of BLAKE2b-256 of the token with `person=b"kr-link-pass"`). It crosses the
  pod network in clear: it keeps out peers that never saw that network's traffic, and reveals
  nothing about the token or the other keys.

Rotating the token rotates every derived key. Adding a purpose means a new function with a new
personalization string (at most 16 bytes); existing strings are never reused or changed.
"""

from __future__ import annotations

import functools
import hashlib

#: Personalization of the payload MAC key (BLAKE2b `person`, at most 16 bytes).
PAYLOAD_MAC_PERSON = b"kr-payload-mac"
#: Personalization of the relay frame tag key (MAC-only links).
FRAME_MAC_PERSON = b"kr-frame-mac"
#: Personalization of the MAC-only port's PLAIN password.
LINK_PASSWORD_PERSON = b"kr-link-pass"
#: Length of the payload MAC key: what keyed BLAKE3 takes.
PAYLOAD_MAC_KEY_SIZE = 32


def _derive(token: str, person: bytes, size: int) -> bytes:
    if not token:
        raise ValueError("cannot derive a key from an empty token")
    return hashlib.blake2b(token.encode(), digest_size=size, person=person).digest()


@functools.lru_cache(maxsize=16)  # per frame during a rotation: derive each key once
def payload_mac_key(token: str) -> bytes:
    """The 32-byte key that authenticates this policy's payloads (keyed BLAKE3).

    Producers seal payloads with it; receivers and relay nodes verify with it before anything is
    decompressed. Raises ValueError for an empty token (a component without a token has no key).
    """
    return _derive(token, PAYLOAD_MAC_PERSON, PAYLOAD_MAC_KEY_SIZE)


@functools.lru_cache(maxsize=16)
def frame_mac_key(token: str) -> bytes:
    """The 32-byte key of the tag that authenticates relay frames and answers on a MAC-only link
    (keyed BLAKE3 over the frame's kind and metadata). Raises ValueError for an empty token."""
    return _derive(token, FRAME_MAC_PERSON, PAYLOAD_MAC_KEY_SIZE)


@functools.lru_cache(maxsize=16)
def link_password(token: str) -> bytes:
    """The PLAIN password of a relay's MAC-only port (ASCII hex). Raises ValueError for an
    empty token."""
    return _derive(token, LINK_PASSWORD_PERSON, 32).hex().encode()
