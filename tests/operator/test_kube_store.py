"""KubernetesCommitStore passes the commit-store contract against a real kube-apiserver."""

from __future__ import annotations

import uuid

import pytest
from kubernetes import client

from refit_operator.commit_store.kube import KubernetesCommitStore
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
