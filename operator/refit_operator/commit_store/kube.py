"""`CommitStore` on a PolicyVersion's status: the commit record lives in the cluster.

Every change reads the object, checks the contract's conditions on what it read, and writes
the status back with that read's `metadata.resourceVersion`; the apiserver answers 409 if
anything else wrote in between, and the change is re-evaluated on a fresh read. So the
conditions always hold against the latest record, exactly as in one SQLite transaction.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable
from typing import Any, TypeVar

from refit_operator.commit_store import (
    ActiveAttempt,
    CommitConflictError,
    CommitRefusedError,
    CommitUnknownError,
    StoreState,
)
from refit_protocol.commit import CommitRecord

GROUP, VERSION, PLURAL = "refit.kuberefit.io", "v1alpha1", "policyversions"
T = TypeVar("T")
_CAS_TRIES = 16


def _ts(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.UTC).isoformat(timespec="microseconds")


def _seconds(stamp: str) -> float:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


class KubernetesCommitStore:
    """The commit record of `policy` in PolicyVersion `policy` of `namespace`.

    `api` is a `kubernetes.client.CustomObjectsApi` (sync client, run in worker threads so the
    operator's event loop never blocks).
    """

    def __init__(self, api: Any, namespace: str, policy: str) -> None:
        self.api = api
        self.namespace = namespace
        self.policy = policy

    # -- plumbing -------------------------------------------------------------------------------
    def _get(self) -> dict[str, Any]:
        obj: dict[str, Any] = self.api.get_namespaced_custom_object_status(
            GROUP, VERSION, self.namespace, PLURAL, self.policy
        )
        return obj

    async def _change(self, fn: Callable[[dict[str, Any]], tuple[dict[str, Any] | None, T]]) -> T:
        """Read-check-write with optimistic concurrency; `fn` gives (new status or None, result)."""
        from kubernetes.client.rest import ApiException

        def run() -> T:
            for _ in range(_CAS_TRIES):
                obj = self._get()
                status, result = fn(dict(obj.get("status") or {}))
                if status is None:
                    return result
                obj["status"] = status
                try:
                    self.api.replace_namespaced_custom_object_status(
                        GROUP, VERSION, self.namespace, PLURAL, self.policy, obj
                    )
                except ApiException as exc:
                    if exc.status == 409:
                        continue  # someone wrote in between: re-check on a fresh read
                    raise
                return result
            raise CommitUnknownError(f"PolicyVersion {self.policy}: too much write contention")

        try:
            return await asyncio.to_thread(run)
        except (CommitConflictError, CommitRefusedError, CommitUnknownError):
            raise
        except ApiException as exc:
            if exc.status == 404:
                raise CommitRefusedError(
                    f"no PolicyVersion {self.namespace}/{self.policy}"
                ) from exc
            raise CommitUnknownError(f"PolicyVersion {self.policy}: HTTP {exc.status}") from exc
        except OSError as exc:
            raise CommitUnknownError(f"PolicyVersion {self.policy}: {exc}") from exc

    @staticmethod
    def _state(status: dict[str, Any]) -> StoreState:
        a = status.get("activeAttempt")
        active = None
        if a:
            active = ActiveAttempt(
                attempt=a["id"],
                target_version=int(a["targetVersion"]),
                baseline_id=a["baselineId"],
                mode=a["mode"],
                deadline=_seconds(a["deadline"]),
                obsolete=bool(a.get("obsolete", False)),
            )
        return StoreState(
            record=CommitRecord(int(status.get("version", 0)), status.get("baselineId", "")),
            epoch=int(status.get("epoch", 0)),
            coordinator=status.get("coordinator", ""),
            active=active,
            aborted_by=status.get("abortedBy"),
        )

    @staticmethod
    def _check_epoch(status: dict[str, Any], epoch: int) -> None:
        if int(status.get("epoch", 0)) != epoch:
            raise CommitConflictError(
                f"coordinator epoch {epoch} was replaced by epoch {status.get('epoch')} "
                f"({status.get('coordinator')})"
            )

    # -- CommitStore ------------------------------------------------------------------------------
    async def initialize(self, record: CommitRecord) -> StoreState:
        from kubernetes.client.rest import ApiException

        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "PolicyVersion",
            "metadata": {"name": self.policy},
            "spec": {"policy": self.policy},
        }

        def create() -> None:
            try:
                self.api.create_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL, body
                )
            except ApiException as exc:
                if exc.status != 409:  # already exists: keep its record
                    raise

        await asyncio.to_thread(create)

        def init(status: dict[str, Any]) -> tuple[dict[str, Any] | None, StoreState]:
            if "version" in status:
                return None, self._state(status)
            status.update(version=record.version, baselineId=record.baseline_id, epoch=0)
            return status, self._state(status)

        return await self._change(init)

    async def read(self) -> StoreState:
        return await self._change(lambda s: (None, self._state(s)))

    async def acquire(self, coordinator: str) -> int:
        def fn(s: dict[str, Any]) -> tuple[dict[str, Any], int]:
            epoch = int(s.get("epoch", 0)) + 1
            s.update(epoch=epoch, coordinator=coordinator)
            return s, epoch

        return await self._change(fn)

    async def prepare(self, epoch: int, attempt: ActiveAttempt) -> None:
        def fn(s: dict[str, Any]) -> tuple[dict[str, Any], None]:
            self._check_epoch(s, epoch)
            if s.get("abortedBy"):
                raise CommitRefusedError(f"transition aborted by {s['abortedBy']}")
            s["activeAttempt"] = {
                "id": attempt.attempt,
                "targetVersion": attempt.target_version,
                "baselineId": attempt.baseline_id,
                "mode": attempt.mode,
                "deadline": _ts(attempt.deadline),
                "obsolete": False,
            }
            return s, None

        await self._change(fn)

    async def mark_obsolete(self, epoch: int, attempt: str) -> None:
        def fn(s: dict[str, Any]) -> tuple[dict[str, Any] | None, None]:
            self._check_epoch(s, epoch)
            a = s.get("activeAttempt")
            if not a or a["id"] != attempt or a.get("obsolete"):
                return None, None
            a["obsolete"] = True
            return s, None

        await self._change(fn)

    async def commit(
        self, epoch: int, attempt: str, expected: CommitRecord, new: CommitRecord, now: float
    ) -> CommitRecord:
        def fn(s: dict[str, Any]) -> tuple[dict[str, Any], CommitRecord]:
            self._check_epoch(s, epoch)
            state = self._state(s)
            if state.record != expected:
                raise CommitConflictError(f"commit record is {state.record}, expected {expected}")
            a = state.active
            if a is None or a.attempt != attempt:
                raise CommitRefusedError(f"{attempt} is not the active attempt")
            if a.obsolete:
                raise CommitRefusedError(f"{attempt} is obsolete")
            if now >= a.deadline:
                raise CommitRefusedError(f"{attempt} missed its commit deadline")
            if (new.version, new.baseline_id) != (a.target_version, a.baseline_id):
                raise CommitRefusedError(f"{attempt} prepared a different target than {new}")
            s.update(version=new.version, baselineId=new.baseline_id)
            s["activeAttempt"]["obsolete"] = True
            return s, new

        return await self._change(fn)

    async def read_commit(self, epoch: int, attempt: str) -> CommitRecord:
        def fn(s: dict[str, Any]) -> tuple[dict[str, Any] | None, CommitRecord]:
            record = self._state(s).record
            a = s.get("activeAttempt")
            if a and a["id"] == attempt and not a.get("obsolete"):
                a["obsolete"] = True  # closes the window: no later commit of it can land
                return s, record
            return None, record

        return await self._change(fn)

    async def abort(self, by: str) -> None:
        def fn(s: dict[str, Any]) -> tuple[dict[str, Any], None]:
            s["abortedBy"] = by
            if s.get("activeAttempt"):
                s["activeAttempt"]["obsolete"] = True
            return s, None

        await self._change(fn)

    async def clear_abort(self) -> None:
        def fn(s: dict[str, Any]) -> tuple[dict[str, Any], None]:
            s["abortedBy"] = None
            return s, None

        await self._change(fn)
