"""The contract every `CommitStore` implementation passes (SQLite now, Kubernetes next).

Subclass `CommitStoreContract` and provide the `make_store` fixture: a factory that returns a
new store object for the same policy each call (two calls model two coordinator processes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from refit_operator.commit_store import (
    ActiveAttempt,
    CommitConflictError,
    CommitRefusedError,
    CommitStore,
)
from refit_protocol.commit import CommitRecord

K0 = CommitRecord(0, "b0")
K1 = CommitRecord(1, "b1")

StoreFactory = Callable[[], CommitStore]


def attempt(name: str, target: int = 1, baseline: str = "b1", ttl: float = 60.0) -> ActiveAttempt:
    return ActiveAttempt(name, target, baseline, "mixed", time.time() + ttl)


class CommitStoreContract:
    async def test_initialize_is_idempotent(self, make_store: StoreFactory) -> None:
        store = make_store()
        state = await store.initialize(K0)
        assert state.record == K0
        again = await make_store().initialize(CommitRecord(9, "other"))
        assert again.record == K0
        assert (await store.read()).active is None

    async def test_prepare_then_commit(self, make_store: StoreFactory) -> None:
        store = make_store()
        await store.initialize(K0)
        epoch = await store.acquire("c1")
        await store.prepare(epoch, attempt("a1"))
        active = (await store.read()).active
        assert active is not None
        assert (active.attempt, active.target_version, active.baseline_id) == ("a1", 1, "b1")
        assert not active.obsolete
        assert await store.commit(epoch, "a1", K0, K1, time.time()) == K1
        state = await store.read()
        assert state.record == K1
        # A committed attempt cannot commit again.
        with pytest.raises((CommitRefusedError, CommitConflictError)):
            await store.commit(epoch, "a1", K1, CommitRecord(2, "b2"), time.time())

    async def test_newer_attempt_makes_older_commit_fail(self, make_store: StoreFactory) -> None:
        store = make_store()
        await store.initialize(K0)
        epoch = await store.acquire("c1")
        await store.prepare(epoch, attempt("a1"))
        await store.prepare(epoch, attempt("a2", baseline="b1-retry"))
        with pytest.raises(CommitRefusedError):
            await store.commit(epoch, "a1", K0, K1, time.time())
        assert (await store.read()).record == K0
        assert await store.commit(epoch, "a2", K0, CommitRecord(1, "b1-retry"), time.time())

    async def test_obsolete_attempt_cannot_commit(self, make_store: StoreFactory) -> None:
        store = make_store()
        await store.initialize(K0)
        epoch = await store.acquire("c1")
        await store.prepare(epoch, attempt("a1"))
        await store.mark_obsolete(epoch, "a1")
        await store.mark_obsolete(epoch, "a1")  # idempotent
        with pytest.raises(CommitRefusedError):
            await store.commit(epoch, "a1", K0, K1, time.time())
        assert (await store.read()).record == K0

    async def test_deadline_bounds_commit(self, make_store: StoreFactory) -> None:
        store = make_store()
        await store.initialize(K0)
        epoch = await store.acquire("c1")
        await store.prepare(epoch, attempt("a1", ttl=1.0))
        with pytest.raises(CommitRefusedError):
            await store.commit(epoch, "a1", K0, K1, time.time() + 5)
        assert (await store.read()).record == K0

    async def test_commit_checks_expected_record_and_target(self, make_store: StoreFactory) -> None:
        store = make_store()
        await store.initialize(K0)
        epoch = await store.acquire("c1")
        await store.prepare(epoch, attempt("a1"))
        with pytest.raises(CommitConflictError):
            await store.commit(epoch, "a1", CommitRecord(5, "x"), K1, time.time())
        with pytest.raises(CommitRefusedError):
            await store.commit(epoch, "a1", K0, CommitRecord(1, "not-prepared"), time.time())
        assert (await store.read()).record == K0

    async def test_takeover_conflicts_the_replaced_coordinator(
        self, make_store: StoreFactory
    ) -> None:
        old, new = make_store(), make_store()
        await old.initialize(K0)
        e_old = await old.acquire("old")
        await old.prepare(e_old, attempt("a1"))
        e_new = await new.acquire("new")
        assert e_new > e_old
        with pytest.raises(CommitConflictError):
            await old.commit(e_old, "a1", K0, K1, time.time())
        with pytest.raises(CommitConflictError):
            await old.prepare(e_old, attempt("a9"))
        # The new coordinator reads the old attempt's outcome once it can no longer change.
        assert await new.read_commit(e_new, "a1") == K0
        await new.prepare(e_new, attempt("a2", baseline="b1x"))
        assert await new.commit(e_new, "a2", K0, CommitRecord(1, "b1x"), time.time())
        # The replaced coordinator learns of the conflict through read_commit.
        assert await old.read_commit(e_old, "a1") == CommitRecord(1, "b1x")

    async def test_read_commit_closes_the_window(self, make_store: StoreFactory) -> None:
        store = make_store()
        await store.initialize(K0)
        epoch = await store.acquire("c1")
        await store.prepare(epoch, attempt("a1"))
        assert await store.read_commit(epoch, "a1") == K0
        with pytest.raises(CommitRefusedError):
            await store.commit(epoch, "a1", K0, K1, time.time())

    async def test_abort_stops_prepare_until_cleared(self, make_store: StoreFactory) -> None:
        store = make_store()
        await store.initialize(K0)
        epoch = await store.acquire("c1")
        await store.prepare(epoch, attempt("a1"))
        await store.abort("operator:alice")
        state = await store.read()
        assert state.aborted_by == "operator:alice"
        with pytest.raises(CommitRefusedError):
            await store.commit(epoch, "a1", K0, K1, time.time())
        with pytest.raises(CommitRefusedError):
            await store.prepare(epoch, attempt("a2"))
        await store.clear_abort()
        await store.prepare(epoch, attempt("a3"))

    async def test_racing_commits_exactly_one_wins(self, make_store: StoreFactory) -> None:
        a, b = make_store(), make_store()
        await a.initialize(K0)
        epoch = await a.acquire("c1")
        await a.prepare(epoch, attempt("a1"))
        results = await asyncio.gather(
            a.commit(epoch, "a1", K0, K1, time.time()),
            b.commit(epoch, "a1", K0, K1, time.time()),
            return_exceptions=True,
        )
        assert sum(r == K1 for r in results) == 1
        assert sum(isinstance(r, (CommitRefusedError, CommitConflictError)) for r in results) == 1
        assert (await b.read()).record == K1
