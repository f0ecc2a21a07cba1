"""Which tokens' keys a DEALER hop connects with, decided with no socket: a ring on a fake clock,
handshake events fed by hand, and links that are only names in a map."""

from __future__ import annotations

import zmq

from refit_protocol.kit.tokens import TokenRing
from refit_sidecar.transport.relay.key_hunt import (
    HUNT_PROBE_S,
    HUNT_ROUND_PAUSE_S,
    HUNT_WIDTH,
    MAX_LINKS,
    REOPEN_BACKOFF_S,
    KeyHunt,
    LinkState,
)

GRACE = 10.0
REFUSED = zmq.EVENT_HANDSHAKE_FAILED_AUTH
SUCCEEDED = zmq.EVENT_HANDSHAKE_SUCCEEDED


class Hop:
    """The hop around the hunt: its links, what was opened and closed, whether frames wait."""

    def __init__(self, text: str | None) -> None:
        self.now = 1000.0
        self.ring = TokenRing(text, grace_s=GRACE, clock=lambda: self.now)
        self.links: dict[str, LinkState] = {}
        self.tries: list[str] = []
        self.closed: list[str] = []
        self.can_open = True
        self.waiting = True
        self.hunt = KeyHunt(
            self.ring,
            self.links,
            open_link=self.open,
            close_link=self.close,
            pending=lambda: self.waiting,
            name="hop",
            endpoint="tcp://relay:1",
        )

    def open(self, token: str, fallback: bool, now: float) -> bool:
        self.tries.append(token)
        if self.can_open:
            self.links[token] = LinkState(token, fallback, now)
        return self.can_open

    def close(self, link: LinkState, now: float) -> None:
        del self.links[link.token]
        self.closed.append(link.token)

    def event(self, token: str, event: int, now: float) -> None:
        self.hunt.handshake(self.links[token], event, now)

    def fallbacks(self) -> list[str]:
        return [t for t, link in self.links.items() if link.fallback]


def _listing(n: int) -> str:
    return "\n".join(f"t{i}" for i in range(1, n + 1))


def _likely_refused(n: int) -> Hop:
    """A hop whose ring lists `n` tokens, with both likely keys (t2, t1) refused at 0."""
    hop = Hop(_listing(n))
    hop.hunt.sync(0.0)
    hop.event("t1", REFUSED, 0.0)
    hop.event("t2", REFUSED, 0.0)
    return hop


def test_one_link_per_likely_token_and_a_plain_one_without_a_token() -> None:
    plain = Hop(None)
    plain.hunt.sync(0.0)
    assert list(plain.links) == [""]
    # A Secret listing ten tokens: two are likely, the second listed (sent during the grace of a
    # process started with an overlap) first, then the newest.
    many = Hop(_listing(10))
    many.hunt.sync(0.0)
    assert list(many.links) == ["t2", "t1"]
    assert not many.fallbacks()
    many.hunt.sync(0.1)
    assert many.tries == ["t2", "t1"]  # nothing opened twice


def test_a_rotation_opens_the_new_key_and_later_closes_the_old_one() -> None:
    hop = Hop("old")
    hop.hunt.sync(0.0)
    hop.ring.update("new")
    hop.hunt.sync(0.1)
    assert list(hop.links) == ["old", "new"]
    hop.now += 2 * GRACE  # neither sent nor accepted any more
    hop.hunt.sync(0.2)
    assert list(hop.links) == ["new"]
    assert hop.closed == ["old"]


def test_other_tokens_are_tried_only_while_frames_wait_and_every_likely_key_is_refused() -> None:
    hop = Hop(_listing(10))
    hop.waiting = False
    hop.hunt.sync(0.0)
    hop.event("t1", REFUSED, 0.1)
    hop.hunt.sync(0.1)
    assert hop.fallbacks() == []  # t2 may still connect
    hop.event("t2", REFUSED, 0.1)
    hop.hunt.sync(0.2)
    assert hop.fallbacks() == []  # nothing waits: nothing to hunt for
    hop.waiting = True
    hop.hunt.sync(0.25)
    assert hop.fallbacks() == ["t3", "t4", "t5", "t6"]  # HUNT_WIDTH at a time
    assert len(hop.fallbacks()) == HUNT_WIDTH
    hop.event("t3", REFUSED, 0.5)  # refused: closed at once, the next one tried
    hop.hunt.sync(0.5)
    assert hop.fallbacks() == ["t4", "t5", "t6", "t7"]
    hop.hunt.sync(0.25 + HUNT_PROBE_S)  # no answer in time: given up, the rest tried
    assert hop.fallbacks() == ["t7", "t8", "t9", "t10"]
    assert len(hop.links) <= MAX_LINKS
    hop.event("t9", SUCCEEDED, 2.5)  # found: kept, the others closed
    assert list(hop.links) == ["t2", "t1", "t9"]
    assert hop.fallbacks() == []
    hop.hunt.sync(2.6)
    assert list(hop.links) == ["t2", "t1", "t9"]
    hop.close(hop.links["t9"], 2.7)  # its socket went away: opened again like a likely one
    hop.hunt.sync(2.7)
    assert list(hop.links) == ["t2", "t1", "t9"]
    assert hop.fallbacks() == []
    for token in list(hop.links):  # the hop lost every link, e.g. after an I/O error
        hop.close(hop.links[token], 2.75)
    hop.hunt.resync()
    hop.hunt.sync(2.8)  # the key found is kept while accepted
    assert list(hop.links) == ["t2", "t1", "t9"]
    assert hop.fallbacks() == []
    hop.ring.update(_listing(8))  # the Secret no longer lists it: dropped
    hop.hunt.sync(2.9)
    assert list(hop.links) == ["t2", "t1"]


def test_fallbacks_are_closed_once_nothing_waits_or_a_likely_key_connects() -> None:
    hop = _likely_refused(6)
    hop.hunt.sync(0.1)
    assert hop.fallbacks() == ["t3", "t4", "t5", "t6"]
    hop.waiting = False
    hop.hunt.sync(0.2)
    assert hop.fallbacks() == []
    hop.waiting = True
    hop.hunt.sync(0.3)
    assert len(hop.fallbacks()) == 4
    hop.event("t1", SUCCEEDED, 0.4)  # the relay serves a likely key after all
    hop.hunt.sync(0.4)
    assert list(hop.links) == ["t2", "t1"]


def test_a_round_that_finds_no_key_pauses_before_the_next() -> None:
    hop = _likely_refused(3)
    hop.hunt.sync(0.125)
    hop.event("t3", REFUSED, 0.25)
    hop.hunt.sync(0.25)  # every accepted token refused: the round is over
    hop.hunt.sync(0.25 + HUNT_ROUND_PAUSE_S - 0.125)
    hop.hunt.sync(0.25 + HUNT_ROUND_PAUSE_S - 0.0625)
    assert hop.tries == ["t2", "t1", "t3"]
    hop.hunt.sync(0.25 + HUNT_ROUND_PAUSE_S)  # the pause is over: the next round
    hop.hunt.sync(0.5 + HUNT_ROUND_PAUSE_S)
    assert hop.tries == ["t2", "t1", "t3", "t3"]
    assert hop.fallbacks() == ["t3"]


def test_links_that_cannot_be_opened_are_tried_again_after_a_backoff() -> None:
    hop = Hop(_listing(2))
    hop.can_open = False  # e.g. libzmq's socket limit
    hop.hunt.sync(0.0)
    assert hop.tries == ["t2"]  # the first failure stops the others
    assert hop.hunt.open_failed == 0.0
    hop.hunt.sync(REOPEN_BACKOFF_S - 0.125)
    assert hop.tries == ["t2"]
    hop.can_open = True
    hop.hunt.sync(REOPEN_BACKOFF_S)
    assert list(hop.links) == ["t2", "t1"]
    assert hop.hunt.open_failed is None


def test_a_link_is_ready_from_its_handshake_until_it_disconnects() -> None:
    hop = Hop("t1")
    hop.hunt.sync(0.0)
    link = hop.links["t1"]
    assert (link.ready, link.refused) == (False, False)
    hop.event("t1", REFUSED, 0.1)
    assert (link.ready, link.refused) == (False, True)
    hop.event("t1", SUCCEEDED, 0.2)
    assert (link.ready, link.refused) == (True, False)
    hop.event("t1", zmq.EVENT_DISCONNECTED, 0.3)
    assert (link.ready, link.refused) == (False, False)
    assert list(hop.links) == ["t1"]  # a likely link is never closed for a refusal
