"""KubernetesCommitStore passes the commit-store contract against a real kube-apiserver."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from kubernetes import client

from refit_operator.commit_store import ActiveAttempt, CommitConflictError, CommitRefusedError
from refit_operator.commit_store.kube import GROUP, PLURAL, VERSION, KubernetesCommitStore
from refit_protocol.commit import CommitRecord
from tests.harness.kube import KubeCluster
from tests.operator.commit_store_contract import CommitStoreContract, StoreFactory


@pytest.fixture
def make_store(refit_crds: KubeCluster) -> StoreFactory:
    policy = f"policy-{uuid.uuid4().hex[:8]}"
    # Each call builds its own API client: two store objects stand for two coordinators.
    return lambda: KubernetesCommitStore(
        client.CustomObjectsApi(refit_crds.api_client()), "default", policy
    )


class TestKubernetesCommitStore(CommitStoreContract):
    pass


@pytest.fixture
def store(refit_crds: KubeCluster) -> KubernetesCommitStore:
    api = client.CustomObjectsApi(refit_crds.api_client())
    return KubernetesCommitStore(api, "default", f"policy-{uuid.uuid4().hex[:8]}")


def status(store: KubernetesCommitStore) -> dict[str, Any]:
    obj = store.api.get_namespaced_custom_object_status(
        GROUP, VERSION, store.namespace, PLURAL, store.policy
    )
    return dict(obj["status"])


async def test_status_layout_is_unchanged(store: KubernetesCommitStore) -> None:
    """The status holds what earlier releases wrote, so existing PolicyVersions stay valid."""
    await store.initialize(CommitRecord(0, "b0"))
    assert status(store) == {"version": 0, "baselineId": "b0", "epoch": 0}
    epoch = await store.acquire("c1")
    await store.prepare(epoch, ActiveAttempt("a1", 1, "b1", "mixed", 1_900_000_000.25))
    assert status(store)["openAttempt"] == "a1"  # the ACTIVE ATTEMPT column: may still commit
    await store.commit(epoch, "a1", CommitRecord(0, "b0"), CommitRecord(1, "b1"), time.time())
    await store.abort("alice")
    assert status(store) == {
        "version": 1,
        "baselineId": "b1",
        "epoch": 1,
        "coordinator": "c1",
        "activeAttempt": {
            "id": "a1",
            "targetVersion": 1,
            "baselineId": "b1",
            "mode": "mixed",
            "deadline": "2030-03-17T17:46:40.250000+00:00",
            "obsolete": True,
        },
        "abortedBy": "alice",
    }  # no openAttempt once committed: ACTIVE ATTEMPT prints <none>
    await store.clear_abort()
    assert "abortedBy" not in status(store)  # removed, not null: kubectl prints <none>


async def test_unchanged_fields_keep_their_stored_form(store: KubernetesCommitStore) -> None:
    """A deadline written in another valid form (here with Z) is not re-rendered by a change."""
    await store.initialize(CommitRecord(0, "b0"))
    epoch = await store.acquire("c1")
    obj = store.api.get_namespaced_custom_object_status(
        GROUP, VERSION, store.namespace, PLURAL, store.policy
    )
    obj["status"]["activeAttempt"] = {
        "id": "a1",
        "targetVersion": 1,
        "baselineId": "b1",
        "mode": "mixed",
        "deadline": "2030-03-17T17:46:40.25Z",
        "obsolete": False,
    }
    store.api.replace_namespaced_custom_object_status(
        GROUP, VERSION, store.namespace, PLURAL, store.policy, obj
    )
    active = (await store.read()).active
    assert active is not None
    assert active.deadline == 1_900_000_000.25
    await store.mark_obsolete(epoch, "a1")
    assert status(store)["activeAttempt"] == {**obj["status"]["activeAttempt"], "obsolete": True}


async def test_missing_record_is_refused(store: KubernetesCommitStore) -> None:
    with pytest.raises(CommitRefusedError):  # no PolicyVersion at all (404)
        await store.read()
    with pytest.raises(CommitRefusedError):
        await store.acquire("c1")


class RacingWriterFault:
    """A fault wrapper around the real CustomObjectsApi: right after each of the next `races`
    status reads it lands a competing write of the record (another coordinator taking over:
    epoch + 1) with the real API, so what the store just read is stale before it writes.
    Only a real compare-and-set on the read's resourceVersion refuses the store's write; one
    that re-reads the resourceVersion before writing (a blind write) does not."""

    def __init__(self, api: Any, races: int) -> None:
        self._api = api
        self.races = races
        self.landed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._api, name)

    def get_namespaced_custom_object_status(self, *args: Any) -> Any:
        obj = self._api.get_namespaced_custom_object_status(*args)
        if self.landed < self.races:
            self.landed += 1
            fresh = self._api.get_namespaced_custom_object_status(*args)
            fresh["status"]["epoch"] = int(fresh["status"]["epoch"]) + 1
            fresh["status"]["coordinator"] = f"racer-{self.landed}"
            self._api.replace_namespaced_custom_object_status(*args, fresh)
        return obj


async def test_a_write_landing_between_read_and_replace_makes_the_commit_conflict(
    refit_crds: KubeCluster,
) -> None:
    """Deterministic compare-and-set: a takeover lands between the commit's read and its
    replace, every time. The commit must raise CommitConflictError and leave the record as the
    takeover wrote it (a blind write would commit v1 over it)."""
    api = client.CustomObjectsApi(refit_crds.api_client())
    store = KubernetesCommitStore(api, "default", f"policy-cas-{uuid.uuid4().hex[:8]}")
    await store.initialize(CommitRecord(0, "b0"))
    epoch = await store.acquire("c1")
    await store.prepare(epoch, ActiveAttempt("a1", 1, "b1", "mixed", time.time() + 600))
    racing = RacingWriterFault(api, races=1)
    store.api = racing
    with pytest.raises(CommitConflictError):
        await store.commit(epoch, "a1", CommitRecord(0, "b0"), CommitRecord(1, "b1"), time.time())
    assert racing.landed == 1
    after = status(store)
    assert after["version"] == 0  # nothing committed
    assert after["baselineId"] == "b0"
    assert after["epoch"] == epoch + 1
    assert after["coordinator"] == "racer-1"
