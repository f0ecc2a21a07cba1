"""SqliteCommitStore passes the commit-store contract (two store objects = two processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from refit_operator.commit_store.sqlite import SqliteCommitStore
from tests.operator.commit_store_contract import CommitStoreContract, StoreFactory


@pytest.fixture
def make_store(tmp_path: Path) -> StoreFactory:
    return lambda: SqliteCommitStore(tmp_path / "commit.db", "policy-a")


class TestSqliteCommitStore(CommitStoreContract):
    pass
