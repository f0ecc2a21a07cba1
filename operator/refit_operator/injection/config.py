"""What the webhook injects, as the chart renders it (`sidecar:` values -> injection.json).

Field names are the chart's (camelCase); defaults equal the chart's, so an operator started
without `--injection-config` injects what a default `helm install` would.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from refit_operator.kube.names import DEFAULT_PORTS


class _Values(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class SidecarPorts(_Values):
    """Container ports of the injected sidecar (named refit-control, refit-relay and
    refit-relay-mac)."""

    control: int = Field(DEFAULT_PORTS["rollout"], ge=1, le=65535, description="Receiver HTTP.")
    producer: int = Field(DEFAULT_PORTS["trainer"], ge=1, le=65535, description="Producer HTTP.")
    relay: int = Field(8472, ge=1, le=65535, description="Receiver's ZeroMQ relay node.")
    relay_mac: int = Field(
        8473, ge=1, le=65535, description="The relay node's MAC-only port (other relays)."
    )


class TokenSecretRef(_Values):
    name: str = Field(min_length=1)
    key: str = Field("token", min_length=1)


class InjectionConfig(_Values):
    """The sidecar and its volumes (chart values under `sidecar:` plus image and log format)."""

    image: str = Field("kuberefit/sidecar:0.1.0", min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    image_pull_secrets: list[str] = Field(
        default_factory=list,
        description="Secrets (names, in the pods' namespaces) added to injected pods' "
        "imagePullSecrets, for a sidecar image in a private registry.",
    )
    resources: dict[str, Any] = Field(
        default_factory=lambda: {"requests": {"cpu": "1", "memory": "2Gi"}},
        description="The sidecar container's resources (a Kubernetes ResourceRequirements).",
    )
    ports: SidecarPorts = Field(default_factory=SidecarPorts)
    work_dir: str = Field(
        "/var/lib/kuberefit", description="emptyDir for the baseline and staged candidates."
    )
    shm_dir: str = Field(
        "/dev/shm/kuberefit",
        description="Memory-backed emptyDir shared with the paired container (payload files).",
    )
    shm_size_limit: str = Field("8Gi", description="sizeLimit of that emptyDir ('' for none).")
    vllm_bundle_dir: str = Field(
        "/kuberefit/vllm-bundle",
        description="Where the vLLM bundle (the code that runs inside vLLM) is mounted in the "
        "vLLM container, read-only, first on its PYTHONPATH; an init container copies it there.",
    )
    default_token_secret: TokenSecretRef = Field(
        default_factory=lambda: TokenSecretRef(name="kuberefit-token"),
        description="Token Secret used when the pod's RefitPolicy does not exist at admission.",
    )
    env: list[dict[str, Any]] = Field(
        default_factory=list, description="Extra env of the sidecar container."
    )
    vllm_container: str = Field(
        "", description="Container paired with in rollout pods ('' : the first container)."
    )
    native_sidecars: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Trainer sidecars as native sidecars (an init container with "
        "restartPolicy Always, Kubernetes 1.29+), so a Job's pod completes when its trainer "
        "exits. auto: on where the API server's version (read at the operator's start) has "
        "them. Without them the sidecar is a regular container that exits with its trainer in "
        "pods whose restartPolicy is Never or OnFailure.",
    )
    log_format: Literal["json", "console"] = Field(
        "json", description="$KUBEREFIT_LOG_FORMAT of the sidecar (the chart's logFormat)."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="$KUBEREFIT_LOG_LEVEL of the sidecar (the chart's logLevel)."
    )

    @property
    def token_dir(self) -> str:
        return "/etc/kuberefit/token"

    @model_validator(mode="after")
    def _consistent(self) -> InjectionConfig:
        """Settings that would make every injected pod invalid fail the operator's start."""
        receiver_ports = (self.ports.control, self.ports.relay, self.ports.relay_mac)
        if len(set(receiver_ports)) < len(receiver_ports):
            raise ValueError(
                "ports.control, ports.relay and ports.relayMac must differ (all are on receivers)"
            )
        dirs = {
            "workDir": self.work_dir,
            "shmDir": self.shm_dir,
            "token": self.token_dir,
            "vllmBundleDir": self.vllm_bundle_dir,
        }
        for a, pa in dirs.items():
            if not pa.startswith("/"):
                raise ValueError(f"{a} must be an absolute path, got {pa!r}")
            for b, pb in dirs.items():
                if a < b and (
                    pa == pb
                    or pa.startswith(pb.rstrip("/") + "/")
                    or pb.startswith(pa.rstrip("/") + "/")
                ):
                    raise ValueError(f"{a} ({pa}) and {b} ({pb}) overlap")
        return self


#: The first Kubernetes version whose API server stores native sidecars (on by default).
NATIVE_SIDECARS_SINCE = (1, 29)


def with_native_sidecars(config: InjectionConfig, major: str, minor: str) -> InjectionConfig:
    """`config` with `native_sidecars: auto` decided by the API server's version (as /version
    spells it: minor may read "29+"); an unreadable version means off."""
    if config.native_sidecars != "auto":
        return config
    try:
        version = (int(major), int(re.sub(r"\D.*", "", minor)))
    except ValueError:
        version = (0, 0)
    on = version >= NATIVE_SIDECARS_SINCE
    return config.model_copy(update={"native_sidecars": "on" if on else "off"})


class InjectionConfigError(ValueError):
    """The injection settings file is missing or invalid (the message names the field)."""


def load_injection_config(path: Path | None) -> InjectionConfig:
    """The settings in `path` (JSON, as the chart renders them); defaults without a path."""
    if path is None:
        return InjectionConfig()
    try:
        return InjectionConfig.model_validate_json(path.read_text())
    except OSError as exc:
        raise InjectionConfigError(f"--injection-config {path}: {exc.strerror}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(document)"
        raise InjectionConfigError(
            f"--injection-config {path}: sidecar.{where}: {first['msg']}"
        ) from None
