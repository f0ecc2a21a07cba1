"""Settings of the relay tree: one DEALER hop (`RelayDealer`) and one relay node (`RelayNode`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from refit_protocol.sizes import ByteSize


class DealerConfig(BaseModel):
    """Window, timeouts and backoff of one DEALER hop (producer -> root, relay -> child)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    window: int = Field(default=4, ge=1, description="Frames sent and not yet answered.")
    ack_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Base wait for an answer before resending (plus the transfer time of the "
        "bytes in flight at `min_bandwidth_bytes_s`).",
    )
    min_bandwidth_bytes_s: float = Field(
        default=12.5e6, gt=0, description="Slowest link assumed when sizing ACK deadlines."
    )
    max_retries: int = Field(
        default=3, ge=0, description="Resends after a missing answer before the payload fails."
    )
    wait_backoff_min_s: float = Field(default=0.01, gt=0, description="First PROBE delay.")
    wait_backoff_max_s: float = Field(default=0.5, gt=0, description="Longest PROBE delay.")
    max_wait_s: float = Field(
        default=3600.0,
        gt=0,
        description="How long a payload may be held back by WAIT answers (backpressure).",
    )
    unknown_attempt_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="How long to retry while the relay does not know the attempt (prepare race).",
    )
    connect_timeout_s: float = Field(default=10.0, gt=0, description="TCP connect timeout.")


class RootDealerConfig(DealerConfig):
    """A producer's hop to its root relay: the link between the clusters, so a wider window."""

    window: int = Field(
        default=16,
        ge=1,
        description="Frames sent and not yet answered (not below the transport's "
        "`max_in_flight`: the frames past it wait in the producer).",
    )


class RelayConfig(BaseModel):
    """One node's place in the relay tree."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bind: str = Field(
        description="ZeroMQ endpoint the ROUTER binds, e.g. tcp://0.0.0.0:5701.",
        examples=["tcp://127.0.0.1:5701"],
    )
    advertise: str | None = Field(
        default=None,
        description="How the other nodes and producers reach this relay (its entry in `nodes`); "
        "defaults to `bind`.",
    )
    mac_bind: str | None = Field(
        default=None,
        description="ZeroMQ endpoint of a second, plain ROUTER for MAC-only links from the "
        "other relays of the rollout cluster (frames tagged with the policy's frame key, "
        "payloads readable on the wire: docs/security.md); None: every link is CurveZMQ.",
        examples=["tcp://0.0.0.0:5702"],
    )
    mac_advertise: str | None = Field(
        default=None,
        description="How the other relays reach the MAC-only ROUTER; defaults to `mac_bind`.",
    )
    nodes: list[str] = Field(
        default_factory=list,
        description="Every relay endpoint in tree order (a prepare's relay_tree overrides it).",
    )
    forward: DealerConfig = Field(
        default_factory=DealerConfig, description="Window and retries of child forwards."
    )
    max_payload_bytes: ByteSize = Field(
        default=8 << 30, gt=0, description="Largest frame accepted (ZeroMQ MAXMSGSIZE)."
    )

    @property
    def endpoint(self) -> str:
        return self.advertise or self.bind

    @property
    def mac_endpoint(self) -> str:
        """The MAC-only ROUTER's address for the other relays ("" without one)."""
        return self.mac_advertise or self.mac_bind or ""
