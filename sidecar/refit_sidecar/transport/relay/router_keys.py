"""The Curve side of a relay's ROUTER: which key pair it serves with, which clients it admits,
and the tally of handshakes it refused.

Why on its own: the rules of a token rotation (`refit_protocol.kit.tokens`) for a relay are few but
easy to get wrong inside a socket loop. The ROUTER serves with one key pair, its ring's sending
token's; it admits the clients of every accepted token. Any change of the ring (its generation)
admits the accepted clients again, and only a change of the sending token, which the ring makes
once the rotation's grace is over, needs the socket bound again. Here those rules take the ring
and a callable that admits clients (`curve.allow_clients` in the relay), so a test can drive them
with a ring on a fake clock and no socket.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import zmq

from refit_protocol.kit.tokens import TokenRing


class RouterKeys:
    """The keys a relay's ROUTER serves with, following `ring`; not thread-safe (the relay's
    loop thread alone calls it).

    `admit(tokens)` lets in the clients holding the key pair of any of `tokens`, replacing what
    it let in before."""

    def __init__(self, ring: TokenRing, admit: Callable[[tuple[str, ...]], None]) -> None:
        self._ring = ring
        self._admit = admit
        self._gen = -1
        self._serving: str | None = None

    @property
    def serving(self) -> str | None:
        """The token whose key pair the socket serves with (None: a plain socket)."""
        return self._serving

    def take(self) -> str | None:
        """For a new socket: note the ring's state, admit its accepted clients and return the
        token to serve with (None: no token, a plain socket)."""
        self._gen = self._ring.current_generation()
        self._serving = self._ring.sending()
        self._admit(self._ring.accepted())
        return self._serving

    def follow(self) -> bool:
        """Admit the accepted clients again if the ring changed since the last look. True when
        the sending token is no longer the one served: bind again, after `take`."""
        gen = self._ring.current_generation()
        if gen == self._gen:
            return False
        self._admit(self._ring.accepted())
        self._gen = gen  # after the clients are admitted: a failure is tried again
        return self._ring.sending() != self._serving


class RefusedHandshakes:
    """Counts the handshakes a relay refused (from its socket monitor's events) and says when to
    log them: at most once per `every_s`, with the count since the last report."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._count = 0
        self._logged = 0.0
        self._peer = ""

    def count(self, event: Mapping[str, Any]) -> str:
        """Take one monitor event; the `reason` label it is dropped under: `handshake_aborted`
        when the peer hung up mid-handshake (e.g. a plain TCP connect), else `handshake`."""
        aborted = int(event.get("event", 0)) == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        self._count += 1
        self._peer = str(event.get("endpoint", b""), "utf-8", "replace")
        return "handshake_aborted" if aborted else "handshake"

    def report(self, now: float) -> tuple[int, str] | None:
        """(count, last peer) when refusals were counted and the last report is `every_s` old
        (then the count starts again); None otherwise."""
        if not self._count or now - self._logged < self.every_s:
            return None
        out = (self._count, self._peer)
        self._count, self._logged = 0, now
        return out
