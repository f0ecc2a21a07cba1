"""The commit-store contract as pure functions over `StoreState` (paper Algorithm B.2).

Each store (SQLite row, PolicyVersion status) only reads its state, applies one of these rules
and writes the result back with a compare-and-set, so the conditions below are written once and
hold identically in both. A rule returns the new state, or None when nothing changes (then the
store writes nothing), and raises the contract's errors when the operation must not happen; it
never performs I/O and never mutates its argument (the dataclasses are frozen).
"""

from __future__ import annotations

from dataclasses import replace

from refit_operator.commit_store import (
    ActiveAttempt,
    CommitConflictError,
    CommitRefusedError,
    StoreState,
)
from refit_protocol.commit import CommitRecord


def _check_epoch(state: StoreState, epoch: int) -> None:
    """A coordinator whose epoch was replaced by a takeover must stop: its writes conflict."""
    if state.epoch != epoch:
        raise CommitConflictError(
            f"coordinator epoch {epoch} was replaced by epoch {state.epoch} ({state.coordinator})"
        )


def _close(state: StoreState, attempt: str) -> StoreState | None:
    """`state` with `attempt` marked obsolete; None if it is not the active one or already is."""
    active = state.active
    if active is None or active.attempt != attempt or active.obsolete:
        return None
    return replace(state, active=replace(active, obsolete=True))


def initialize(state: StoreState | None, record: CommitRecord) -> StoreState | None:
    """A new record at `record` where none exists; an existing one is kept as it is (None), so a
    restarted coordinator never resets a published version."""
    if state is not None:
        return None
    return StoreState(record=record, epoch=0, coordinator="", active=None)


def acquire(state: StoreState, coordinator: str) -> StoreState:
    """`coordinator` takes over under the next epoch (`.epoch` of the result): every write
    carrying an older epoch conflicts from now on."""
    return replace(state, epoch=state.epoch + 1, coordinator=coordinator)


def prepare(state: StoreState, epoch: int, attempt: ActiveAttempt) -> StoreState:
    """`attempt` becomes the active attempt, replacing (and so disarming) any earlier one.

    Refused while an operator abort is set; a replaced coordinator conflicts first.
    """
    _check_epoch(state, epoch)
    if state.aborted_by:
        raise CommitRefusedError(f"transition aborted by {state.aborted_by}")
    return replace(state, active=replace(attempt, obsolete=False))


def mark_obsolete(state: StoreState, epoch: int, attempt: str) -> StoreState | None:
    """No commit of `attempt` is accepted from now on; None if it is not active or already
    obsolete (idempotent)."""
    _check_epoch(state, epoch)
    return _close(state, attempt)


def commit(
    state: StoreState,
    epoch: int,
    attempt: str,
    expected: CommitRecord,
    new: CommitRecord,
    now: float,
) -> StoreState:
    """The record replaced by `new`, iff every condition of the compare-and-set holds.

    Conflict (stop, do not retry): the epoch was replaced, or the record is no longer `expected`.
    Refused (a confirmed failure, nothing changed): `attempt` is not the active attempt, it is
    obsolete, `now` is at or past its deadline, or `new` is not the target it prepared. The
    committed attempt becomes obsolete, so it can never commit a second time.
    """
    _check_epoch(state, epoch)
    if state.record != expected:
        raise CommitConflictError(f"commit record is {state.record}, expected {expected}")
    active = state.active
    if active is None or active.attempt != attempt:
        current = None if active is None else active.attempt
        raise CommitRefusedError(f"{attempt} is not the active attempt ({current})")
    if active.obsolete:
        raise CommitRefusedError(f"{attempt} is obsolete")
    if now >= active.deadline:
        raise CommitRefusedError(f"{attempt} missed its commit deadline")
    if (new.version, new.baseline_id) != (active.target_version, active.baseline_id):
        raise CommitRefusedError(f"{attempt} prepared a different target than {new}")
    return replace(state, record=new, active=replace(active, obsolete=True))


def read_commit(state: StoreState, attempt: str) -> StoreState | None:
    """Close `attempt`'s window (mark it obsolete) so the record read with it is final.

    No epoch check: a replaced coordinator learns the outcome of its attempt this way. None if
    the window is already closed; the record itself never changes here.
    """
    return _close(state, attempt)


def abort(state: StoreState, by: str) -> StoreState | None:
    """Operator abort: the active attempt becomes obsolete and prepare is refused until
    `clear_abort`. None if exactly this abort is already in place."""
    active = state.active
    if state.aborted_by == by and (active is None or active.obsolete):
        return None
    return replace(
        state, aborted_by=by, active=None if active is None else replace(active, obsolete=True)
    )


def clear_abort(state: StoreState) -> StoreState | None:
    """Lift the operator abort so attempts can be prepared again; None if none is set."""
    if state.aborted_by is None:
        return None
    return replace(state, aborted_by=None)
