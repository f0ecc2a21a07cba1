"""What an injected container may use and who it runs as (pure): resources, QoS, security.

The chart's `sidecar.resources` hold unless a pod overrides them (`kuberefit.io/sidecar-cpu`,
`-memory`, `-cpu-limit`, `-memory-limit`, as Istio's `sidecar.istio.io/proxyCPU` family); a
Guaranteed pod stays Guaranteed; every injected container passes the "restricted" Pod Security
Standard and runs as the sidecar image's user, whatever the pod's own securityContext says.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from refit_operator.injection.config import InjectionConfig
from refit_operator.injection.pod import PodSpec
from refit_operator.kube.names import (
    SIDECAR_CPU,
    SIDECAR_CPU_LIMIT,
    SIDECAR_MEMORY,
    SIDECAR_MEMORY_LIMIT,
)

Obj = dict[str, Any]
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?([EPTGMK]i|[mkMGTPE])?")
#: The sidecar image's user (Dockerfile.sidecar's USER).
SIDECAR_UID = 65532


class InjectionRefusedError(ValueError):
    """The pod opted in but cannot be injected as written (the message says what to fix)."""


def restricted() -> Obj:
    """A security context that passes the "restricted" Pod Security Standard. The user is the
    sidecar image's own (65532), set here too: a pod whose securityContext runs as root (many
    GPU images do) would otherwise pass root down, and runAsNonRoot would stop the container."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "runAsUser": SIDECAR_UID,
        "runAsGroup": SIDECAR_UID,
        "readOnlyRootFilesystem": True,  # writes go to the emptyDirs (/tmp among them)
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def sidecar_resources(cfg: InjectionConfig, spec: PodSpec, annotations: Mapping[str, str]) -> Obj:
    """The chart's sidecar resources, overridden per pod by the annotations; in a pod whose
    every container has limits equal to requests (Guaranteed QoS), the sidecar's limits equal
    its requests too, so the pod stays Guaranteed."""
    requests = dict((cfg.resources or {}).get("requests") or {})
    limits = dict((cfg.resources or {}).get("limits") or {})
    for key, name, target in (
        (SIDECAR_CPU, "cpu", requests),
        (SIDECAR_MEMORY, "memory", requests),
        (SIDECAR_CPU_LIMIT, "cpu", limits),
        (SIDECAR_MEMORY_LIMIT, "memory", limits),
    ):
        value = annotated_quantity(annotations, key, "")
        if value:
            target[name] = value
    if _guaranteed(spec):
        limits = {**limits, **requests}
        requests = dict(limits)
    out: Obj = {k: v for k, v in cfg.resources.items() if k not in ("requests", "limits")}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _guaranteed(spec: PodSpec) -> bool:
    """Every container sets cpu and memory limits, and requests equal to them (or none)."""
    containers = [*(spec.containers or []), *(spec.init_containers or [])]
    for c in containers:
        limits = (c.resources.limits if c.resources else None) or {}
        requests = (c.resources.requests if c.resources else None) or {}
        if not {"cpu", "memory"} <= set(limits):
            return False
        if any(requests.get(k, limits[k]) != limits[k] for k in ("cpu", "memory")):
            return False
    return bool(containers)


def annotated_quantity(annotations: Mapping[str, str], key: str, default: str) -> str:
    """The Kubernetes quantity the pod's annotation `key` sets, else `default`; refused at
    admission when it is not one (the kubelet would reject the pod later, less clearly)."""
    value = annotations.get(key)
    if value is None:
        return default
    if not _QUANTITY.fullmatch(value):
        raise InjectionRefusedError(
            f"{key}={value!r} is not a Kubernetes quantity (e.g. 500m, 2, 4Gi)"
        )
    return value
