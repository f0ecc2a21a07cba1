"""The commit record and its compare-and-set store (paper §6.3, Appendix B.2).

The record K = (version, baseline_id) says which policy version is published and which source
baseline it is bound to. Next to it the store keeps the active coordinator (an epoch that a
takeover increments) and the active attempt with its commit deadline. Every change is a
compare-and-set, so a write by a newer coordinator or attempt makes an older one's fail:

- a replaced coordinator's prepare or commit raises `CommitConflictError`;
- a commit of an attempt that is not the active one, is marked obsolete or is past its deadline
  is refused (`CommitRefusedError`: the outcome is a confirmed failure, the record is unchanged);
- a commit whose expected record no longer matches raises `CommitConflictError`.

These rules are written once, as pure functions over `StoreState` in `commit_store.rules`.
The implementations only translate `StoreState` to and from their representation and run each
rule inside one compare-and-set step: `SqliteCommitStore` (`sqlite.py`, local mode: one row per
policy, `BEGIN IMMEDIATE` transaction) and `KubernetesCommitStore` (`kube.py`: PolicyVersion
status, resourceVersion CAS). Both pass tests/operator/commit_store_contract.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from refit_protocol.commit import AttemptMode, CommitRecord


@dataclass(frozen=True)
class ActiveAttempt:
    attempt: str
    target_version: int
    baseline_id: str  # g: the candidate baseline this attempt would commit
    mode: AttemptMode
    deadline: float  # unix seconds; no commit of this attempt is accepted at or after it
    obsolete: bool = False


@dataclass(frozen=True)
class StoreState:
    record: CommitRecord
    epoch: int
    coordinator: str
    active: ActiveAttempt | None
    aborted_by: str | None = None


class CommitStoreError(RuntimeError):
    """Base class of commit store failures."""


class CommitConflictError(CommitStoreError):
    """Another coordinator took over or committed first: stop without retrying."""


class CommitRefusedError(CommitStoreError):
    """The commit was not applied (obsolete, past deadline or not the active attempt)."""


class CommitUnknownError(CommitStoreError):
    """The store could not be reached to confirm the outcome; resolve with read_commit."""


class CommitStore(Protocol):
    """Durable, compare-and-set commit record for one policy."""

    async def initialize(self, record: CommitRecord) -> StoreState:
        """Create the record at `record` if it does not exist; return the current state."""
        ...

    async def read(self) -> StoreState: ...

    async def acquire(self, coordinator: str) -> int:
        """Become the active coordinator; returns the new epoch (older epochs now conflict)."""
        ...

    async def prepare(self, epoch: int, attempt: ActiveAttempt) -> None:
        """Register `attempt` as the active one (replacing any earlier attempt)."""
        ...

    async def mark_obsolete(self, epoch: int, attempt: str) -> None:
        """From now on no commit of `attempt` is accepted (idempotent)."""
        ...

    async def commit(
        self, epoch: int, attempt: str, expected: CommitRecord, new: CommitRecord, now: float
    ) -> CommitRecord:
        """Replace `expected` by `new` iff every condition holds; returns the new record."""
        ...

    async def read_commit(self, epoch: int, attempt: str) -> CommitRecord:
        """The record once no commit of `attempt` can change it any more (marks it obsolete)."""
        ...

    async def abort(self, by: str) -> None:
        """Operator abort: the active attempt becomes obsolete and the transition stops."""
        ...

    async def clear_abort(self) -> None: ...
