"""Session-scoped fixtures that start the real components KubeRefit is tested against.

Every fixture starts its component on free 127.0.0.1 ports, waits a bounded time for it (failing
with the component's log tail), and stops it by PID at the end of the session. A component that
is missing fails the test with instructions; nothing is skipped (in CI or elsewhere).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, Phase, settings

from tests.harness.kube import KubeCluster, start_kube
from tests.harness.s3 import S3Server, start_s3

REPO = Path(__file__).resolve().parents[1]


def _warm_up_dispatch_modes() -> None:
    """`make mutation` runs each mutant's tests in a child forked from a server that only
    collected them. A process's first `TorchDispatchMode` costs ~2.5 s of CPU (lazy imports),
    which every child would pay against its CPU-time limit: pay it once, in the server."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Passthrough(TorchDispatchMode):  # type: ignore[no-untyped-call]
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    with _Passthrough():
        torch.zeros(1).copy_(torch.ones(1))


# Property tests in CI ($CI set): the same seeded examples every run (derandomize), no example
# database, no per-example deadline (CI machines are loaded; tests bound their own time).
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# Mutation testing (`make mutation`) runs the property tests once per mutant: fewer examples,
# the same ones every run, so a mutant's verdict does not depend on the draw, and no shrinking:
# the first failing example kills the mutant (shrinking it ran into the per-mutant time limit,
# so caught mutants were reported as timeouts).
settings.register_profile(
    "mutation",
    derandomize=True,
    database=None,
    max_examples=25,
    deadline=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow],
)
if os.environ.get("KUBEREFIT_MUTATION"):
    settings.load_profile("mutation")
    _warm_up_dispatch_modes()
elif os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    """A failed test whose fixtures keep component logs (a `failure_logs()` method) reports
    their tails beside the assertion: a CI run on another machine shows only its output."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    for name, value in getattr(item, "funcargs", {}).items():
        logs = getattr(value, "failure_logs", None)
        if callable(logs):
            try:
                text = logs()
            except Exception as exc:  # a diagnosis must not hide the failure
                text = f"(could not read the logs: {exc!r})"
            report.sections.append((f"logs of the fixture {name!r}", text))


@pytest.fixture(scope="session")
def artifacts_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where component logs go: $KUBEREFIT_ARTIFACTS if set, else a pytest temp dir."""
    root = os.environ.get("KUBEREFIT_ARTIFACTS")
    path = Path(root) if root else tmp_path_factory.mktemp("artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def kube(artifacts_dir: Path) -> Iterator[KubeCluster]:
    """A real kube-apiserver v1.20.2 + etcd; KUBECONFIG points at an admin kubeconfig."""
    cluster = start_kube(artifacts_dir / "kube")
    old = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
    try:
        yield cluster
    finally:
        if old is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = old
        cluster.stop()


@pytest.fixture(scope="session")
def refit_crds(kube: KubeCluster) -> KubeCluster:
    """The kube fixture with KubeRefit's CRDs (crds/*.yaml) installed and Established."""
    import time

    import yaml
    from kubernetes import client

    ext = client.ApiextensionsV1Api(kube.api_client())
    names = []
    for path in sorted((REPO / "crds").glob("*.yaml")):
        body = yaml.safe_load(path.read_text())
        names.append(body["metadata"]["name"])
        ext.create_custom_resource_definition(body)
    deadline = time.monotonic() + 30
    pending = set(names)
    while pending and time.monotonic() < deadline:
        for name in list(pending):
            conds = ext.read_custom_resource_definition(name).status.conditions or []
            if any(c.type == "Established" and c.status == "True" for c in conds):
                pending.discard(name)
        time.sleep(0.1)
    if pending:
        pytest.fail(f"CRDs not established within 30s: {sorted(pending)}")
    return kube


@pytest.fixture(scope="session")
def s3(artifacts_dir: Path) -> Iterator[S3Server]:
    """A real SeaweedFS S3 gateway that checks request signatures."""
    server = start_s3(artifacts_dir / "s3")
    try:
        yield server
    finally:
        server.process.stop()


@pytest.fixture
def bucket(s3: S3Server) -> str:
    """A fresh bucket on the session's SeaweedFS: no test depends on what another left."""
    name = "kuberefit-" + secrets.token_hex(4)
    s3.client().create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def tiny_models(artifacts_dir: Path) -> dict[str, Path]:
    """Tiny random Qwen3 and Qwen3-MoE checkpoints (BF16 safetensors), written locally."""
    from refit_tools.tiny_models import write_tiny_model

    root = artifacts_dir / "models"
    return {
        family: write_tiny_model(root / family, family, seed=1)  # type: ignore[arg-type]
        for family in ("qwen3", "qwen3_moe")
    }


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """One aiohttp client session for a test's HTTP clients (closed after the test)."""
    async with aiohttp.ClientSession() as s:
        yield s
