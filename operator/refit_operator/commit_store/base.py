"""The `CommitStore` operations on top of one compare-and-set step, written once.

A store implements `_step(rule)`: read the state (None if there is no record yet), apply the
pure `rule` (`commit_store.rules`), write what it returns with a compare-and-set against exactly
what was read, and return the state after the step. Every operation of the contract is then one
rule run through that step; the stores differ only in representation and in how they CAS.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

from refit_operator.commit_store import ActiveAttempt, StoreState, rules
from refit_protocol.commit import CommitRecord


class RuleStore(abc.ABC):
    """A `CommitStore` whose operations are the pure rules run through `_step`."""

    @abc.abstractmethod
    async def _step(self, rule: Callable[[StoreState | None], StoreState | None]) -> StoreState:
        """Read, apply `rule`, compare-and-set what it returns (None: write nothing); the
        state after the step. CommitRefusedError if there is no record, before or after."""

    async def _change(self, rule: Callable[[StoreState], StoreState | None]) -> StoreState:
        """`_step` on the existing record: without one there is nothing to read or change."""
        return await self._step(lambda state: None if state is None else rule(state))

    # -- CommitStore ------------------------------------------------------------------------------
    async def initialize(self, record: CommitRecord) -> StoreState:
        return await self._step(lambda state: rules.initialize(state, record))

    async def read(self) -> StoreState:
        return await self._change(lambda state: None)

    async def acquire(self, coordinator: str) -> int:
        return (await self._change(lambda state: rules.acquire(state, coordinator))).epoch

    async def prepare(self, epoch: int, attempt: ActiveAttempt) -> None:
        await self._change(lambda state: rules.prepare(state, epoch, attempt))

    async def mark_obsolete(self, epoch: int, attempt: str) -> None:
        await self._change(lambda state: rules.mark_obsolete(state, epoch, attempt))

    async def commit(
        self, epoch: int, attempt: str, expected: CommitRecord, new: CommitRecord, now: float
    ) -> CommitRecord:
        state = await self._change(
            lambda state: rules.commit(state, epoch, attempt, expected, new, now)
        )
        return state.record

    async def read_commit(self, epoch: int, attempt: str) -> CommitRecord:
        return (await self._change(lambda state: rules.read_commit(state, attempt))).record

    async def abort(self, by: str) -> None:
        await self._change(lambda state: rules.abort(state, by))

    async def clear_abort(self) -> None:
        await self._change(rules.clear_abort)
