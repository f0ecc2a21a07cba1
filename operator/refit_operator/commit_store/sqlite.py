"""`CommitStore` on an embedded SQLite database: the local mode's control plane.

One row per policy. Every operation is one `BEGIN IMMEDIATE` transaction that reads the row,
applies the operation's rule (`commit_store.rules`, shared with the Kubernetes store) and writes
the changed columns back under a `row_version` check, so two coordinators (processes) sharing
the file see the same compare-and-set semantics as the Kubernetes store.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from refit_operator.commit_store import (
    ActiveAttempt,
    CommitConflictError,
    CommitRefusedError,
    CommitUnknownError,
    StoreState,
)
from refit_operator.commit_store.base import RuleStore
from refit_protocol.commit import CommitRecord

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS commit_records (
    policy TEXT PRIMARY KEY,
    version INTEGER NOT NULL,
    baseline_id TEXT NOT NULL,
    epoch INTEGER NOT NULL DEFAULT 0,
    coordinator TEXT NOT NULL DEFAULT '',
    attempt TEXT,
    attempt_target INTEGER,
    attempt_baseline TEXT,
    attempt_mode TEXT,
    attempt_deadline REAL,
    attempt_obsolete INTEGER NOT NULL DEFAULT 0,
    aborted_by TEXT,
    row_version INTEGER NOT NULL DEFAULT 0
)
"""


def _load(row: dict[str, Any]) -> StoreState:
    """The state a `commit_records` row holds."""
    active = None
    if row["attempt"] is not None:
        active = ActiveAttempt(
            attempt=row["attempt"],
            target_version=row["attempt_target"],
            baseline_id=row["attempt_baseline"],
            mode=row["attempt_mode"],
            deadline=row["attempt_deadline"],
            obsolete=bool(row["attempt_obsolete"]),
        )
    return StoreState(
        record=CommitRecord(row["version"], row["baseline_id"]),
        epoch=row["epoch"],
        coordinator=row["coordinator"],
        active=active,
        aborted_by=row["aborted_by"],
    )


def _columns(state: StoreState) -> dict[str, Any]:
    """The column values that hold `state` (every column but `policy` and `row_version`)."""
    a = state.active
    return {
        "version": state.record.version,
        "baseline_id": state.record.baseline_id,
        "epoch": state.epoch,
        "coordinator": state.coordinator,
        "attempt": None if a is None else a.attempt,
        "attempt_target": None if a is None else a.target_version,
        "attempt_baseline": None if a is None else a.baseline_id,
        "attempt_mode": None if a is None else a.mode,
        "attempt_deadline": None if a is None else a.deadline,
        "attempt_obsolete": int(a is not None and a.obsolete),
        "aborted_by": state.aborted_by,
    }


class SqliteCommitStore(RuleStore):
    """Commit record of `policy` in the SQLite file `path` (created if missing)."""

    def __init__(self, path: Path | str, policy: str) -> None:
        self.path = Path(path)
        self.policy = policy
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # `with connection` only ends a transaction; closing() also releases the file handle.
        with contextlib.closing(self._connect()) as db:
            db.execute(_SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        return db

    async def _tx(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def run() -> T:
            try:
                db = self._connect()
            except sqlite3.Error as exc:  # pragma: no cover - unreadable file
                raise CommitUnknownError(f"commit store {self.path}: {exc}") from exc
            try:
                db.execute("BEGIN IMMEDIATE")
                try:
                    out = fn(db)
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                db.execute("COMMIT")
                return out
            except sqlite3.OperationalError as exc:
                raise CommitUnknownError(f"commit store {self.path}: {exc}") from exc
            finally:
                db.close()

        return await asyncio.to_thread(run)

    async def _step(self, rule: Callable[[StoreState | None], StoreState | None]) -> StoreState:
        """Read the row (None if missing), apply `rule`, write the state it returns; one
        transaction, so the rule's checks hold against exactly the row it replaces. Returns the
        state after the step (CommitRefusedError if there is still no record)."""

        def fn(db: sqlite3.Connection) -> StoreState:
            cur = db.execute("SELECT * FROM commit_records WHERE policy = ?", (self.policy,))
            found, names = cur.fetchone(), [c[0] for c in cur.description]
            row = None if found is None else dict(zip(names, found, strict=True))
            before = None if row is None else _load(row)
            after = rule(before)
            if after is None:
                if before is None:
                    raise CommitRefusedError(f"no commit record for policy {self.policy!r}")
                return before
            columns = _columns(after)
            if row is None:
                into = ", ".join(["policy", *columns])
                marks = ", ".join("?" * (len(columns) + 1))
                db.execute(
                    f"INSERT INTO commit_records ({into}) VALUES ({marks})",  # noqa: S608
                    (self.policy, *columns.values()),
                )
                return after
            changed = {k: v for k, v in columns.items() if row[k] != v}
            sets = "".join(f"{k} = ?, " for k in changed)
            cur = db.execute(
                f"UPDATE commit_records SET {sets}row_version = row_version + 1 "  # noqa: S608
                "WHERE policy = ? AND row_version = ?",
                (*changed.values(), self.policy, row["row_version"]),
            )
            if cur.rowcount != 1:  # pragma: no cover - BEGIN IMMEDIATE serializes writers
                raise CommitConflictError("commit record changed concurrently")
            return after

        return await self._tx(fn)
