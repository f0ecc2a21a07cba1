"""`TransitionRecorder` against the harness's real API server: what `kubectl get
refittransitions` shows while a transition runs."""

from __future__ import annotations

import uuid

from kubernetes import client

from refit_operator.kube.api import KubeApi
from refit_operator.ports import TransitionProgress
from refit_operator.transitions import TransitionRecorder
from tests.harness.kube import KubeCluster


async def test_a_new_message_is_written_at_once_within_the_rate_limit(
    refit_crds: KubeCluster, namespace: str
) -> None:
    """Updates without a phase change are rate-limited, but a new message (an attempt failed,
    a node is ending its apply call before the retry) is written at once: the wait it explains
    may last a minute. (In a namespace of its own: other tests list their namespace's
    RefitTransitions.)"""
    name = f"p-{uuid.uuid4().hex[:8]}"
    policy = {
        "apiVersion": "refit.kuberefit.io/v1alpha1",
        "kind": "RefitPolicy",
        "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4())},
    }
    api = KubeApi(refit_crds.api_client())
    recorder = TransitionRecorder(api, policy, 0, 1, coordinator="c", min_interval_s=3600)
    assert await recorder.open() is False
    progress = TransitionProgress(name, 0, 1, phase="Streaming", attempt=1)
    await recorder.update(progress)
    progress.payloads = 7
    await recorder.update(progress)  # within the interval, nothing new to say: not written

    def status() -> dict[str, object]:
        obj = client.CustomObjectsApi(refit_crds.api_client()).get_namespaced_custom_object(
            "refit.kuberefit.io", "v1alpha1", namespace, "refittransitions", recorder.name
        )
        return dict(obj.get("status") or {})

    before = status()
    assert before["phase"] == "Streaming"
    assert "payloads" not in before, before
    assert not before.get("message"), before
    progress.message = "attempt 1 failed: n1 died; n0 is ending its apply call"
    await recorder.update(progress)
    after = status()
    assert (after["message"], after["payloads"]) == (progress.message, 7), after
