"""The policy's token over time: live rotation without restarting any component.

A Kubernetes Secret mounted as a volume is updated in place by the kubelet, on each pod at its
own moment (up to the kubelet's sync period plus its cache TTL after the change, about a minute
or two by default). A `TokenRing` follows that file and keeps every component of a policy
interoperable while pods see the change at different times:

- **Accepted** (inbound: HTTP bearers, relay frame tokens, Curve client keys, payload MACs): the
  newest token and the one it replaced, until `2 x grace` after the change was seen. A token file
  may also list older tokens on further lines ("new\\nold"): those are accepted as long as the
  file lists them (an explicit overlap, e.g. for pods started during a rotation).
- **Sending** (outbound: bearers, frame tokens, Curve keys a relay serves with, MACs a producer
  seals with): the previous token for `grace` after the change was seen, then the new one. With
  `grace` longer than the slowest pod's propagation delay, every receiver accepts the new token
  before any sender uses it, and still accepts the old one until every sender has switched.

`generation` counts changes of either set, so holders of derived state (a relay's Curve server
keys, a DEALER's connections) know when to rebuild it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from refit_protocol.loggers import get_logger

log = get_logger("kuberefit.tokens")

#: Default for `grace` (seconds): well above the kubelet's default Secret propagation delay.
DEFAULT_ROTATION_GRACE_S = 300.0
#: The file is looked at (one stat) at most this often; an authentication failure looks at once.
DEFAULT_CHECK_EVERY_S = 2.0


@dataclass
class _Seen:
    token: str
    since: float  # monotonic time this ring first saw the token as the newest one


class TokenRing:
    """Thread-safe view of a policy's token(s); see the module docstring for the rules."""

    def __init__(
        self,
        text: str | None = None,
        *,
        grace_s: float = DEFAULT_ROTATION_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.grace_s = grace_s
        self._clock = clock
        self._lock = threading.RLock()
        self._listed: list[str] = []  # the source's tokens, newest first
        self._newest: _Seen | None = None
        self._previous: _Seen | None = None  # the token the newest one replaced
        self._state: tuple[str | None, tuple[str, ...]] = (None, ())
        self.generation = 0
        if text is not None:
            self.update(text, first=True)

    # -- feeding -------------------------------------------------------------------------------
    def update(self, text: str, *, first: bool = False) -> bool:
        """Take the source's current content (one token per line, newest first). Returns True
        when the accepted or sending set changed. An empty text is ignored (a file caught in the
        middle of a rewrite), except at first, where it is an error."""
        tokens = [line.strip() for line in text.splitlines() if line.strip()]
        if not tokens:
            if first:
                raise ValueError("the token source is empty")
            log.warning("token.empty_source_ignored")
            return False
        with self._lock:
            now = self._clock()
            newest = tokens[0]
            if self._newest is None:
                # A process that starts with one token sends with it at once. One that starts
                # with an overlap listed ("new\nold": a pod created during a rotation) sends the
                # older one for `grace` first, as the pods that saw the change do.
                if len(tokens) > 1:
                    self._newest, self._previous = _Seen(newest, now), _Seen(tokens[1], now)
                else:
                    self._newest = _Seen(newest, now - self.grace_s)
            elif newest != self._newest.token:
                self._previous = self._newest
                self._previous.since = now
                self._newest = _Seen(newest, now)
                log.info(
                    "token.rotated",
                    new=key_id(newest),
                    previous=key_id(self._previous.token),
                    grace_s=self.grace_s,
                )
            self._listed = tokens
            return self._refresh(now)

    def _refresh(self, now: float) -> bool:
        state = (self._sending(now), self._accepted(now))
        if state != self._state:
            self._state = state
            self.generation += 1
            return True
        return False

    # -- reading ---------------------------------------------------------------------------------
    def sending(self) -> str | None:
        """The token to send with now (None without any token)."""
        with self._lock:
            self._refresh(self._clock())
            return self._state[0]

    def newest(self) -> str | None:
        """The newest token seen, with no grace: what a client sends to a server in its own pod,
        which reads the same file (and reads it again at once on a miss)."""
        with self._lock:
            return self._newest.token if self._newest is not None else None

    def accepted(self) -> tuple[str, ...]:
        """Tokens accepted now, the sending one first (empty without any token)."""
        with self._lock:
            self._refresh(self._clock())
            return self._state[1]

    def current_generation(self) -> int:
        """`generation` after applying the passage of time (a grace that just ended)."""
        with self._lock:
            self._refresh(self._clock())
            return self.generation

    def __bool__(self) -> bool:
        return self._newest is not None

    def _sending(self, now: float) -> str | None:
        if self._newest is None:
            return None
        if self._in_grace(now) and self._previous is not None:
            return self._previous.token
        return self._newest.token

    def _in_grace(self, now: float) -> bool:
        return self._newest is not None and now - self._newest.since < self.grace_s

    def _accepted(self, now: float) -> tuple[str, ...]:
        sending = self._sending(now)
        out: list[str] = [sending] if sending else []
        candidates = list(self._listed)
        newest_since = self._newest.since if self._newest is not None else now
        if self._previous is not None and now - newest_since < 2 * self.grace_s:
            candidates.append(self._previous.token)
        for token in candidates:
            if token not in out:
                out.append(token)
        return tuple(out)

    # -- sources -------------------------------------------------------------------------------
    def refresh(self, *, force: bool = False) -> bool:
        """Re-read the source if it has one (see `FileTokenRing`); True when something changed."""
        return False


class FileTokenRing(TokenRing):
    """A `TokenRing` that follows a file (a mounted Secret), re-read when it changes."""

    def __init__(
        self,
        path: Path,
        *,
        grace_s: float = DEFAULT_ROTATION_GRACE_S,
        check_every_s: float = DEFAULT_CHECK_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.check_every_s = check_every_s
        self._stat: tuple[int, int, int] | None = None
        self._checked = float("-inf")
        super().__init__(None, grace_s=grace_s, clock=clock)
        # Stat before reading: a swap in between is then seen as a change at the next look.
        self._stat = self._signature()
        text = path.read_text()
        if not text.strip():
            raise ValueError(f"token file {path} is empty")
        self._checked = clock()
        self.update(text, first=True)

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)  # follows the kubelet's ..data symlink swap
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def refresh(self, *, force: bool = False) -> bool:
        """Look at the file (at most every `check_every_s` unless `force`); re-read on change.
        A file that vanished or reads empty keeps the tokens in force (logged)."""
        with self._lock:
            now = self._clock()
            if not force and now - self._checked < self.check_every_s:
                return False
            self._checked = now
            sig = self._signature()
            if sig is None:
                log.warning("token.file_unreadable", path=str(self.path))
                return False
            if sig == self._stat:
                return False
            self._stat = sig
            try:
                text = self.path.read_text()
            except OSError as exc:
                log.warning("token.file_unreadable", path=str(self.path), error=str(exc))
                return False
            return self.update(text)

    def sending(self) -> str | None:
        self.refresh()
        return super().sending()

    def accepted(self) -> tuple[str, ...]:
        self.refresh()
        return super().accepted()

    def newest(self) -> str | None:
        self.refresh()
        return super().newest()

    def current_generation(self) -> int:
        self.refresh()
        return super().current_generation()


def key_id(token: str) -> str:
    """A short public fingerprint of a token (logs, status): reveals nothing about it."""
    return hashlib.blake2b(token.encode(), digest_size=6, person=b"kr-key-id").hexdigest()


def as_ring(token: str | TokenRing | None) -> TokenRing:
    """A ring for a fixed token (or none), or the ring itself."""
    return token if isinstance(token, TokenRing) else TokenRing(token or None)


def ring_accepts(
    ring: TokenRing,
    given: str | None,
    *,
    forms: Callable[[str], tuple[str, ...]] = lambda token: (token,),
) -> bool:
    """True when `ring` requires no token, or `given` equals one of the `forms` of an accepted
    token (the token itself by default), compared in constant time. On a miss the source is
    looked at once more at once: a peer in the same pod may have read a rotated file a moment
    earlier."""
    for attempt in range(2):
        tokens = ring.accepted()
        if not tokens:
            return True
        if given is not None:
            for token in tokens:
                for expected in forms(token):
                    if hmac.compare_digest(expected.encode(), given.encode()):
                        return True
        if attempt == 0 and not ring.refresh(force=True):
            return False
    return False
