"""CurveZMQ on every relay link: encryption and mutual authentication from the policy's token.

Every node and producer of a policy derives the same Curve25519 key pair from the policy's token
(`curve_keys`): relays serve with it (CURVE server), forwarders and producers connect with it
(CURVE client, knowing the server's public key). Without the token an attacker can compute
neither key: it cannot complete a handshake, so it can send no frame at all (nothing is
buffered for it), and it cannot read or alter what others send (each connection has fresh
session keys, so captured traffic cannot be replayed either). A ZAP handler additionally admits
only clients that hold the same key pair, and failed handshakes are counted by the relay
(`kuberefit_relay_dropped_total{reason="handshake"}`).

Token rotation (`refit_protocol.kit.tokens`): a relay serves with the ring's sending token and
rebinds when it changes (after the rotation's grace); it admits the clients of every accepted
token. A client connects with the few keys the relay most likely serves with (`TokenRing.likely`:
at most four), and tries the other accepted tokens, a few at a time, only when the relay refuses
them all, so its sockets do not grow with the number of tokens a Secret lists (`dealer.py`).

Why Curve rather than TLS: ZeroMQ has no TLS transport, and Curve keys can be derived from
the Secret every pod already mounts, so there is no certificate to issue or rotate separately.

The same ZAP handler (one per ZeroMQ context) also gates a relay's MAC-only ROUTER: a ZeroMQ
PLAIN server whose password is derived from the token (`refit_protocol.keys.link_password`).
`secure_mac_server` registers a callable that admits a connection by its password, so a peer
that does not know it cannot make the relay buffer a single frame; `mac_client` sets it on a
forwarder's socket. The password crosses the pod network in clear (PLAIN encrypts nothing):
it keeps out peers that never saw that traffic, not an observer of it, who still cannot forge
a frame (each is tagged, `frames.py`).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.auth.thread
from zmq.utils import z85

from refit_protocol.keys import link_password

#: Every relay server socket authenticates clients in this ZAP domain.
ZAP_DOMAIN = "kuberefit"
#: What a relay's socket monitor reports as a refused handshake.
HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


@dataclass(frozen=True)
class CurveKeys:
    """A Z85-encoded Curve25519 key pair."""

    public: bytes
    secret: bytes


def curve_keys(token: str) -> CurveKeys:
    """The policy's key pair: the secret key is a domain-separated hash of the token."""
    if not zmq.has("curve"):  # pragma: no cover - pyzmq's wheels always bundle it
        raise RuntimeError("this libzmq has no CURVE support: install pyzmq from its wheels")
    seed = hashlib.blake2b(token.encode(), digest_size=32, person=b"kr-curve-v1").digest()
    secret = z85.encode(seed)
    return CurveKeys(public=zmq.curve_public(secret), secret=secret)


class _Allowed:
    """ZAP credentials provider: the client keys each relay of this process admits now."""

    def __init__(self) -> None:
        self.by_owner: dict[int, frozenset[bytes]] = {}  # changed under `_lock` only
        self.keys: frozenset[bytes] = frozenset()  # their union, replaced whole

    def callback(self, domain: str, key: bytes) -> bool:
        """`key` is the client's public key, Z85-encoded by pyzmq (runs in the ZAP thread:
        it reads one immutable set, never the dict being changed)."""
        return domain == ZAP_DOMAIN and key in self.keys


#: The PLAIN user name of every MAC-only link (the password is what is checked).
MAC_USER = b"kuberefit"


class _Authenticator(zmq.auth.thread.ThreadAuthenticator):
    """pyzmq's authenticator, plus the password gates of MAC-only ROUTERs (PLAIN mechanism)."""

    def __init__(self, context: zmq.Context[Any]) -> None:
        super().__init__(context, log=None)
        self.gates: dict[str, Callable[[bytes], bool]] = {}  # ZAP domain -> admit(password)

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        gate = self.gates.get(msg[2].decode("utf-8", "replace")) if len(msg) >= 6 else None
        if gate is None:
            await super().handle_zap_message(msg)
            return
        try:  # only PLAIN with the password of an accepted token
            admitted = msg[5] == b"PLAIN" and len(msg) == 8 and gate(msg[7])
        except Exception:  # the gate failed: refuse, never let the handler's thread die
            admitted = False
        if admitted:
            self._send_zap_reply(msg[1], b"200", b"OK")
        else:
            self._send_zap_reply(msg[1], b"400", b"wrong link password")


_authenticators: dict[int, tuple[_Authenticator, _Allowed]] = {}
_lock = threading.Lock()


def _entry(context: zmq.Context[Any]) -> tuple[_Authenticator, _Allowed]:
    """The context's ZAP handler, started once (call under `_lock`)."""
    entry = _authenticators.get(id(context))
    if entry is None:
        auth = _Authenticator(context)
        auth.start()
        allowed = _Allowed()
        auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=allowed)
        entry = _authenticators[id(context)] = (auth, allowed)
    return entry


def allow_clients(context: zmq.Context[Any], owner: int, tokens: Sequence[str]) -> None:
    """Admit clients holding the key pair of any of `tokens` on `owner`'s relay (replacing what
    it admitted before: during a token rotation the old and the new token, then the new one).
    Starts the context's ZAP handler once."""
    with _lock:
        entry = _entry(context)
        keys = frozenset(curve_keys(t).public for t in tokens)
        allowed = entry[1]
        if keys:
            allowed.by_owner[owner] = keys
        else:
            allowed.by_owner.pop(owner, None)
        allowed.keys = frozenset().union(*allowed.by_owner.values())


def secure_mac_server(
    sock: zmq.Socket[Any], context: zmq.Context[Any], owner: int, admit: Callable[[bytes], bool]
) -> None:
    """Make `owner`'s MAC-only ROUTER a PLAIN server whose connections are put to
    `admit(password)` (before bind)."""
    domain = f"{ZAP_DOMAIN}-mac-{owner}"
    with _lock:
        _entry(context)[0].gates[domain] = admit
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    sock.plain_server = True


def forget_mac_server(context: zmq.Context[Any], owner: int) -> None:
    """Drop `owner`'s gate (its socket is closed)."""
    with _lock:
        entry = _authenticators.get(id(context))
        if entry is not None:
            entry[0].gates.pop(f"{ZAP_DOMAIN}-mac-{owner}", None)


def mac_client(sock: zmq.Socket[Any], token: str) -> None:
    """Connect `sock` to MAC-only ports with `token`'s link password (before connect)."""
    sock.plain_username = MAC_USER
    sock.plain_password = link_password(token)


def secure_server(sock: zmq.Socket[Any], token: str) -> None:
    """Make a relay's ROUTER a CURVE server with the token's key pair (before bind); clients
    are admitted by `allow_clients`."""
    keys = curve_keys(token)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def secure_client(sock: zmq.Socket[Any], token: str) -> None:
    """Make a DEALER a CURVE client of relays serving the token's keys (before each connect:
    the options apply to the connections made after they are set)."""
    keys = curve_keys(token)
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.public
