"""The sidecar injection as a pure function: an opted-in Pod in, a JSON Patch out.

A pod opts in with `kuberefit.io/inject: trainer|rollout` and `kuberefit.io/policy: <name>`.
Injection adds, once (the `kuberefit.io/injected` marker annotation makes a second admission
or a reinvocation a no-op):

- the `kuberefit-sidecar` container: `kuberefit producer serve` (trainer) or `kuberefit
  receiver serve` (rollout), its settings as JSON in $KUBEREFIT_CONFIG, bound to the pod IP
  (downward API) on the named ports `refit-control` (and `refit-relay`, `refit-relay-mac` for
  receivers);
- volumes: `kuberefit-work` (emptyDir: baseline, staged candidates), `kuberefit-shm`
  (memory-backed emptyDir shared with the paired container: payload files) and
  `kuberefit-token` (the policy's token Secret, mounted read-only as a file);
- in the paired container (`kuberefit.io/container`, default the first): the shared volume,
  the token file, and for trainers $KUBEREFIT_PRODUCER_URL and $KUBEREFIT_INBOX (what
  `PublisherConfig.from_pod()` reads); for vLLM the worker extension and the guarded refit
  control path (`--worker-extension-cls`, `--middleware`) appended to its args;
- for vLLM, the code those two options name, without touching the user's image: the init
  container `kuberefit-vllm-bundle` (the sidecar image) copies the vLLM bundle into the
  emptyDir `kuberefit-vllm-bundle`, mounted read-only into the vLLM container and put first on
  its `PYTHONPATH` (a value the container sets is kept after it);
- labels `kuberefit.io/role` and `kuberefit.io/policy`, which NetworkPolicies can select;
- the chart's `sidecar.imagePullSecrets` in the pod's `imagePullSecrets` (a private registry).

Every injected container passes the "restricted" Pod Security Standard with a read-only root
file system; the sidecar writes to its emptyDirs (`kuberefit-tmp` is its /tmp).

Pods without both annotations are never changed. `$(VAR)` references are expanded by the
kubelet from the env variables defined before them.

The pod is read through the validated model `injection.pod.Pod`; `inject` never raises: what
is not a Pod, or cannot be injected, is refused with a reason (never a failed admission).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from refit_operator.injection.config import InjectionConfig, TokenSecretRef
from refit_operator.injection.pod import Container, EnvVar, Pod, PodError, parse_pod
from refit_operator.injection.resources import (
    InjectionRefusedError,
    annotated_quantity,
    restricted,
    sidecar_resources,
)
from refit_operator.injection.s3 import CA_VOLUME, S3Settings
from refit_operator.injection.server import ServerRole, server_role
from refit_operator.injection.vllm_launch import LaunchRefusedError, VllmWiring, wire_vllm
from refit_operator.kube.names import (
    CONTAINER,
    CONTROL_PORT,
    INJECT,
    INJECTED,
    POLICY,
    POLICY_LABEL,
    PRODUCER_INDEX,
    REFERENCE_CHECKPOINT,
    RELAY_MAC_PORT,
    RELAY_PORT,
    ROLE_LABEL,
    S3_SETTINGS,
    SERVER_LABEL,
    SHM_SIZE_LIMIT,
    SIDECAR_CONTAINER,
    TOKEN_VOLUME,
    TRANSPORT,
)
from refit_protocol.pod_contract import (
    CONFIG_ENV,
    INBOX_ENV,
    LOG_FORMAT_ENV,
    LOG_LEVEL_ENV,
    POD_IP_ENV,
    POD_NAME_ENV,
    PRODUCER_URL_ENV,
    TOKEN_FILE_ENV,
)
from refit_protocol.sizes import Auto

Obj = dict[str, Any]
WORK_VOLUME, SHM_VOLUME = "kuberefit-work", "kuberefit-shm"
#: The sidecar's /tmp (its root file system is read-only): numba's cache, HOME, temp files.
TMP_VOLUME, TMP_SIZE_LIMIT = "kuberefit-tmp", "1Gi"
#: The vLLM bundle's emptyDir and the init container that fills it (rollout pods).
BUNDLE_VOLUME = BUNDLE_INIT = "kuberefit-vllm-bundle"
#: What the bundle's files take (about 150 KiB today); the emptyDir's sizeLimit.
BUNDLE_SIZE_LIMIT = "64Mi"
ROLES = ("trainer", "rollout")
#: StatefulSet pods carry this label from creation; its ordinal is the default producer index.
STATEFULSET_POD_NAME = "statefulset.kubernetes.io/pod-name"
#: Indexed Jobs (PyTorchJob, JobSet) label each pod with its index.
JOB_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
#: Containers other injectors add that are never the one to pair with.
MESH_PROXIES = frozenset({"istio-proxy", "linkerd-proxy", "envoy-sidecar"})
_SMALL_UINT = re.compile(r"[0-9]{1,9}")


class TrainerSettings(BaseModel):
    """The part of a trainer sidecar's config (`ProducerProcessConfig`) its RefitPolicy
    decides. Written into the sidecar when the pod is admitted: a later change of the policy
    reaches the pod when it is recreated (`pod_settings` reports the difference)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    zstd_level: int = Field(description="spec.encoding.zstdLevel")
    shuffle: bool = Field(description="spec.encoding.shuffle")
    export_chunk_bytes: int | Auto = Field(description="spec.chunkBytes")
    bucket_bytes: int | Auto = Field(description="spec.bucketBytes")
    in_memory: bool = Field(description='spec.baseline.storage == "memory"')

    def config(self) -> dict[str, Any]:
        """These settings at their places in `ProducerProcessConfig`."""
        return {
            "pipeline": {
                "bucket_bytes": self.bucket_bytes,
                "codec": {"zstd_level": self.zstd_level, "shuffle": self.shuffle},
            },
            "baseline": {
                "export_chunk_bytes": self.export_chunk_bytes,
                "in_memory": self.in_memory,
            },
        }


@dataclass(frozen=True)
class PolicyFacts:
    """What admission knows of the pod's RefitPolicy (looked up by the webhook)."""

    exists: bool
    token_secret: TokenSecretRef
    producers: int = 1
    #: Trainer sidecar settings from the policy (None: the sidecar's own defaults).
    trainer: TrainerSettings | None = None
    #: `spec.tokenRotationGraceSeconds`: how long every sidecar keeps sending a rotated token.
    token_rotation_grace_s: float = 300.0
    #: `spec.s3` when `spec.transport` is s3 (None: the relay tree, zmq).
    s3: S3Settings | None = None

    @property
    def transport(self) -> str:
        return "s3" if self.s3 is not None else "zmq"


#: A regular-container trainer sidecar exits with its trainer where the pod ends (a Job's):
#: under Never once the trainer is gone, under OnFailure once it is gone after closing its
#: publisher (a crashed trainer is restarted and needs its sidecar). Always: it never exits.
EXIT_WITH_TRAINER = {"Never": "when_gone", "OnFailure": "when_done"}


@dataclass
class Injection:
    """The answer for one pod: a patch (empty: nothing to do), warnings, or a refusal."""

    patch: list[Obj] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    denied: str | None = None


def wants_injection(pod: Pod | Mapping[str, Any]) -> bool:
    """True for a pod that opted in and was not injected yet (False for what is not a Pod)."""
    try:
        return _wants(parse_pod(pod))
    except PodError:
        return False


def _wants(pod: Pod) -> bool:
    return bool(pod.annotations.get(INJECT)) and INJECTED not in pod.annotations


def inject(pod: Pod | Mapping[str, Any], config: InjectionConfig, policy: PolicyFacts) -> Injection:
    """The JSON Patch that injects `pod` (a Pod as JSON gives it, or as validated by
    `parse_pod`; see the module docstring). Never raises: a `pod` that is not a Pod is refused
    with the field that is wrong, and so, as a last line of defence, is a pod whose injection
    fails unexpectedly (refused, rather than started without the sidecar it asked for)."""
    try:
        valid = parse_pod(pod)
    except PodError as exc:
        return Injection(denied=f"the pod is malformed: {exc}")
    try:
        return _inject(valid, config, policy)
    except Exception as exc:  # a bug, never the pod's fault: refuse it, and say so
        return Injection(
            denied=(
                f"KubeRefit failed to inject this pod ({type(exc).__name__}: {str(exc)[:200]}); "
                "it is refused rather than started without its sidecar. Please report this."
            )
        )


def _inject(pod: Pod, config: InjectionConfig, policy: PolicyFacts) -> Injection:
    annotations = pod.annotations
    if not _wants(pod):
        return Injection()
    if _has_container(SIDECAR_CONTAINER, pod.pod_spec.containers):
        return Injection()  # injected by hand or by an older marker-less release: leave it
    role, policy_name = annotations[INJECT], annotations.get(POLICY) or ""
    if role not in ROLES:
        return Injection(
            warnings=[f"{INJECT}={role} is neither trainer nor rollout: pod not injected"]
        )
    if not policy_name:
        return Injection(warnings=[f"{INJECT} is set but {POLICY} is missing: pod not injected"])
    try:
        patch = _build(pod, role, policy_name, config, policy)
    except (InjectionRefusedError, LaunchRefusedError) as exc:
        return Injection(denied=str(exc))
    warnings = []
    if not policy.exists:
        warnings.append(
            f"RefitPolicy {policy_name} does not exist yet: token from Secret "
            f"{policy.token_secret.name} (key {policy.token_secret.key}); settings fixed at "
            "creation that differ from the policy's are reported (RestartRequired), the rest "
            "follow it"
        )
    return Injection(patch=patch, warnings=warnings)


# -- building -----------------------------------------------------------------------------------
def _build(
    pod: Pod, role: str, policy_name: str, cfg: InjectionConfig, policy: PolicyFacts
) -> list[Obj]:
    meta, spec, annotations = pod.meta, pod.pod_spec, pod.annotations
    containers = spec.containers or []
    named = annotations.get(CONTAINER) or (cfg.vllm_container if role == "rollout" else "")
    index = _paired_index(containers, named)
    existing = {v.name for v in spec.volumes or []}
    if _has_container(SIDECAR_CONTAINER, spec.init_containers, spec.ephemeral_containers):
        raise InjectionRefusedError(f"an init container is named {SIDECAR_CONTAINER}: rename it")
    if _has_container(BUNDLE_INIT, spec.init_containers, spec.containers):
        raise InjectionRefusedError(f"a container is named {BUNDLE_INIT}: rename it")
    clash = existing & {WORK_VOLUME, SHM_VOLUME, TOKEN_VOLUME, BUNDLE_VOLUME, TMP_VOLUME, CA_VOLUME}
    if clash:
        raise InjectionRefusedError(f"the pod already has volume(s) {sorted(clash)}: rename them")
    token_file = f"{cfg.token_dir}/{policy.token_secret.key}"
    paired = containers[index]
    base = f"/spec/containers/{index}"
    resources = sidecar_resources(cfg, spec, annotations)
    wiring: VllmWiring | None = None
    server: ServerRole | None = None
    native = role == "trainer" and cfg.native_sidecars == "on"
    if role == "trainer":
        reference = annotations.get(REFERENCE_CHECKPOINT) or ""
        producer = _producer_index(pod, policy)
        exits = "no" if native else EXIT_WITH_TRAINER.get(spec.restart_policy or "Always", "no")
        sidecar = _producer(cfg, token_file, producer, policy, reference, resources, exits)
        sidecar["volumeMounts"] += _reference_mounts(paired, annotations)
        paired_env = [
            _field_env(POD_IP_ENV, "status.podIP"),
            _env(PRODUCER_URL_ENV, f"http://$({POD_IP_ENV}):{cfg.ports.producer}"),
            _env(INBOX_ENV, f"{cfg.shm_dir}/inbox"),
        ]
    else:
        wiring = wire_vllm(paired, base, annotations)
        server = server_role(pod)
        sidecar = _receiver(cfg, token_file, wiring.port, policy, resources, server)
        paired_env = list(wiring.env)
    bundle = role == "rollout"
    paired_env += [_env(TOKEN_FILE_ENV, token_file)]
    marks = {INJECTED: role, TRANSPORT: policy.transport}
    if policy.s3 is not None:
        sidecar["env"] += policy.s3.env(paired)
        sidecar["volumeMounts"] = _unique_mounts(sidecar["volumeMounts"] + policy.s3.mounts(paired))
        marks[S3_SETTINGS] = policy.s3.digest()
    ops: list[Obj] = []
    ops += _merge_map(meta.annotations, "/metadata/annotations", marks)
    labels = {ROLE_LABEL: role}
    if _label_value_ok(policy_name):
        labels[POLICY_LABEL] = policy_name
    if server is not None and _label_value_ok(server.server):
        labels[SERVER_LABEL] = server.server
    ops += _merge_map(meta.labels, "/metadata/labels", labels)
    shm_limit = annotated_quantity(annotations, SHM_SIZE_LIMIT, cfg.shm_size_limit)
    volumes = _volumes(shm_limit, policy.token_secret, bundle)
    volumes += policy.s3.volumes() if policy.s3 is not None else []
    ops += _append(spec.volumes, "/spec/volumes", volumes)
    have = {r.name for r in spec.image_pull_secrets or []}
    pull = [{"name": n} for n in cfg.image_pull_secrets if n not in have]
    ops += _append(spec.image_pull_secrets, "/spec/imagePullSecrets", pull)
    if bundle:
        ops += _append(spec.init_containers, "/spec/initContainers", [_bundle_init(cfg)])
        replaced = _python_path(paired, base, cfg.vllm_bundle_dir)
        ops += replaced
        paired_env += [] if replaced else [_env("PYTHONPATH", cfg.vllm_bundle_dir)]
    ops += _append(paired.env, f"{base}/env", _without_names(paired.env, paired_env))
    ops += _append(paired.volume_mounts, f"{base}/volumeMounts", _mounts(cfg, paired, bundle))
    if wiring is not None:
        ops += wiring.replace
        ops += _append(paired.args, f"{base}/args", wiring.append_args)
    if native:  # started before, stopped after the pod's containers; never holds a Job up
        sidecar["restartPolicy"] = "Always"
        ops += _append(spec.init_containers, "/spec/initContainers", [sidecar])
    else:
        ops.append({"op": "add", "path": "/spec/containers/-", "value": sidecar})
    return ops


def _paired_index(containers: Sequence[Container], name: str) -> int:
    """The container named `name`; unnamed, the first that is not a service-mesh proxy (other
    injectors, e.g. Istio's, may have put theirs first)."""
    if not containers:
        raise InjectionRefusedError("the pod has no containers")
    if not name:
        for i, c in enumerate(containers):
            if c.name not in MESH_PROXIES:
                return i
        raise InjectionRefusedError(
            f"the pod has only proxy containers; name the container with {CONTAINER}"
        )
    for i, c in enumerate(containers):
        if c.name == name:
            return i
    names = [c.name for c in containers]
    raise InjectionRefusedError(
        f"container {name!r} (annotation {CONTAINER} or the chart's sidecar.vllmContainer) is "
        f"not in the pod; its containers are {names}"
    )


def _common_env(cfg: InjectionConfig, token_file: str, config: Obj) -> list[Obj]:
    return [
        _field_env(POD_NAME_ENV, "metadata.name"),
        _field_env(POD_IP_ENV, "status.podIP"),
        _env(TOKEN_FILE_ENV, token_file),
        _env(LOG_FORMAT_ENV, cfg.log_format),
        _env(LOG_LEVEL_ENV, cfg.log_level),
        _env(CONFIG_ENV, json.dumps(config, separators=(",", ":"), sort_keys=True)),
        *cfg.env,
    ]


def _sidecar(
    cfg: InjectionConfig, command: list[str], env: list[Obj], ports: list[Obj], resources: Obj
) -> Obj:
    return {
        "name": SIDECAR_CONTAINER,
        "image": cfg.image,
        "imagePullPolicy": cfg.image_pull_policy,
        "command": command,
        "env": env,
        "ports": ports,
        "resources": resources,
        # Ready: its dependencies answer (the receiver's vLLM with the refit extension, the
        # producer's inbox and reference checkpoint); alive: the process answers. Liveness is
        # lenient, since a restarted producer must rebuild its baseline from the next export.
        "readinessProbe": {  # the receiver's checks may take 3 s (a busy vLLM)
            "httpGet": {"path": "/readyz", "port": CONTROL_PORT},
            "periodSeconds": 5,
            "timeoutSeconds": 5,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": CONTROL_PORT},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
        "volumeMounts": [
            {"name": WORK_VOLUME, "mountPath": cfg.work_dir},
            {"name": SHM_VOLUME, "mountPath": cfg.shm_dir},
            {"name": TOKEN_VOLUME, "mountPath": cfg.token_dir, "readOnly": True},
            {"name": TMP_VOLUME, "mountPath": "/tmp"},
        ],
        "securityContext": restricted(),
    }


def _receiver(
    cfg: InjectionConfig,
    token_file: str,
    vllm_port: int,
    policy: PolicyFacts,
    resources: Obj,
    server: ServerRole | None,
) -> Obj:
    applier: Obj = {"kind": "vllm", "vllm_url": f"http://127.0.0.1:{vllm_port}"}
    if server is not None and not server.leader:  # its vLLM runs ranks only (--headless)
        leader_url = f"http://{server.leader_address}:{cfg.ports.control}"
        applier = {"kind": "vllm_host", "leader_url": leader_url}
    settings: Obj = {
        "token_rotation_grace_s": policy.token_rotation_grace_s,
        "node": f"$({POD_NAME_ENV})",
        "host": f"$({POD_IP_ENV})",
        "port": cfg.ports.control,
        "relay": {
            "bind": f"tcp://$({POD_IP_ENV}):{cfg.ports.relay}",
            "mac_bind": f"tcp://$({POD_IP_ENV}):{cfg.ports.relay_mac}",
        },
        "applier": applier | {"shm_dir": cfg.shm_dir},
    }
    if policy.s3 is not None:  # the relay stays bound: it receives if the policy goes back to zmq
        settings["s3"] = policy.s3.store()
    if server is not None:
        settings["server"] = server.server
    ports = [
        {"name": CONTROL_PORT, "containerPort": cfg.ports.control, "protocol": "TCP"},
        {"name": RELAY_PORT, "containerPort": cfg.ports.relay, "protocol": "TCP"},
        {"name": RELAY_MAC_PORT, "containerPort": cfg.ports.relay_mac, "protocol": "TCP"},
    ]
    command = ["kuberefit", "receiver", "serve"]
    return _sidecar(cfg, command, _common_env(cfg, token_file, settings), ports, resources)


def _producer(
    cfg: InjectionConfig,
    token_file: str,
    index: int,
    policy: PolicyFacts,
    reference: str,
    resources: Obj,
    exit_with_trainer: str = "no",
) -> Obj:
    staging: Obj = {"inbox": f"{cfg.shm_dir}/inbox", "candidate_dir": f"{cfg.work_dir}/candidates"}
    if reference:
        staging["reference_checkpoint"] = reference
    from_policy = policy.trainer.config() if policy.trainer is not None else {}
    settings = {
        "host": f"$({POD_IP_ENV})",
        "port": cfg.ports.producer,
        "producer": index,
        "producers": policy.producers,
        "token_rotation_grace_s": policy.token_rotation_grace_s,
        **from_policy,
        "baseline": {"directory": f"{cfg.work_dir}/baseline", **from_policy.get("baseline", {})},
        "staging": staging,
    }
    if policy.s3 is not None:
        settings["transport"] = {"kind": "s3", "s3": policy.s3.store()}
    if exit_with_trainer != "no":
        settings["exit_with_trainer"] = exit_with_trainer
    ports = [{"name": CONTROL_PORT, "containerPort": cfg.ports.producer, "protocol": "TCP"}]
    command = ["kuberefit", "producer", "serve"]
    return _sidecar(cfg, command, _common_env(cfg, token_file, settings), ports, resources)


def _producer_index(pod: Pod, policy: PolicyFacts) -> int:
    annotations, labels = pod.annotations, pod.labels
    given = annotations.get(PRODUCER_INDEX)
    if given is not None:
        if not _SMALL_UINT.fullmatch(given):
            raise InjectionRefusedError(f"{PRODUCER_INDEX}={given!r} is not a non-negative integer")
        index = int(given)
    elif _SMALL_UINT.fullmatch(labels.get(JOB_COMPLETION_INDEX, "")):
        index = int(labels[JOB_COMPLETION_INDEX])
    else:
        pod_name = labels.get(STATEFULSET_POD_NAME) or ""
        ordinal = pod_name.rsplit("-", 1)[-1]
        index = int(ordinal) if "-" in pod_name and _SMALL_UINT.fullmatch(ordinal) else 0
    # Without the policy the producer count is not known yet: the operator checks it later.
    if policy.exists and index >= policy.producers:
        raise InjectionRefusedError(
            f"producer index {index} is out of range: the RefitPolicy has "
            f"spec.producers={policy.producers} (set {PRODUCER_INDEX})"
        )
    return index


def _reference_mounts(paired: Container, annotations: Mapping[str, str]) -> list[Obj]:
    """The paired container's mounts that hold the reference checkpoint, read-only, so the
    trainer sidecar can check the first export against it (annotation optional)."""
    path = annotations.get(REFERENCE_CHECKPOINT) or ""
    if not path:
        return []
    mounts = [m.read_only_copy() for m in paired.volume_mounts or [] if m.holds(path)]
    if not mounts:
        raise InjectionRefusedError(
            f"{REFERENCE_CHECKPOINT}={path} is not under any volume mount of container "
            f"{paired.name!r}"
        )
    return mounts


def _unique_mounts(mounts: list[Obj]) -> list[Obj]:
    """`mounts` with repeats of the same mount dropped; two different mounts at one path (the
    API server would refuse the pod) are refused with the path."""
    by_path: dict[str, Obj] = {}
    for m in mounts:
        held = by_path.setdefault(m["mountPath"], m)
        if held != m:
            raise InjectionRefusedError(
                f"the sidecar would mount both {held['name']} and {m['name']} at "
                f"{m['mountPath']} (the paired container's cloud-identity token mount clashes "
                "with one of KubeRefit's): move the token, or set spec.s3.credentialsSecret"
            )
    return list(by_path.values())


def _bundle_init(cfg: InjectionConfig) -> Obj:
    """The init container that copies the vLLM bundle into its emptyDir (a few files: small
    resources, limits equal to requests so a Guaranteed pod stays Guaranteed)."""
    small = {"cpu": "100m", "memory": "128Mi"}
    return {
        "name": BUNDLE_INIT,
        "image": cfg.image,
        "imagePullPolicy": cfg.image_pull_policy,
        "command": ["kuberefit", "vllm-bundle", "install", cfg.vllm_bundle_dir],
        "resources": {"requests": dict(small), "limits": dict(small)},
        "volumeMounts": [{"name": BUNDLE_VOLUME, "mountPath": cfg.vllm_bundle_dir}],
        "securityContext": restricted(),
    }


def _python_path(container: Container, base: str, bundle_dir: str) -> list[Obj]:
    """The op that puts `bundle_dir` first on a PYTHONPATH the container sets (none when it
    sets none: the caller adds the variable with the rest of the env)."""
    for i, item in enumerate(container.env or []):
        if item.name != "PYTHONPATH":
            continue
        if item.value_from is not None:
            raise InjectionRefusedError(
                f"container {container.name!r} takes PYTHONPATH from valueFrom; injection "
                f"must put {bundle_dir} first on it: set PYTHONPATH as a plain value"
            )
        value = item.value or ""
        joined = f"{bundle_dir}:{value}" if value else bundle_dir
        # `add`, not `replace`: an empty value is absent from the object (omitempty), and
        # `replace` of a missing member fails the whole patch at the API server.
        return [{"op": "add", "path": f"{base}/env/{i}/value", "value": joined}]
    return []


def _volumes(shm_size_limit: str, token: TokenSecretRef, bundle: bool) -> list[Obj]:
    shm: Obj = {"medium": "Memory"}
    if shm_size_limit:
        shm["sizeLimit"] = shm_size_limit
    extra = (
        [{"name": BUNDLE_VOLUME, "emptyDir": {"sizeLimit": BUNDLE_SIZE_LIMIT}}] if bundle else []
    )
    return [
        *extra,
        {"name": WORK_VOLUME, "emptyDir": {}},
        {"name": SHM_VOLUME, "emptyDir": shm},
        {"name": TMP_VOLUME, "emptyDir": {"sizeLimit": TMP_SIZE_LIMIT}},
        {
            "name": TOKEN_VOLUME,
            "secret": {
                "secretName": token.name,
                "items": [{"key": token.key, "path": token.key}],
                "defaultMode": 0o444,
            },
        },
    ]


def _mounts(cfg: InjectionConfig, paired: Container, bundle: bool) -> list[Obj]:
    taken = {m.mount_path for m in paired.volume_mounts or []}
    wanted: list[Obj] = [
        {"name": SHM_VOLUME, "mountPath": cfg.shm_dir},
        {"name": TOKEN_VOLUME, "mountPath": cfg.token_dir, "readOnly": True},
    ]
    if bundle:
        wanted.append({"name": BUNDLE_VOLUME, "mountPath": cfg.vllm_bundle_dir, "readOnly": True})
    clash = [m["mountPath"] for m in wanted if m["mountPath"] in taken]
    if clash:
        raise InjectionRefusedError(
            f"container {paired.name!r} already mounts {clash}: injection mounts "
            "KubeRefit's volumes there (change the chart's sidecar.shmDir)"
        )
    return wanted


# -- JSON Patch helpers -------------------------------------------------------------------------
def _pointer(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _merge_map(current: Mapping[str, str] | None, path: str, items: Mapping[str, str]) -> list[Obj]:
    """Ops that set `items` in the map at `path`, whose value is `current` (absent or empty:
    the whole map is added)."""
    if not current:
        return [{"op": "add", "path": path, "value": dict(items)}]
    return [{"op": "add", "path": f"{path}/{_pointer(k)}", "value": v} for k, v in items.items()]


def _append(current: Sequence[Any] | None, path: str, items: list[Any]) -> list[Obj]:
    """Ops that append `items` to the list at `path`, whose value is `current` (absent or
    empty: the whole list is added)."""
    if not items:
        return []
    if not current:
        return [{"op": "add", "path": path, "value": list(items)}]
    return [{"op": "add", "path": f"{path}/-", "value": item} for item in items]


def _without_names(existing: Sequence[EnvVar] | None, wanted: list[Obj]) -> list[Obj]:
    """`wanted` env minus names the container already sets (the user's value wins)."""
    taken = {e.name for e in existing or []}
    return [e for e in wanted if e["name"] not in taken]


def _env(name: str, value: str) -> Obj:
    return {"name": name, "value": value}


def _field_env(name: str, field_path: str) -> Obj:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def _has_container(name: str, *lists: Sequence[Container] | None) -> bool:
    return any(c.name == name for containers in lists for c in containers or [])


_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


def _label_value_ok(value: str) -> bool:
    return len(value) <= 63 and bool(_LABEL_VALUE.match(value))
