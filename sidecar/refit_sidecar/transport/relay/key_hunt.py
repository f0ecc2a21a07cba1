"""Which tokens' Curve keys one DEALER hop connects with: the likely ones, and the hunt for the
key a relay serves with when it refuses them all.

Why on its own: a relay serves with one key pair, its own ring's sending token, which during a
rotation need not be this client's (`dealer.py` tells the whole story). The client keeps one link
per *likely* token (`TokenRing.likely`, at most four; one plain link without a token), closes
the links of tokens no longer wanted, and only while frames wait and the relay refuses every
likely key tries the other accepted tokens, `HUNT_WIDTH` at a time, each until refused or
`HUNT_PROBE_S` without an answer; the one whose handshake completes is kept while accepted, and a
round that found none starts again `HUNT_ROUND_PAUSE_S` later. These rules decide from the ring,
the handshake events and the clock; opening and closing a link are callables here, so the rules
can be tested with a ring on a fake clock and no socket.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import structlog
import zmq

from refit_protocol.kit.tokens import TokenRing, key_id
from refit_sidecar.transport.relay.curve import HANDSHAKE_FAILURES

log = structlog.get_logger("kuberefit.transport.client")

#: Fallback keys tried at once per hop while the relay refuses every likely one.
HUNT_WIDTH = 4
#: Most sockets one hop holds, however many tokens the ring lists: the likely keys
#: (`TokenRing.likely`, at most 4), a fallback key found, and HUNT_WIDTH being tried.
MAX_LINKS = 4 + 1 + HUNT_WIDTH
#: How long a fallback key is given to complete or fail its handshake (a relay that does not
#: answer at all refuses nothing).
HUNT_PROBE_S = 2.0
#: After a round over every accepted token found no key, the next round starts this much later.
HUNT_ROUND_PAUSE_S = 2.0
#: After sockets could not be opened, the next try is this much later (pending frames fail).
REOPEN_BACKOFF_S = 1.0
#: "No key" is logged at most this often.
NO_KEY_LOG_S = 10.0


@dataclass(eq=False)
class LinkState:
    """What the hunt knows of one link, connected with one token's keys ("": a plain one)."""

    token: str
    fallback: bool  # one of the other accepted tokens, being tried
    opened: float
    ready: bool = False  # its handshake completed and it has not disconnected since
    refused: bool = False  # its last handshake failed: the relay serves another key


L = TypeVar("L", bound=LinkState)


class KeyHunt(Generic[L]):
    """The link plan of one hop; not thread-safe (the hop's I/O thread alone uses it).

    `links` is the hop's own map of open links by token, the likely ones first, changed only
    by the callables: `open_link(token, fallback, now)` adds one (False: it could not be
    opened), `close_link(link, now)` removes one. `pending()` says whether frames wait."""

    def __init__(
        self,
        ring: TokenRing,
        links: Mapping[str, L],
        *,
        open_link: Callable[[str, bool, float], bool],
        close_link: Callable[[L, float], None],
        pending: Callable[[], bool],
        name: str,
        endpoint: str,
    ) -> None:
        self._ring = ring
        self._links = links
        self._open_link = open_link
        self._close_link = close_link
        self._pending = pending
        self.name = name
        self.endpoint = endpoint
        self._accepted: tuple[str, ...] = ()
        self._base: tuple[str, ...] = ()  # tokens always connected: likely (+ the one found)
        self._found: str | None = None  # a fallback token whose handshake completed
        self._tried: set[str] = set()  # fallback tokens refused in this round
        self._round_over: float | None = None  # when a round found no key
        #: When a link last could not be opened (None: every wanted link opened since).
        self.open_failed: float | None = None
        self._no_key_logged = float("-inf")
        self._gen = -1

    def resync(self) -> None:
        """Look at the ring again at the next `sync` (the hop closed every link)."""
        self._gen = -1

    def sync(self, now: float) -> None:
        """Follow the ring: connect with each likely token (one plain link without a token),
        close links of tokens no longer wanted, retry links that could not be opened, and try
        the other accepted tokens while the relay refuses every likely one."""
        gen = self._ring.current_generation()
        if gen != self._gen:
            accepted = self._ring.accepted()
            likely = self._ring.likely()
            self._gen = gen
            self._accepted = accepted
            if self._found is not None and self._found not in accepted:
                self._found = None
            base = likely + ((self._found,) if self._found and self._found not in likely else ())
            self._base = base if accepted else ("",)
            self._tried &= set(accepted)
            closed = 0
            for token, link in list(self._links.items()):
                if token in self._base:
                    link.fallback = False
                elif not (link.fallback and token in accepted):
                    self._close_link(link, now)
                    closed += 1
            if closed:
                log.info("relay_client.keys_changed", client=self.name, keys=len(self._base))
        missing = [t for t in self._base if t not in self._links]
        if missing and (self.open_failed is None or now - self.open_failed >= REOPEN_BACKOFF_S):
            for token in missing:
                if not self._open(token, fallback=False, now=now):
                    break
            else:
                self.open_failed = None
        self._hunt(now)

    def handshake(self, link: L, event: int, now: float) -> None:
        """Take one monitor event of `link` (handshake succeeded or failed, disconnected)."""
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            link.ready, link.refused = True, False
            if link.fallback:
                self._key_found(link, now)
        elif event & HANDSHAKE_FAILURES:
            link.ready, link.refused = False, True
            if link.fallback:  # not this one either: try the next
                self._tried.add(link.token)
                self._close_link(link, now)
        elif event == zmq.EVENT_DISCONNECTED:
            link.ready = False

    def _open(self, token: str, *, fallback: bool, now: float) -> bool:
        if self._open_link(token, fallback, now):
            return True
        self.open_failed = now
        return False

    def _keys_known(self) -> bool:
        """Whether some link completed its handshake, or a likely one has not been refused yet
        (it may still connect): then no other token is tried."""
        base = [self._links.get(t) for t in self._base]
        return any(link is not None and link.ready for link in self._links.values()) or any(
            link is None or not link.refused for link in base
        )

    def _hunt(self, now: float) -> None:
        """While frames wait and the relay refuses every likely key, try the other accepted
        tokens, HUNT_WIDTH at a time, each until refused (or HUNT_PROBE_S without an answer)."""
        fallbacks = [link for link in self._links.values() if link.fallback]
        if self._keys_known() or not self._pending():
            for link in fallbacks:
                self._close_link(link, now)
            return
        for link in fallbacks:
            if not link.ready and now - link.opened >= HUNT_PROBE_S:
                self._tried.add(link.token)
                self._close_link(link, now)
        fallbacks = [link for link in self._links.values() if link.fallback]
        untried = (t for t in self._accepted if t not in self._links and t not in self._tried)
        while len(fallbacks) < HUNT_WIDTH:
            token = next(untried, None)
            if token is None:
                break
            if not self._open(token, fallback=True, now=now):
                return
            fallbacks.append(self._links[token])
        if fallbacks:
            self._round_over = None
        elif self._round_over is None:
            self._round_over = now
            tried_others = len(self._accepted) > len(self._base)  # else: a plain rotation
            if tried_others and now - self._no_key_logged >= NO_KEY_LOG_S:
                self._no_key_logged = now
                log.warning(
                    "relay_client.no_key",
                    client=self.name,
                    endpoint=self.endpoint,
                    tried=len(self._accepted),
                    detail="the relay refused a handshake with every accepted token",
                )
        elif now - self._round_over >= HUNT_ROUND_PAUSE_S:
            self._tried.clear()
            self._round_over = None

    def _key_found(self, link: L, now: float) -> None:
        """A fallback token completed its handshake: keep it while accepted, stop trying."""
        link.fallback = False
        self._found = link.token
        if link.token not in self._base:
            self._base = (*self._base, link.token)
        self._tried.clear()
        self._round_over = None
        for other in [x for x in self._links.values() if x.fallback]:
            self._close_link(other, now)
        log.info(
            "relay_client.key_found",
            client=self.name,
            endpoint=self.endpoint,
            key=key_id(link.token),
        )
