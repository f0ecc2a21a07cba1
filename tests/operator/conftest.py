"""Fixtures the control plane's tests share: the operator's API client on the harness API
server, and a fresh namespace in it."""

from __future__ import annotations

import uuid

import pytest
from kubernetes import client

from refit_operator.kube.api import KubeApi
from tests.harness.kube import KubeCluster


@pytest.fixture
def api(kube: KubeCluster) -> KubeApi:
    return KubeApi(kube.api_client())


@pytest.fixture
def namespace(api: KubeApi) -> str:
    name = f"op-{uuid.uuid4().hex[:8]}"
    client.CoreV1Api(api.api_client).create_namespace({"metadata": {"name": name}})
    return name
