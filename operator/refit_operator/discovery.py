"""Which pods take part in a policy, and where their sidecars listen (pure functions).

A pod takes part in policy P when it carries `kuberefit.io/inject: trainer|rollout` and
`kuberefit.io/policy: P`, matches P's selector for its role, has the injected sidecar, runs,
and has an IP. An opted-in pod without the sidecar (admitted while the webhook was down) is
reported, never used. Its sidecar's
address is the pod IP with the sidecar container's named ports (`refit-control`,
`refit-relay`). Identity is the pod's UID plus its sidecar's restart count: if either changes,
the process that held an attempt's state is gone (the receiver is confirmed dead).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from refit_operator.kube.names import (
    CONTROL_PORT,
    DEFAULT_PORTS,
    INJECT,
    POLICY,
    RELAY_MAC_PORT,
    RELAY_PORT,
    S3_SETTINGS,
    SERVER_LABEL,
    SIDECAR_CONTAINER,
    TOKEN_VOLUME,
    TRANSPORT,
)
from refit_operator.policy_spec import PolicySpec

Role = Literal["trainer", "rollout"]


@dataclass(frozen=True)
class PodView:
    """What the operator keeps of an annotated pod (the pod index's value)."""

    namespace: str
    name: str
    uid: str
    role: str
    policy: str
    labels: Mapping[str, str] = field(default_factory=dict)
    ip: str = ""
    phase: str = ""
    deleting: bool = False
    control_port: int = 0
    relay_port: int = 0
    relay_mac_port: int = 0
    restarts: int = 0
    injected: bool = True  # the pod has the sidecar container
    #: The token Secret (name, key) injection mounted, fixed when the pod was created.
    token_secret: tuple[str, str] | None = None
    #: The transport injection configured the sidecar for (pods injected before the
    #: annotation existed: zmq) and, for s3, the digest of the store settings.
    transport: str = "zmq"
    s3_settings: str = ""

    @property
    def server(self) -> str:
        """The vLLM server this pod serves in: its own name, unless injection labelled it as
        one pod of a server spanning several (`kuberefit.io/server`)."""
        return self.labels.get(SERVER_LABEL) or self.name

    @property
    def running(self) -> bool:
        return self.phase == "Running" and bool(self.ip) and not self.deleting

    @property
    def url(self) -> str:
        return f"http://{_host(self.ip)}:{self.control_port}"

    @property
    def relay_endpoint(self) -> str:
        return f"tcp://{_host(self.ip)}:{self.relay_port}" if self.relay_port else ""

    @property
    def relay_mac_endpoint(self) -> str:
        """The MAC-only relay endpoint ("" when the sidecar declares no such port)."""
        return f"tcp://{_host(self.ip)}:{self.relay_mac_port}" if self.relay_mac_port else ""

    @property
    def incarnation(self) -> tuple[str, int]:
        """Changes when the sidecar process is replaced (new pod, or container restart)."""
        return (self.uid, self.restarts)


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def pod_view(pod: Mapping[str, Any]) -> PodView | None:
    """The view of an annotated pod; None for a pod without both annotations."""
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    role, policy = annotations.get(INJECT), annotations.get(POLICY)
    if not role or not policy:
        return None
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    ports: dict[str, int] = {}
    injected = False
    # A native sidecar (Kubernetes 1.29+) is an init container with restartPolicy Always.
    for c in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        if c.get("name") == SIDECAR_CONTAINER:
            injected = True
            ports = {
                p["name"]: int(p["containerPort"]) for p in c.get("ports") or [] if "name" in p
            }
    restarts = sum(
        int(s.get("restartCount") or 0)
        for key in ("containerStatuses", "initContainerStatuses")
        for s in status.get(key) or []
        if s.get("name") == SIDECAR_CONTAINER
    )
    return PodView(
        namespace=str(meta.get("namespace") or ""),
        name=str(meta.get("name") or ""),
        uid=str(meta.get("uid") or ""),
        role=str(role),
        policy=str(policy),
        labels=dict(meta.get("labels") or {}),
        ip=str(status.get("podIP") or ""),
        phase=str(status.get("phase") or ""),
        deleting=bool(meta.get("deletionTimestamp")),
        control_port=ports.get(CONTROL_PORT, DEFAULT_PORTS.get(str(role), 0)),
        relay_port=ports.get(RELAY_PORT, 0),
        relay_mac_port=ports.get(RELAY_MAC_PORT, 0),
        restarts=restarts,
        injected=injected,
        token_secret=_token_secret(spec),
        transport=str(annotations.get(TRANSPORT) or "zmq"),
        s3_settings=str(annotations.get(S3_SETTINGS) or ""),
    )


def _token_secret(spec: Mapping[str, Any]) -> tuple[str, str] | None:
    """The (Secret, key) of the injected token volume, if the pod has one."""
    for volume in spec.get("volumes") or []:
        if not isinstance(volume, Mapping) or volume.get("name") != TOKEN_VOLUME:
            continue
        secret = volume.get("secret") or {}
        items = secret.get("items") or [{}]
        key = items[0].get("key") if isinstance(items[0], Mapping) else None
        if secret.get("secretName") and key:
            return str(secret["secretName"]), str(key)
    return None


def pod_problem(view: PodView, policy_exists: bool) -> tuple[str, str] | None:
    """Why an annotated pod cannot take part (an Event reason and message), or None."""
    if view.role not in ("trainer", "rollout"):
        return (
            "UnknownRole",
            f"annotation {INJECT}={view.role} is neither trainer nor rollout; this pod takes "
            "no part in any refit",
        )
    if not policy_exists:
        return (
            "PolicyNotFound",
            f"annotation {POLICY}={view.policy} names no RefitPolicy in namespace "
            f"{view.namespace}; this pod takes no part in any refit",
        )
    if not view.injected:
        return (
            "NotInjected",
            f"this pod opted in ({INJECT}={view.role}) but has no {SIDECAR_CONTAINER} container: "
            "it was not injected when it was created (the webhook was down and its "
            "failurePolicy is Ignore, the webhook is not enabled, or its selectors leave this "
            "pod out). It takes no part in any refit until it is recreated (kubectl delete pod; "
            "its controller creates an injected one)",
        )
    return None


@dataclass(frozen=True)
class Discovered:
    """The pods of one policy by role: all that name it, and those that can take part now."""

    trainers: tuple[PodView, ...]
    rollouts: tuple[PodView, ...]
    unknown_role: tuple[PodView, ...] = ()
    not_injected: tuple[PodView, ...] = ()  # selected, but admitted without the sidecar

    @property
    def ready_trainers(self) -> tuple[PodView, ...]:
        return tuple(p for p in self.trainers if p.running)

    @property
    def ready_rollouts(self) -> tuple[PodView, ...]:
        return tuple(p for p in self.rollouts if p.running)

    def servers(self) -> tuple[int, int]:
        """(vLLM servers with every pod running, vLLM servers) among the rollout pods."""
        pods: dict[str, list[bool]] = {}
        for p in self.rollouts:
            pods.setdefault(p.server, []).append(p.running)
        return sum(all(up) for up in pods.values()), len(pods)


def discover(pods: Iterable[PodView], spec: PolicySpec) -> Discovered:
    """Split the policy's annotated pods by role, keeping those its selectors match (by name)."""
    trainers, rollouts, unknown, missed = [], [], [], []
    for p in pods:
        if p.role in ("trainer", "rollout") and not p.injected:
            selector = spec.selector.trainer if p.role == "trainer" else spec.selector.rollout
            if selector.matches(dict(p.labels)):
                missed.append(p)
        elif p.role == "trainer" and spec.selector.trainer.matches(dict(p.labels)):
            trainers.append(p)
        elif p.role == "rollout" and spec.selector.rollout.matches(dict(p.labels)):
            rollouts.append(p)
        elif p.role not in ("trainer", "rollout"):
            unknown.append(p)
    key = lambda p: p.name  # noqa: E731
    return Discovered(
        tuple(sorted(trainers, key=key)),
        tuple(sorted(rollouts, key=key)),
        tuple(unknown),
        tuple(sorted(missed, key=key)),
    )
