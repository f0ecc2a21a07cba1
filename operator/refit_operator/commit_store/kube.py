"""`CommitStore` on a PolicyVersion's status: the commit record lives in the cluster.

Every operation reads the object, applies the operation's rule (`commit_store.rules`, shared
with the SQLite store) to the state its status holds, and writes the status back with that
read's `metadata.resourceVersion`; the apiserver answers 409 if anything else wrote in between,
and the rule is re-applied on a fresh read. So the conditions always hold against the latest
record, exactly as in one SQLite transaction.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable
from typing import Any

from refit_operator.commit_store import (
    ActiveAttempt,
    CommitConflictError,
    CommitRefusedError,
    CommitUnknownError,
    StoreState,
)
from refit_operator.commit_store.base import RuleStore
from refit_protocol.commit import CommitRecord

GROUP, VERSION, PLURAL = "refit.kuberefit.io", "v1alpha1", "policyversions"
_CAS_TRIES = 16


def _ts(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).isoformat(timespec="microseconds")


def _seconds(stamp: str) -> float:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


#: Status fields a fresh record leaves out, and what their absence reads as.
_ABSENT: dict[str, Any] = {
    "coordinator": "",
    "activeAttempt": None,
    "openAttempt": None,
    "abortedBy": None,
}


def _load(status: dict[str, Any]) -> StoreState | None:
    """The state a PolicyVersion status holds; None before `initialize` wrote a record."""
    if "version" not in status:
        return None
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
        record=CommitRecord(int(status["version"]), status.get("baselineId", "")),
        epoch=int(status.get("epoch", 0)),
        coordinator=status.get("coordinator", _ABSENT["coordinator"]),
        active=active,
        aborted_by=status.get("abortedBy", _ABSENT["abortedBy"]),
    )


def _fields(state: StoreState) -> dict[str, Any]:
    """The status fields that hold `state` (the names of the PolicyVersion CRD)."""
    a = state.active
    attempt = None
    if a is not None:
        attempt = {
            "id": a.attempt,
            "targetVersion": a.target_version,
            "baselineId": a.baseline_id,
            "mode": a.mode,
            "deadline": _ts(a.deadline),
            "obsolete": a.obsolete,
        }
    return {
        "version": state.record.version,
        "baselineId": state.record.baseline_id,
        "epoch": state.epoch,
        "coordinator": state.coordinator,
        "activeAttempt": attempt,
        # Derived, for the ACTIVE ATTEMPT column: only an attempt that may still commit.
        "openAttempt": a.attempt if a is not None and not a.obsolete else None,
        "abortedBy": state.aborted_by,
    }


def _dump(status: dict[str, Any], before: StoreState | None, after: StoreState) -> dict[str, Any]:
    """`status` with the fields in which `after` differs from `before` rewritten.

    Everything else keeps its stored form (a deadline is not re-rendered), and a field a fresh
    record leaves out stays out while it holds what its absence reads as (a cleared abort or
    attempt is removed, not stored as null).
    """
    old = {} if before is None else _fields(before)
    out = dict(status)
    for key, value in _fields(after).items():
        if key in old and old[key] == value:
            continue
        if key in _ABSENT and _ABSENT[key] == value and (key not in out or value is None):
            out.pop(key, None)  # absent, not null: kubectl prints "<none>" for it
            continue
        stored, previous = out.get(key), old.get(key)
        if isinstance(value, dict) and isinstance(stored, dict) and isinstance(previous, dict):
            value = {**stored, **{k: v for k, v in value.items() if previous.get(k) != v}}
        out[key] = value
    return out


class KubernetesCommitStore(RuleStore):
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

    async def _step(self, rule: Callable[[StoreState | None], StoreState | None]) -> StoreState:
        """Read the status, apply `rule`, write the state it returns with optimistic concurrency
        (re-applied on a fresh read after a 409). Returns the state after the step
        (CommitRefusedError if there is still no record)."""
        from kubernetes.client.rest import ApiException

        def run() -> StoreState:
            for _ in range(_CAS_TRIES):
                obj = self._get()
                status = dict(obj.get("status") or {})
                before = _load(status)
                after = rule(before)
                if after is None:
                    if before is None:
                        raise CommitRefusedError(
                            f"PolicyVersion {self.namespace}/{self.policy} has no commit record"
                        )
                    return before
                obj["status"] = _dump(status, before, after)
                try:
                    self.api.replace_namespaced_custom_object_status(
                        GROUP, VERSION, self.namespace, PLURAL, self.policy, obj
                    )
                except ApiException as exc:
                    if exc.status == 409:
                        continue  # someone wrote in between: re-check on a fresh read
                    raise
                return after
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
        return await super().initialize(record)
