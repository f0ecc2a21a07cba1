"""`CommitStore` on an embedded SQLite database: the local mode's control plane.

One row per policy; every change runs in one `BEGIN IMMEDIATE` transaction that checks the
row's `row_version` and the conditions of the commit-store contract before writing, so two
coordinators (processes) sharing the file see the same compare-and-set semantics as the
Kubernetes store.
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


class SqliteCommitStore:
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

    def _row(self, db: sqlite3.Connection) -> dict[str, Any]:
        cur = db.execute("SELECT * FROM commit_records WHERE policy = ?", (self.policy,))
        row = cur.fetchone()
        if row is None:
            raise CommitRefusedError(f"no commit record for policy {self.policy!r}")
        return dict(zip([c[0] for c in cur.description], row, strict=True))

    @staticmethod
    def _state(row: dict[str, Any]) -> StoreState:
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

    def _update(self, db: sqlite3.Connection, row: dict[str, Any], **changes: Any) -> None:
        sets = ", ".join(f"{k} = ?" for k in changes)
        cur = db.execute(
            f"UPDATE commit_records SET {sets}, row_version = row_version + 1 "  # noqa: S608
            "WHERE policy = ? AND row_version = ?",
            (*changes.values(), self.policy, row["row_version"]),
        )
        if cur.rowcount != 1:  # pragma: no cover - BEGIN IMMEDIATE serializes writers
            raise CommitConflictError("commit record changed concurrently")

    @staticmethod
    def _check_epoch(row: dict[str, Any], epoch: int) -> None:
        if row["epoch"] != epoch:
            raise CommitConflictError(
                f"coordinator epoch {epoch} was replaced by epoch {row['epoch']} "
                f"({row['coordinator']})"
            )

    # -- CommitStore ------------------------------------------------------------------------------
    async def initialize(self, record: CommitRecord) -> StoreState:
        def fn(db: sqlite3.Connection) -> StoreState:
            db.execute(
                "INSERT OR IGNORE INTO commit_records (policy, version, baseline_id) "
                "VALUES (?, ?, ?)",
                (self.policy, record.version, record.baseline_id),
            )
            return self._state(self._row(db))

        return await self._tx(fn)

    async def read(self) -> StoreState:
        return await self._tx(lambda db: self._state(self._row(db)))

    async def acquire(self, coordinator: str) -> int:
        def fn(db: sqlite3.Connection) -> int:
            row = self._row(db)
            epoch = int(row["epoch"]) + 1
            self._update(db, row, epoch=epoch, coordinator=coordinator)
            return epoch

        return await self._tx(fn)

    async def prepare(self, epoch: int, attempt: ActiveAttempt) -> None:
        def fn(db: sqlite3.Connection) -> None:
            row = self._row(db)
            self._check_epoch(row, epoch)
            if row["aborted_by"]:
                raise CommitRefusedError(f"transition aborted by {row['aborted_by']}")
            self._update(
                db,
                row,
                attempt=attempt.attempt,
                attempt_target=attempt.target_version,
                attempt_baseline=attempt.baseline_id,
                attempt_mode=attempt.mode,
                attempt_deadline=attempt.deadline,
                attempt_obsolete=0,
            )

        await self._tx(fn)

    async def mark_obsolete(self, epoch: int, attempt: str) -> None:
        def fn(db: sqlite3.Connection) -> None:
            row = self._row(db)
            self._check_epoch(row, epoch)
            if row["attempt"] == attempt and not row["attempt_obsolete"]:
                self._update(db, row, attempt_obsolete=1)

        await self._tx(fn)

    async def commit(
        self, epoch: int, attempt: str, expected: CommitRecord, new: CommitRecord, now: float
    ) -> CommitRecord:
        def fn(db: sqlite3.Connection) -> CommitRecord:
            row = self._row(db)
            self._check_epoch(row, epoch)
            current = CommitRecord(row["version"], row["baseline_id"])
            if current != expected:
                raise CommitConflictError(f"commit record is {current}, expected {expected}")
            if row["attempt"] != attempt:
                raise CommitRefusedError(f"{attempt} is not the active attempt ({row['attempt']})")
            if row["attempt_obsolete"]:
                raise CommitRefusedError(f"{attempt} is obsolete")
            if now >= row["attempt_deadline"]:
                raise CommitRefusedError(f"{attempt} missed its commit deadline")
            if (new.version, new.baseline_id) != (row["attempt_target"], row["attempt_baseline"]):
                raise CommitRefusedError(f"{attempt} prepared a different target than {new}")
            self._update(
                db, row, version=new.version, baseline_id=new.baseline_id, attempt_obsolete=1
            )
            return new

        return await self._tx(fn)

    async def read_commit(self, epoch: int, attempt: str) -> CommitRecord:
        def fn(db: sqlite3.Connection) -> CommitRecord:
            row = self._row(db)
            # Marking the attempt obsolete closes the window: no later commit of it can land.
            if row["attempt"] == attempt and not row["attempt_obsolete"]:
                self._update(db, row, attempt_obsolete=1)
            return CommitRecord(row["version"], row["baseline_id"])

        return await self._tx(fn)

    async def abort(self, by: str) -> None:
        def fn(db: sqlite3.Connection) -> None:
            row = self._row(db)
            self._update(db, row, aborted_by=by, attempt_obsolete=1)

        await self._tx(fn)

    async def clear_abort(self) -> None:
        def fn(db: sqlite3.Connection) -> None:
            row = self._row(db)
            self._update(db, row, aborted_by=None)

        await self._tx(fn)
