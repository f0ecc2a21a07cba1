"""Declared order, totals and the reserved slot of AttemptState (no threads, no I/O)."""

from __future__ import annotations

from refit_protocol.receiver_api import PrepareRequest
from refit_sidecar.receiver.state import AttemptState, PayloadIdent


def state(producers: list[int], quota: int = 2) -> AttemptState:
    req = PrepareRequest(
        attempt="a", from_version=0, target_version=1, mode="mixed", producers=producers
    )
    return AttemptState(req, quota=quota, relay_tree=[], check_samples=0)


def ident(p: int, order: int) -> PayloadIdent:
    return PayloadIdent("a", p, order, order, bytes(16), 1)


def test_declared_order_interleaves_producers_and_skips_finished_streams() -> None:
    st = state([2, 0, 1])
    cursor = dict.fromkeys(st.producers, 0)
    st.totals = {0: 1, 1: 3, 2: 0}
    seen = []
    while (key := st.next_key(cursor)) is not None:
        seen.append(key)
        cursor[key[1]] += 1
    assert seen == [(0, 0), (0, 1), (1, 1), (2, 1)]


def test_quota_with_a_reserved_slot_for_the_lowest_unreleased_order() -> None:
    st = state([0], quota=2)
    e1, e2 = st.register(ident(0, 1), 0), st.register(ident(0, 2), 0)
    assert not st.admissible(ident(0, 3))  # quota full
    assert st.admissible(ident(0, 0))  # the next one always passes
    e0 = st.register(ident(0, 0), 0)
    for e in (e0, e1):
        st.release_local(e)
        st.release_local(e)  # idempotent
    assert st.low[0] == 2
    assert st.admissible(ident(0, 3))
    st.release_local(e2)
    assert st.low[0] == 3


def test_totals_must_agree_with_what_arrived() -> None:
    st = state([0, 1])
    st.register(ident(0, 0), 0)
    st.register(ident(0, 4), 0)
    assert st.set_total(0, 3) is not None  # order 4 is beyond it
    assert st.set_total(0, 5) is None
    assert st.set_total(0, 6) is not None  # contradicts
    assert st.set_total(7, 1) is not None  # not a producer of the attempt
    assert st.set_totals({0: 5}) == ["no expected count for producers [1]"]
    assert st.count_errors() == ["producer 0: 2 of 5 payloads arrived"]
