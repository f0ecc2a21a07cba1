"""Settings a pod keeps from the moment it was created, compared with its policy's.

Most of a RefitPolicy's settings follow the policy without a restart: the stream settings
(`spec.encoding`, `spec.bucketBytes`) travel with every attempt's plan, and the coordinator's
own settings are read on every transition. A few are fixed for a pod's life, because injection
wrote them into the pod or its sidecar built state from them:

- the token Secret (`spec.tokenSecret`): injection mounted it as a volume;
- the transport (`spec.transport`) and the store's settings (`spec.s3`): injection wrote them
  into the sidecars' config, credentials and CA bundle mounts (a rollout pod injected for s3
  keeps its relay too, so it follows a policy that goes back to zmq);
- a trainer sidecar's export chunking (`spec.chunkBytes`) and baseline storage
  (`spec.baseline.storage`): its baseline is laid out and kept by them.

A pod created before its policy (with the chart's defaults) or before a change of these has
other values; it is never silently different: the operator names each such setting in an
Event on the pod and in the policy's `SettingsApplied` condition. Deleting the pod applies
them (its controller creates one that injection gives the policy's settings). So is a trainer
sidecar of the previous release, which takes no settings with a plan (plans then carry none).
"""

from __future__ import annotations

import structlog

from refit_operator.discovery import PodView
from refit_operator.kube.api import KubeApi
from refit_operator.policy_spec import PolicySpec
from refit_protocol.producer_api import FixedSettings, ProducerStatus

#: The Event reason on a pod whose fixed settings differ from its policy's.
RESTART_REQUIRED = "RestartRequired"
log = structlog.get_logger("kuberefit.policy")

#: What a trainer sidecar of a release before settings followed the policy is told.
OLD_SIDECAR = (
    "its sidecar image predates settings that follow the policy: it streams with the "
    "spec.encoding and spec.bucketBytes it was injected with"
)


def fixed_drift(
    view: PodView, spec: PolicySpec, fixed: FixedSettings | None, *, follows: bool = True
) -> list[str]:
    """One line per setting `view`'s pod holds other than `spec` says (empty: none).

    `fixed`: what the pod's trainer sidecar reports (None for a rollout pod, or a trainer
    sidecar not asked yet); `follows`: whether that sidecar takes the stream settings with
    each plan (False for an older sidecar, which reports none)."""
    drift: list[str] = [] if follows else [OLD_SIDECAR]
    want = (spec.token_secret.name, spec.token_secret.key)
    if view.token_secret is not None and view.token_secret != want:
        drift.append(
            f"spec.tokenSecret is {want[0]} (key {want[1]}); the pod mounts "
            f"{view.token_secret[0]} (key {view.token_secret[1]})"
        )
    drift += _transport_drift(view, spec)
    if fixed is not None:
        if fixed.chunk_bytes != spec.chunk_bytes:
            drift.append(
                f"spec.chunkBytes is {spec.chunk_bytes}; its baseline is laid out in "
                f"{fixed.chunk_bytes}-byte export chunks"
            )
        if fixed.baseline_storage != spec.baseline.storage:
            drift.append(
                f"spec.baseline.storage is {spec.baseline.storage}; its baseline is kept in "
                f"{fixed.baseline_storage}"
            )
    return drift


def _transport_drift(view: PodView, spec: PolicySpec) -> list[str]:
    store = spec.s3_settings()
    if store is not None:
        if view.transport != "s3":
            return [f"spec.transport is s3; the pod's sidecar was injected for {view.transport}"]
        if view.s3_settings != store.digest():
            return ["spec.s3 changed after the pod was created; its sidecar has the old settings"]
    elif view.role == "trainer" and view.transport != spec.transport:
        return [f"spec.transport is {spec.transport}; its sidecar sends over {view.transport}"]
    return []


def restart_message(view: PodView, drift: list[str]) -> str:
    """The Event (and condition) text for a pod that needs recreating to take its settings."""
    return (
        f"pod {view.name} runs with settings fixed when it was created, other than its "
        f"RefitPolicy's: {'; '.join(drift)}. Delete the pod to apply the policy's (its "
        "controller recreates it)"
    )


class FixedSettingsWatch:
    """Which of a policy's pods hold fixed settings other than its spec, and which of those
    differences were reported already (an Event when a pod has one not reported before)."""

    def __init__(self) -> None:
        self._fixed: dict[str, FixedSettings | None] = {}  # pod uid -> its producer's report
        self._follows: dict[str, bool] = {}  # pod uid -> its producer takes plan settings
        self._reported: set[tuple[str, str]] = set()
        #: One line per pod that differs (for the policy's SettingsApplied condition).
        self.current: tuple[str, ...] = ()

    def saw(self, view: PodView, status: ProducerStatus) -> None:
        """What `view`'s trainer sidecar reported in its status."""
        self._fixed[view.uid] = status.fixed
        # A sidecar of the previous release reports no settings and refuses plans with them.
        self._follows[view.uid] = status.settings is not None

    def all_follow(self, pods: list[PodView]) -> bool:
        """Whether every one of `pods` (the trainers) takes the stream settings with a plan:
        only then do plans carry them."""
        return all(self._follows.get(view.uid, False) for view in pods)

    def check(self, pods: list[PodView], spec: PolicySpec) -> list[tuple[PodView, str]]:
        """Compare `pods` (the policy's injected pods) with `spec`; the (pod, message) pairs to
        announce: pods with a difference not reported before (the message names them all)."""
        lines: list[str] = []
        new: list[tuple[PodView, str]] = []
        reported: set[tuple[str, str]] = set()
        for view in pods:
            drift = fixed_drift(
                view, spec, self._fixed.get(view.uid), follows=self._follows.get(view.uid, True)
            )
            if not drift:
                continue
            lines.append(f"{view.name}: {'; '.join(drift)}")
            keys = {(view.uid, line) for line in drift}
            if not keys <= self._reported:
                new.append((view, restart_message(view, drift)))
            reported |= keys
        alive = {view.uid for view in pods}
        self._fixed = {uid: f for uid, f in self._fixed.items() if uid in alive}
        self._follows = {uid: f for uid, f in self._follows.items() if uid in alive}
        self._reported = reported
        self.current = tuple(lines)
        return new


async def report_restart_required(
    api: KubeApi, watch: FixedSettingsWatch, pods: list[PodView], spec: PolicySpec, policy: str
) -> None:
    """A Warning Event on each pod holding settings, fixed when it was created, that its
    policy no longer has; the SettingsApplied condition lists them (`watch.current`)."""
    for view, message in watch.check(pods, spec):
        log.warning("pod.restart_required", pod=view.name, policy=policy, why=message)
        ref = {"apiVersion": "v1", "kind": "Pod", "name": view.name, "uid": view.uid}
        try:
            await api.post_event(
                {**ref, "namespace": view.namespace}, RESTART_REQUIRED, message, warning=True
            )
        except Exception as exc:  # the condition still says it; the next change retries
            log.warning("pod.event_failed", pod=view.name, error=str(exc)[:300])
