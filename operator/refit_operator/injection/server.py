"""Which vLLM server spanning several pods a rollout pod belongs to, and its role there
(docs/multi-host.md): every pod of the server gets a receiver; the leader's applies through every
rank, a worker's stages payload files for its own ranks and asks the leader's how far it got.

LeaderWorkerSet's own labels say it (worker index 0 is the leader; the leader is reachable at
`<set>-<group>.<subdomain>`, the headless Service LeaderWorkerSet creates, which publishes pods
before they are ready); other launchers say it with `kuberefit.io/server`,
`kuberefit.io/server-role` and, on workers, `kuberefit.io/server-leader`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from refit_operator.injection.pod import Pod
from refit_operator.injection.resources import InjectionRefusedError
from refit_operator.kube.names import SERVER, SERVER_LEADER, SERVER_ROLE

LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_SIZE = "leaderworkerset.sigs.k8s.io/size"  # an annotation
ROLES = ("leader", "worker")


@dataclass(frozen=True)
class ServerRole:
    """The pod's place in its server: `leader_address` is empty on the leader."""

    server: str
    leader: bool
    leader_address: str = ""


def server_role(pod: Pod) -> ServerRole | None:
    """The pod's server and role; None for a server of one pod (the usual case)."""
    annotations, labels = pod.annotations, pod.labels
    if SERVER in annotations or SERVER_ROLE in annotations or SERVER_LEADER in annotations:
        return _annotated(annotations)
    if LWS_NAME in labels:
        return _leader_worker_set(pod)
    return None


def _annotated(annotations: Mapping[str, str]) -> ServerRole:
    name, role = annotations.get(SERVER, ""), annotations.get(SERVER_ROLE, "")
    leader = annotations.get(SERVER_LEADER, "")
    if not name:
        raise InjectionRefusedError(f"{SERVER_ROLE} or {SERVER_LEADER} is set: set {SERVER} too")
    if role not in ROLES:
        raise InjectionRefusedError(f"{SERVER_ROLE} must be leader or worker, not {role!r}")
    if role == "worker" and not leader:
        raise InjectionRefusedError(
            f"a worker of server {name} needs {SERVER_LEADER}: the leader pod's address (DNS "
            "name or IP), where its receiver answers"
        )
    if role == "leader" and leader:
        raise InjectionRefusedError(f"{SERVER_LEADER} is for workers; the leader has none")
    return ServerRole(name, role == "leader", leader)


def _leader_worker_set(pod: Pod) -> ServerRole | None:
    labels = pod.labels
    size = pod.annotations.get(LWS_SIZE, "")
    if size == "1":
        return None  # a group of one pod: an ordinary server
    name, group = labels.get(LWS_NAME, ""), labels.get(LWS_GROUP_INDEX, "")
    worker = labels.get(LWS_WORKER_INDEX, "")
    if not group or not worker:
        raise InjectionRefusedError(
            f"a LeaderWorkerSet pod without {LWS_GROUP_INDEX} or {LWS_WORKER_INDEX}: inject the "
            f"pods LeaderWorkerSet creates, or name the server with {SERVER}"
        )
    server = f"{name}-{group}"
    if worker == "0":
        return ServerRole(server, True)
    subdomain = pod.pod_spec.subdomain
    if not subdomain:
        raise InjectionRefusedError(
            f"LeaderWorkerSet worker {server}/{worker} has no spec.subdomain, so its leader's "
            f"address is unknown: set {SERVER_LEADER}"
        )
    return ServerRole(server, False, f"{server}.{subdomain}")
