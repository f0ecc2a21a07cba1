"""Declared order, totals and the reserved slot of AttemptState (no threads, no I/O)."""

from __future__ import annotations

from refit_protocol.receiver_api import PrepareRequest
from refit_sidecar.receiver.state import AttemptState, EntryState, ObsoleteSet, Phase
from refit_sidecar.transport.inbound import PayloadIdent


def state(producers: list[int], quota: int = 2) -> AttemptState:
    req = PrepareRequest(
        attempt="a", from_version=0, target_version=1, mode="mixed", producers=producers
    )
    return AttemptState(req, quota=quota, check_samples=0)


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


def test_register_counts_references_and_starts_streaming() -> None:
    st = state([0])
    assert st.phase is Phase.PREPARED
    e = st.register(ident(0, 0), 2)  # staged here and forwarded to two children
    assert e.refs == 3
    assert (st.registered[0], st.held[0], st.pending_local) == (1, 1, 1)
    assert st.phase is Phase.STREAMING
    st.register(ident(0, 1), 0)
    assert (st.registered[0], st.held[0], st.pending_local) == (2, 2, 2)
    st.phase = Phase.APPLYING
    st.register(ident(0, 2), 0)
    assert st.phase is Phase.APPLYING  # only the first payload moves PREPARED on
    for _ in range(2):
        st.release(e)  # the two forwards
    assert st.low[0] == 0  # the local reference still holds it
    st.release_local(e)
    assert st.low[0] == 1


def test_a_total_equal_to_an_order_already_taken_is_refused() -> None:
    st = state([0])
    st.register(ident(0, 2), 0)
    assert st.set_total(0, 2) == "producer 0: order 2 is beyond its total 2"
    assert st.set_total(0, 3) is None
    assert st.set_totals({0: 3, 5: 1}) == ["producer 5 is not part of attempt a"]


def test_missing_names_each_declared_payload_not_yet_applied() -> None:
    st = state([0, 1])
    st.register(ident(0, 0), 0)
    st.entries[(0, 0)].state = EntryState.READY
    # producer 0: total 3, nothing applied; producer 1: no total yet, one expected next
    st.totals = {0: 3}
    assert st.missing() == ["0:0(ready)", "0:1(absent)", "0:2(absent)", "1:0(absent)"]
    assert st.missing(limit=2) == ["0:0(ready)", "0:1(absent)"]
    st.apply_cursor[0] = 2  # orders 0 and 1 applied
    assert st.missing() == ["0:2(absent)", "1:0(absent)"]


def test_the_obsolete_set_forgets_the_oldest_ids_beyond_its_limit() -> None:
    ids = ObsoleteSet(limit=3)
    for a in ("a1", "a2", "a3"):
        ids.add(a)
    assert all(a in ids for a in ("a1", "a2", "a3"))  # exactly the limit: all kept
    ids.add("a4")
    assert "a1" not in ids
    assert all(a in ids for a in ("a2", "a3", "a4"))
    ids.add("a2")  # already known: nothing forgotten
    assert all(a in ids for a in ("a2", "a3", "a4"))


def test_a_fresh_attempt_starts_with_nothing_done() -> None:
    req = PrepareRequest(
        attempt="a",
        from_version=0,
        target_version=1,
        mode="mixed",
        producers=[0],
        relay_tree=["tcp://r:1"],
    )
    st = AttemptState(req, quota=2, check_samples=0)
    flags = (st.opened, st.stopping, st.failed, st.flushed_ok, st.wrote)
    assert all(flag is False for flag in flags)
    counters = (st.pending_local, st.decoding, st.applying, st.checks)
    assert all(type(n) is int and n == 0 for n in counters)


def test_the_local_release_counts_once_and_held_falls_by_one() -> None:
    st = state([0], quota=4)
    a, b = st.register(ident(0, 0), 0), st.register(ident(0, 1), 0)
    assert st.held[0] == 2
    st.release_local(b)
    st.release_local(b)
    assert (b.refs, b.local_released, st.held[0], st.low[0]) == (0, True, 1, 0)
    st.release_local(a)
    assert (a.refs, st.held[0], st.low[0]) == (0, 0, 2)
