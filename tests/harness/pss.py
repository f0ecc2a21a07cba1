"""The "restricted" Pod Security Standard (baseline included) as a pure check of a pod spec.

The rules of https://kubernetes.io/docs/concepts/security/pod-security-standards/ (policy
version "latest"), written out so the chart's operator pod and the webhook's injected
containers can be checked without a cluster that enforces them (the harness API server is 1.20,
which has no Pod Security admission). `containers` limits the container rules to the named
containers: a pod's own containers are the user's business, ours must pass regardless.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

ALLOWED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
}


def _all_containers(spec: Mapping[str, Any]) -> Iterable[Mapping[str, Any]]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from spec.get(key) or []


def restricted_violations(
    spec: Mapping[str, Any], containers: Iterable[str] | None = None
) -> list[str]:
    """Every rule of "restricted" that `spec` (a PodSpec) breaks, as readable lines."""
    only = set(containers) if containers is not None else None
    pod_sc = spec.get("securityContext") or {}
    out: list[str] = []
    if only is None:  # pod-level rules
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            if spec.get(key):
                out.append(f"pod: {key}")
        for volume in spec.get("volumes") or []:
            kinds = set(volume) - {"name"}
            if not kinds <= ALLOWED_VOLUMES:
                out.append(f"volume {volume['name']}: {sorted(kinds - ALLOWED_VOLUMES)}")
        for sysctl in pod_sc.get("sysctls") or []:
            if sysctl.get("name") not in SAFE_SYSCTLS:
                out.append(f"pod: sysctl {sysctl.get('name')}")
        if pod_sc.get("runAsUser") == 0:
            out.append("pod: runAsUser 0")
        if (pod_sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append("pod: seccompProfile Unconfined")
    for c in _all_containers(spec):
        name = c.get("name")
        if only is not None and name not in only:
            continue
        sc = c.get("securityContext") or {}
        where = f"container {name}"
        if sc.get("privileged"):
            out.append(f"{where}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation is not false")
        if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True:
            out.append(f"{where}: runAsNonRoot is not true (container or pod)")
        if sc.get("runAsUser") == 0:
            out.append(f"{where}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{where}: seccompProfile {seccomp} (RuntimeDefault or Localhost)")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{where}: capabilities do not drop ALL")
        added = set(caps.get("add") or [])
        if added - {"NET_BIND_SERVICE"}:
            out.append(f"{where}: capabilities add {sorted(added - {'NET_BIND_SERVICE'})}")
        if added - BASELINE_CAPABILITIES:
            out.append(f"{where}: capabilities beyond baseline")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"{where}: hostPort {port['hostPort']}")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"{where}: procMount {sc['procMount']}")
    return out


def read_only_root_violations(spec: Mapping[str, Any], containers: Iterable[str]) -> list[str]:
    """The named containers that do not run on a read-only root file system."""
    named = set(containers)
    return [
        f"container {c.get('name')}: readOnlyRootFilesystem is not true"
        for c in _all_containers(spec)
        if c.get("name") in named
        and (c.get("securityContext") or {}).get("readOnlyRootFilesystem") is not True
    ]
