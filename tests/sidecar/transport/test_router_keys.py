"""A relay's Curve keys through a token rotation, on a ring with a fake clock (no socket): which
clients it admits when, when it must bind again, and how refused handshakes are tallied."""

from __future__ import annotations

import pytest
import zmq

from refit_protocol.kit.tokens import TokenRing
from refit_sidecar.transport.relay.router_keys import RefusedHandshakes, RouterKeys

GRACE = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _keys(text: str | None) -> tuple[RouterKeys, list[tuple[str, ...]], Clock, TokenRing]:
    clock = Clock()
    ring = TokenRing(text, grace_s=GRACE, clock=clock)
    admitted: list[tuple[str, ...]] = []
    return RouterKeys(ring, admitted.append), admitted, clock, ring


def test_a_rotation_admits_both_tokens_then_rebinds_after_the_grace_then_drops_the_old() -> None:
    keys, admitted, clock, ring = _keys("old")
    assert keys.take() == "old"
    assert keys.serving == "old"
    assert admitted == [("old",)]
    assert not keys.follow()  # nothing changed: nothing admitted again
    assert admitted == [("old",)]

    ring.update("new")  # the Secret changed: new clients are admitted, the keys stay
    assert not keys.follow()
    assert admitted[-1] == ("old", "new")
    assert keys.serving == "old"

    clock.now += GRACE - 0.1  # still in the grace: the relay keeps serving the old key
    assert not keys.follow()
    assert len(admitted) == 2

    clock.now += 0.2  # the grace is over: serve the new key, still admit the old clients
    assert keys.follow()
    assert admitted[-1] == ("new", "old")
    assert keys.serving == "old"  # until the socket is opened again
    assert keys.take() == "new"
    assert keys.serving == "new"
    assert not keys.follow()

    clock.now += GRACE  # twice the grace after the change: old clients are refused
    assert not keys.follow()
    assert admitted[-1] == ("new",)
    assert not keys.follow()
    assert admitted[-1] == ("new",)


def test_a_failed_admission_is_tried_again_at_the_next_look() -> None:
    clock = Clock()
    ring = TokenRing("old", grace_s=GRACE, clock=clock)
    admitted: list[tuple[str, ...]] = []
    failures = [RuntimeError("zap handler")]

    def admit(tokens: tuple[str, ...]) -> None:
        if failures:
            raise failures.pop()
        admitted.append(tokens)

    keys = RouterKeys(ring, admit)
    with pytest.raises(RuntimeError, match="zap handler"):
        keys.take()
    assert keys.take() == "old"
    ring.update("new")
    clock.now += GRACE + 1
    failures.append(RuntimeError("zap handler"))
    with pytest.raises(RuntimeError):
        keys.follow()
    assert keys.follow()  # the change is not lost: admitted now, and a rebind is due
    assert admitted[-1] == ("new", "old")


def test_without_a_token_the_socket_is_plain_and_admits_nobody() -> None:
    keys, admitted, _, _ = _keys(None)
    assert keys.take() is None
    assert admitted == [()]
    assert not keys.follow()


def test_refused_handshakes_are_counted_by_reason_and_reported_at_most_every_period() -> None:
    tally = RefusedHandshakes(every_s=10.0)
    assert tally.report(100.0) is None  # nothing refused: nothing to say
    aborted = {"event": zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, "endpoint": b"tcp://a:1"}
    refused = {"event": zmq.EVENT_HANDSHAKE_FAILED_AUTH, "endpoint": b"tcp://b:2"}
    assert tally.count(aborted) == "handshake_aborted"
    assert tally.count(refused) == "handshake"
    assert tally.count({"event": zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL}) == "handshake"
    assert tally.report(100.0) == (3, "")
    assert tally.report(100.0) is None  # counted from zero again
    tally.count(refused)
    assert tally.report(109.9) is None  # too soon: kept for later
    tally.count(aborted)
    assert tally.report(110.0) == (2, "tcp://a:1")
