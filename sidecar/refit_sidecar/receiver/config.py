"""Receiver node settings (one pydantic model, loaded from a JSON file by `python -m`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from refit_protocol.kit.config_files import ConfigPath
from refit_protocol.kit.tokens import DEFAULT_ROTATION_GRACE_S
from refit_protocol.sizes import ByteSize
from refit_sidecar.transport.relay.config import RelayConfig
from refit_sidecar.transport.s3 import S3Config


class ApplierConfig(BaseModel):
    """Which applier writes the weights of this node."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["inprocess", "vllm", "vllm_host", "factory"] = Field(
        default="vllm",
        description="inprocess: `factory` returns a torch module with load_weights (local mode, "
        "tests); vllm: the vLLM server's refit control path (on a server spanning several "
        "hosts: the leader's pod); vllm_host: another host of such a server (stages payload "
        "files for its ranks; the leader's receiver applies); factory: `factory` returns an "
        "Applier.",
    )
    factory: str = Field(
        default="", description="'module:callable' for kinds inprocess and factory."
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the factory."
    )
    device: str = Field(default="cpu", description="inprocess: torch device of the module.")
    vllm_url: str = Field(
        default="http://127.0.0.1:8000", description="vllm: base URL of the OpenAI server."
    )
    control_token: SecretStr | None = Field(
        default=None,
        description="vllm: bearer token of the refit control path in the server "
        "(`refit_sidecar.vllm.control_path`); default: this receiver's own token.",
    )
    shm_dir: ConfigPath = Field(
        default=Path("/dev/shm/kuberefit"),
        description="vllm: shared-memory directory the workers read staged payload files from.",
    )
    rpc_timeout_s: float = Field(default=600.0, gt=0, description="vllm: per-call timeout.")
    stage_wait_s: float = Field(
        default=60.0,
        ge=0,
        description="vllm: how long a worker on another host of the server waits for its own "
        "host's receiver to stage a payload file before the apply fails (less than "
        "rpc_timeout_s; by default at most half of it); vllm_host: this plus rpc_timeout_s is "
        "how long a staged payload waits for the leader to apply it.",
    )
    leader_url: str = Field(
        default="",
        description="vllm_host: control URL of the server leader's receiver (e.g. "
        "http://$(LWS_LEADER_ADDRESS):8470); it is asked how far the server has applied.",
    )
    pause_mode: Literal["wait", "abort", "keep"] = Field(
        default="wait",
        description="vllm: how /pause treats in-flight requests when the gate closes.",
    )

    @model_validator(mode="after")
    def _server_settings(self) -> ApplierConfig:
        if self.kind == "vllm_host" and not self.leader_url:
            raise ValueError(
                "applier kind vllm_host needs leader_url: the control URL of the receiver in "
                "the server leader's pod"
            )
        chosen = "stage_wait_s" in self.model_fields_set
        if self.kind == "vllm" and chosen and self.stage_wait_s >= self.rpc_timeout_s:
            raise ValueError(
                f"applier.stage_wait_s ({self.stage_wait_s:g}) must be less than "
                f"rpc_timeout_s ({self.rpc_timeout_s:g}): a worker waiting for its host's "
                "payload file must fail before the call that waits for it"
            )
        return self

    @property
    def server_host(self) -> bool:
        """Another host of a multi-host server: it stages for its ranks, the leader applies."""
        return self.kind == "vllm_host"

    @property
    def stage_wait(self) -> float:
        """`stage_wait_s`; left at its default, never more than half of `rpc_timeout_s` (a
        short per-call timeout set for one-host servers stays valid)."""
        if "stage_wait_s" in self.model_fields_set:
            return self.stage_wait_s
        return min(self.stage_wait_s, self.rpc_timeout_s / 2)


class ReceiverConfig(BaseModel):
    """One rollout node's receiver. Defaults follow the paper's Appendix C."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    node: str = Field(description="Node name reported in every answer.", examples=["rollout-0"])
    host: str = Field(default="127.0.0.1", description="HTTP bind address.")
    port: int = Field(default=8470, ge=0, le=65535, description="HTTP port (0: pick one).")
    token: SecretStr | None = Field(default=None, description="Bearer token (HTTP and ZMQ).")
    token_file: ConfigPath | None = Field(
        default=None,
        description="File holding the token (a mounted Secret: followed, so a rotated token is "
        "taken without a restart).",
    )
    token_rotation_grace_s: float = Field(
        default=DEFAULT_ROTATION_GRACE_S,
        gt=0,
        description="After the token file changes: seconds the previous token is still sent "
        "(and twice that, accepted); longer than the Secret's propagation to every pod.",
    )
    allow_insecure: bool = Field(
        default=False,
        description="Serve without a token on a non-loopback address (never in production).",
    )
    held_version: int | None = Field(
        default=None,
        ge=0,
        description="Version whose bits the runtime holds at start (e.g. loaded densely).",
    )
    server: str | None = Field(
        default=None,
        description="The vLLM server spanning several hosts that this pod is one host of (the "
        "same name in every host's receiver, e.g. the LeaderWorkerSet group); the applier kind "
        "says which host: vllm for the leader's pod, vllm_host for the others.",
    )
    queue_groups: int = Field(default=32, ge=1, description="Resident groups of the apply queue.")
    group_size: int = Field(
        default=8, ge=1, description="Payloads per group; one group is applied per call."
    )
    staging_workers: int = Field(default=2, ge=1, description="Threads validating/decoding.")
    download_workers: int = Field(default=4, ge=1, description="Threads downloading from S3.")
    download_retries: int = Field(default=3, ge=0, description="Retries of a failed download.")
    async_staging_max_bytes: ByteSize = Field(
        default=64 << 30,
        gt=0,
        description="Async RL: most compressed bytes staged in host memory before the gate "
        "closes; more fails the attempt (it cannot wait: nothing applies until open_apply).",
    )
    manifest_wait_s: float = Field(
        default=5.0,
        ge=0,
        description="How long a manifest request waits for queue room before answering 429.",
    )
    flush_timeout_s: float = Field(default=600.0, gt=0, description="Default flush deadline.")
    relay_flush_timeout_s: float = Field(
        default=120.0, gt=0, description="Default relay-flush deadline."
    )
    stop_timeout_s: float = Field(
        default=120.0, gt=0, description="How long stop waits for the apply in progress."
    )
    gate_release_s: float = Field(
        default=600.0,
        ge=0,
        description="Operator absence: after this many seconds without a coordinator call "
        "(a live one calls every few seconds during a transition), a request gate closed by "
        "an attempt that wrote nothing reopens (the node serves its committed weights), and a "
        "node holding partial writes reports NotReady until a coordinator restores it. 0: "
        "never (the gate waits for a coordinator).",
    )
    check_samples: int = Field(
        default=0, ge=-1, description="Post-apply checks per payload when prepare asks none."
    )
    max_control_body_bytes: ByteSize = Field(
        default=64 << 20, gt=0, description="Largest control-plane request (prewarm metadata)."
    )
    relay: RelayConfig | None = Field(default=None, description="Relay-tree node (ZeroMQ).")
    s3: S3Config | None = Field(default=None, description="Object-storage downloads.")
    applier: ApplierConfig = Field(
        default_factory=ApplierConfig, description="What writes the weights of this node."
    )

    @property
    def queue_capacity(self) -> int:
        """Decoded payload slots: resident groups plus one group under assembly (264)."""
        return (self.queue_groups + 1) * self.group_size
