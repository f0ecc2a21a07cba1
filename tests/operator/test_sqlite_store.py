"""SqliteCommitStore passes the commit-store contract (two store objects = two processes)."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from refit_operator.commit_store import ActiveAttempt, CommitRefusedError
from refit_operator.commit_store.sqlite import SqliteCommitStore
from refit_protocol.commit import CommitRecord
from tests.operator.commit_store_contract import CommitStoreContract, StoreFactory


@pytest.fixture
def make_store(tmp_path: Path) -> StoreFactory:
    return lambda: SqliteCommitStore(tmp_path / "commit.db", "policy-a")


class TestSqliteCommitStore(CommitStoreContract):
    pass


def raw_row(path: Path, policy: str) -> dict[str, Any]:
    with contextlib.closing(sqlite3.connect(path)) as db:
        cur = db.execute("SELECT * FROM commit_records WHERE policy = ?", (policy,))
        row = cur.fetchone()
        return dict(zip([c[0] for c in cur.description], row, strict=True))


async def test_row_layout_is_unchanged(tmp_path: Path) -> None:
    """The columns hold what earlier releases wrote, so existing databases stay valid."""
    path = tmp_path / "commit.db"
    store = SqliteCommitStore(path, "p")
    await store.initialize(CommitRecord(0, "b0"))
    assert raw_row(path, "p") == {
        "policy": "p",
        "version": 0,
        "baseline_id": "b0",
        "epoch": 0,
        "coordinator": "",
        "attempt": None,
        "attempt_target": None,
        "attempt_baseline": None,
        "attempt_mode": None,
        "attempt_deadline": None,
        "attempt_obsolete": 0,
        "aborted_by": None,
        "row_version": 0,
    }
    epoch = await store.acquire("c1")
    deadline = time.time() + 60
    await store.prepare(epoch, ActiveAttempt("a1", 1, "b1", "mixed", deadline))
    await store.commit(epoch, "a1", CommitRecord(0, "b0"), CommitRecord(1, "b1"), time.time())
    await store.abort("alice")
    assert raw_row(path, "p") == {
        "policy": "p",
        "version": 1,
        "baseline_id": "b1",
        "epoch": 1,
        "coordinator": "c1",
        "attempt": "a1",
        "attempt_target": 1,
        "attempt_baseline": "b1",
        "attempt_mode": "mixed",
        "attempt_deadline": deadline,
        "attempt_obsolete": 1,
        "aborted_by": "alice",
        "row_version": 4,
    }


async def test_missing_record_is_refused(tmp_path: Path) -> None:
    store = SqliteCommitStore(tmp_path / "commit.db", "p")
    with pytest.raises(CommitRefusedError):
        await store.read()
    with pytest.raises(CommitRefusedError):
        await store.acquire("c1")
