"""The commit-store rules as pure functions: every refusal, conflict and no-op, without a store.

Both stores only run these rules inside a compare-and-set step, so a weakened rule here would
weaken both; the contract suite checks the same behaviour end to end through each store.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from refit_operator.commit_store import (
    ActiveAttempt,
    CommitConflictError,
    CommitRefusedError,
    StoreState,
    rules,
)
from refit_protocol.commit import CommitRecord

K0 = CommitRecord(0, "b0")
K1 = CommitRecord(1, "b1")
DEADLINE = 1_000.0
NOW = 500.0
A1 = ActiveAttempt("a1", 1, "b1", "mixed", DEADLINE)


def state(
    *, epoch: int = 3, active: ActiveAttempt | None = A1, aborted_by: str | None = None
) -> StoreState:
    return StoreState(K0, epoch, "c1", active, aborted_by)


# -- initialize / acquire --------------------------------------------------------------------------
def test_initialize_creates_a_fresh_record() -> None:
    assert rules.initialize(None, K1) == StoreState(K1, 0, "", None, None)


def test_initialize_keeps_an_existing_record() -> None:
    assert rules.initialize(state(), K1) is None


def test_acquire_increments_the_epoch_and_keeps_everything_else() -> None:
    before = state(epoch=7)
    after = rules.acquire(before, "c2")
    assert (after.epoch, after.coordinator) == (8, "c2")
    assert (after.record, after.active, after.aborted_by) == (K0, A1, None)
    assert before.epoch == 7  # the argument is not changed


def test_acquire_then_the_old_epoch_conflicts() -> None:
    after = rules.acquire(state(epoch=3), "c2")
    with pytest.raises(CommitConflictError):
        rules.prepare(after, 3, A1)
    with pytest.raises(CommitConflictError):
        rules.commit(after, 3, "a1", K0, K1, NOW)


# -- prepare ---------------------------------------------------------------------------------------
def test_prepare_makes_the_attempt_active_and_not_obsolete() -> None:
    a2 = ActiveAttempt("a2", 1, "b1x", "overwrite", DEADLINE + 1, obsolete=True)
    after = rules.prepare(state(), 3, a2)
    assert after.active == replace(a2, obsolete=False)
    assert (after.record, after.epoch, after.coordinator) == (K0, 3, "c1")


def test_prepare_replaces_an_earlier_attempt() -> None:
    after = rules.prepare(state(), 3, ActiveAttempt("a2", 1, "b1x", "overwrite", DEADLINE))
    with pytest.raises(CommitRefusedError, match=r"a1 is not the active attempt \(a2\)"):
        rules.commit(after, 3, "a1", K0, K1, NOW)  # the refusal names the one that is


def test_prepare_with_a_replaced_epoch_conflicts() -> None:
    with pytest.raises(CommitConflictError):
        rules.prepare(state(epoch=3), 2, A1)
    with pytest.raises(CommitConflictError):
        rules.prepare(state(epoch=3), 4, A1)


def test_prepare_is_refused_while_aborted() -> None:
    with pytest.raises(CommitRefusedError, match="alice"):
        rules.prepare(state(aborted_by="alice"), 3, A1)


def test_prepare_checks_the_epoch_before_the_abort() -> None:
    with pytest.raises(CommitConflictError):
        rules.prepare(state(epoch=3, aborted_by="alice"), 2, A1)


# -- mark_obsolete ---------------------------------------------------------------------------------
def test_mark_obsolete_marks_the_active_attempt() -> None:
    after = rules.mark_obsolete(state(), 3, "a1")
    assert after is not None
    assert after.active == replace(A1, obsolete=True)
    assert after.record == K0


def test_mark_obsolete_is_idempotent() -> None:
    once = rules.mark_obsolete(state(), 3, "a1")
    assert once is not None
    assert rules.mark_obsolete(once, 3, "a1") is None


def test_mark_obsolete_of_another_or_no_attempt_changes_nothing() -> None:
    assert rules.mark_obsolete(state(), 3, "a9") is None
    assert rules.mark_obsolete(state(active=None), 3, "a1") is None


def test_mark_obsolete_with_a_replaced_epoch_conflicts() -> None:
    with pytest.raises(CommitConflictError):
        rules.mark_obsolete(state(epoch=3), 2, "a1")
    with pytest.raises(CommitConflictError):  # even when it would change nothing
        rules.mark_obsolete(state(epoch=3, active=None), 2, "a1")


# -- commit ----------------------------------------------------------------------------------------
def test_commit_replaces_the_record_and_makes_the_attempt_obsolete() -> None:
    after = rules.commit(state(), 3, "a1", K0, K1, NOW)
    assert after == StoreState(K1, 3, "c1", replace(A1, obsolete=True), None)
    with pytest.raises(CommitConflictError):  # the record moved on
        rules.commit(after, 3, "a1", K0, K1, NOW)
    with pytest.raises(CommitRefusedError, match="obsolete"):  # and the attempt is closed
        rules.commit(after, 3, "a1", K1, K1, NOW)


def test_commit_with_a_replaced_epoch_conflicts() -> None:
    with pytest.raises(CommitConflictError, match="epoch"):
        rules.commit(state(epoch=3), 2, "a1", K0, K1, NOW)
    with pytest.raises(CommitConflictError, match="epoch"):
        rules.commit(state(epoch=3), 4, "a1", K0, K1, NOW)


def test_commit_of_an_unexpected_record_conflicts() -> None:
    with pytest.raises(CommitConflictError, match="expected"):
        rules.commit(state(), 3, "a1", CommitRecord(0, "other"), K1, NOW)
    with pytest.raises(CommitConflictError, match="expected"):
        rules.commit(state(), 3, "a1", CommitRecord(5, "b0"), K1, NOW)


def test_commit_conflict_takes_precedence_over_refusal() -> None:
    closed = state(active=replace(A1, obsolete=True))
    with pytest.raises(CommitConflictError):
        rules.commit(closed, 3, "a1", K1, K1, NOW)


def test_commit_of_an_attempt_that_is_not_active_is_refused() -> None:
    with pytest.raises(CommitRefusedError, match="not the active attempt"):
        rules.commit(state(), 3, "a2", K0, K1, NOW)
    with pytest.raises(CommitRefusedError, match="not the active attempt"):
        rules.commit(state(active=None), 3, "a1", K0, K1, NOW)


def test_commit_of_an_obsolete_attempt_is_refused() -> None:
    with pytest.raises(CommitRefusedError, match="obsolete"):
        rules.commit(state(active=replace(A1, obsolete=True)), 3, "a1", K0, K1, NOW)


def test_commit_at_the_deadline_is_refused() -> None:
    with pytest.raises(CommitRefusedError, match="deadline"):
        rules.commit(state(), 3, "a1", K0, K1, DEADLINE)
    with pytest.raises(CommitRefusedError, match="deadline"):
        rules.commit(state(), 3, "a1", K0, K1, DEADLINE + 1)


def test_commit_just_before_the_deadline_is_accepted() -> None:
    just_before = math.nextafter(DEADLINE, -math.inf)
    assert rules.commit(state(), 3, "a1", K0, K1, just_before).record == K1


def test_commit_of_a_target_other_than_the_prepared_one_is_refused() -> None:
    with pytest.raises(CommitRefusedError, match="different target"):
        rules.commit(state(), 3, "a1", K0, CommitRecord(2, "b1"), NOW)
    with pytest.raises(CommitRefusedError, match="different target"):
        rules.commit(state(), 3, "a1", K0, CommitRecord(1, "b2"), NOW)


# -- read_commit -----------------------------------------------------------------------------------
def test_read_commit_closes_the_window() -> None:
    after = rules.read_commit(state(), "a1")
    assert after is not None
    assert after.record == K0
    assert after.active == replace(A1, obsolete=True)
    with pytest.raises(CommitRefusedError, match="obsolete"):
        rules.commit(after, 3, "a1", K0, K1, NOW)


def test_read_commit_of_a_closed_or_other_attempt_changes_nothing() -> None:
    assert rules.read_commit(state(active=replace(A1, obsolete=True)), "a1") is None
    assert rules.read_commit(state(), "a9") is None
    assert rules.read_commit(state(active=None), "a1") is None


def test_read_commit_needs_no_current_epoch() -> None:
    # A replaced coordinator resolves its attempt's outcome through read_commit.
    taken_over = rules.acquire(state(epoch=3), "c2")
    after = rules.read_commit(taken_over, "a1")
    assert after is not None
    assert after.active is not None
    assert after.active.obsolete


# -- abort / clear_abort ---------------------------------------------------------------------------
def test_abort_marks_the_active_attempt_obsolete_and_stops_prepare() -> None:
    after = rules.abort(state(), "alice")
    assert after is not None
    assert after.aborted_by == "alice"
    assert after.active == replace(A1, obsolete=True)
    assert (after.record, after.epoch) == (K0, 3)
    with pytest.raises(CommitRefusedError):
        rules.commit(after, 3, "a1", K0, K1, NOW)
    with pytest.raises(CommitRefusedError, match="aborted"):
        rules.prepare(after, 3, A1)


def test_abort_without_an_attempt_sets_the_marker() -> None:
    after = rules.abort(state(active=None), "alice")
    assert after == state(active=None, aborted_by="alice")


def test_abort_twice_by_the_same_operator_changes_nothing() -> None:
    once = rules.abort(state(), "alice")
    assert once is not None
    assert rules.abort(once, "alice") is None
    assert rules.abort(state(active=None, aborted_by="alice"), "alice") is None


def test_abort_repeated_over_a_live_attempt_still_closes_it() -> None:
    # Not reachable through prepare (refused while aborted), but a state written by hand or
    # by an older writer must still end with the attempt closed.
    after = rules.abort(state(aborted_by="alice"), "alice")
    assert after is not None
    assert after.active == replace(A1, obsolete=True)


def test_abort_by_another_operator_replaces_the_marker() -> None:
    once = rules.abort(state(), "alice")
    assert once is not None
    again = rules.abort(once, "bob")
    assert again is not None
    assert again.aborted_by == "bob"


def test_abort_of_an_already_obsolete_attempt_still_sets_the_marker() -> None:
    after = rules.abort(state(active=replace(A1, obsolete=True)), "alice")
    assert after is not None
    assert after.aborted_by == "alice"


def test_clear_abort_allows_prepare_again() -> None:
    aborted = rules.abort(state(), "alice")
    assert aborted is not None
    cleared = rules.clear_abort(aborted)
    assert cleared is not None
    assert cleared.aborted_by is None
    assert cleared.active == aborted.active  # the aborted attempt stays obsolete
    assert rules.prepare(cleared, 3, A1).active == A1


def test_clear_abort_without_an_abort_changes_nothing() -> None:
    assert rules.clear_abort(state()) is None
