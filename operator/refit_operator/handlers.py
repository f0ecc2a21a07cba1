"""The kopf layer: thin handlers over plain functions (registered on `registry`).

- `settings`: kopf's own bookkeeping under `kuberefit.io/` (storage and finalizer), no
  cluster scanning (the resources are fixed), and no posting of handler log lines as Events.
- `policy_pods`, `policy_names`: in-memory indices of annotated pods by (namespace, policy)
  and of the RefitPolicies. kopf writes nothing to pods for an index.
- `coordinate`: the watch events of RefitPolicies start and stop one `PolicyRunner` task per
  policy (`PolicyTasks`). Not a kopf daemon: kopf would guard each policy with a finalizer, which
  nobody removes once the operator is uninstalled. It removes the finalizer older versions added.
- `stop_coordinators`: at exit every loop gets its grace period.
- `pod_policy_exists`: an annotated pod that cannot take part (its policy does not exist, or
  its role is neither trainer nor rollout) gets one Warning Event.

Nothing here watches PolicyVersions: only the commit store writes them, with its own
compare-and-set, and kopf's annotations would break it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
import structlog

from refit_operator import metrics
from refit_operator.discovery import pod_problem, pod_view
from refit_operator.kube.api import KubeApi, object_ref
from refit_operator.kube.names import (
    FINALIZER,
    GROUP,
    KOPF_PREFIX,
    POLICIES,
    POLICY,
    VERSION,
)
from refit_operator.policy_runner import PolicyRunner, RunnerSettings
from refit_operator.policy_tasks import PolicyLoop, PolicyTasks

log = structlog.get_logger("kuberefit.operator")

registry = kopf.OperatorRegistry()


@dataclass
class Loops:
    """The policy loops, made by the first policy event (they need kopf's index)."""

    tasks: PolicyTasks | None = None


@dataclass
class Memo:
    """What every handler shares (kopf passes it as `memo`).

    kopf hands each resource object a shallow copy of this memo, so a handler that assigns an
    attribute changes its object's copy only. What the handlers must share lives in mutable
    fields (`warned_pods`, `loops`) that every copy refers to: the cleanup handler, which gets
    the original, must find the loops a policy event started to stop them gracefully."""

    api: KubeApi
    settings: RunnerSettings
    warned_pods: set[tuple[str, str]] = field(default_factory=set)
    loops: Loops = field(default_factory=Loops)


@kopf.on.startup(registry=registry)
def configure(settings: kopf.OperatorSettings, memo: Memo, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=KOPF_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = FINALIZER
    settings.scanning.disabled = True
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "kuberefit-operator"


@kopf.index("pods", annotations={POLICY: kopf.PRESENT}, registry=registry)
def policy_pods(body: kopf.Body, **_: Any) -> dict[tuple[str, str], Any]:
    view = pod_view(body)
    return {} if view is None else {(view.namespace, view.policy): view}


@kopf.index(GROUP, VERSION, POLICIES, registry=registry)
def policy_names(namespace: str, name: str, **_: Any) -> dict[tuple[str, str], bool]:
    return {(namespace, name): True}


def _policy_loop(memo: Memo, policy_pods: kopf.Index[tuple[str, str], Any]) -> PolicyLoop:
    async def loop(
        namespace: str,
        name: str,
        body: Callable[[], Mapping[str, Any]],
        stopped: Callable[[], bool],
    ) -> None:
        runner = PolicyRunner(
            memo.api,
            namespace,
            name,
            body=body,
            pods=lambda: list(policy_pods.get((namespace, name), [])),
            stopped=stopped,
            settings=memo.settings,
        )
        await runner.run()

    return loop


@kopf.on.event(GROUP, VERSION, POLICIES, registry=registry)
async def coordinate(
    body: kopf.Body,
    type: str | None,  # noqa: A002 - kopf's name for the watch event type
    namespace: str,
    name: str,
    memo: Memo,
    policy_pods: kopf.Index[tuple[str, str], Any],
    **_: Any,
) -> None:
    loops = memo.loops
    if loops.tasks is None:
        loops.tasks = PolicyTasks(_policy_loop(memo, policy_pods))
    raw = dict(body)
    if await loops.tasks.observe(raw, deleted=type == "DELETED"):
        metrics.forget_policy(namespace, name)  # its series would stay forever otherwise
    finalizers = list(body.get("metadata", {}).get("finalizers") or [])
    if FINALIZER in finalizers and type != "DELETED":
        try:
            await memo.api.remove_policy_finalizer(namespace, name, finalizers, FINALIZER)
        except Exception as exc:  # e.g. a lost race: the next event of the policy tries again
            log.warning("policy.finalizer_not_removed", policy=name, error=str(exc)[:300])
        else:
            log.info("policy.finalizer_removed", namespace=namespace, policy=name)


@kopf.on.cleanup(registry=registry)
async def stop_coordinators(memo: Memo, **_: Any) -> None:
    if memo.loops.tasks is not None:
        await memo.loops.tasks.stop_all()


@kopf.on.event("pods", annotations={POLICY: kopf.PRESENT}, registry=registry)
async def pod_policy_exists(
    body: kopf.Body,
    type: str | None,  # noqa: A002 - kopf's name for the watch event type
    memo: Memo,
    policy_names: kopf.Index[tuple[str, str], bool],
    **_: Any,
) -> None:
    """One Warning Event for an annotated pod that cannot take part: it names a policy that
    does not exist, or a role other than trainer or rollout."""
    view = pod_view(body)
    if view is None:
        return
    key = (view.uid, view.policy)
    if type == "DELETED":
        memo.warned_pods.discard(key)
        return
    problem = pod_problem(view, (view.namespace, view.policy) in policy_names)
    if problem is None:
        memo.warned_pods.discard(key)
        return
    if key in memo.warned_pods:
        return
    memo.warned_pods.add(key)
    reason, message = problem
    log.warning("pod.ignored", pod=view.name, policy=view.policy, reason=reason)
    await memo.api.post_event(
        object_ref({**body, "apiVersion": "v1", "kind": "Pod"}), reason, message, warning=True
    )


@kopf.on.login(registry=registry)
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """The same credentials as the kubernetes client: in-cluster, else $KUBECONFIG."""
    return kopf.login_via_client(**kwargs)
