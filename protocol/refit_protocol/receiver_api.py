"""The receiver's control plane: messages between the coordinator and a rollout node (JSON/HTTP).

One definition shared by both sides: the coordinator (operator image, no torch) sends these and
the receiver service validates them with the same models. Payload bytes never appear here, only
identifiers, counts and digests; the S3 transport's manifest pointers (`ManifestEntry`,
`StreamEnd`) travel on the same plane, from producers to receivers.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from refit_protocol.commit import AttemptMode
from refit_protocol.tensors import TensorMetaModel

API_PREFIX = "/v1"


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------------------- receiver service
class PrewarmRequest(_Msg):
    metas: list[TensorMetaModel]


class RestoreRequest(_Msg):
    """Dense restore of a new or restarted receiver to the committed version (a joining node).

    `source` is the committed version's checkpoint (a directory of safetensors files the
    node's runtime can read); the node loads it through its runtime's own loader, prewarms
    with `metas` and then holds `version`."""

    version: int = Field(ge=0)
    source: str = Field(min_length=1)
    metas: list[TensorMetaModel]


class AuditRequest(_Msg):
    """Compare what the node holds with a dense load of `checkpoint` (a directory of safetensors
    files the node's runtime can read), writing nothing; `version` is the version it should
    hold (the audit reports `version_moved` when the node holds another)."""

    checkpoint: str = Field(min_length=1)
    version: int = Field(ge=0)


class AuditMismatch(_Msg):
    name: str  # canonical tensor
    storages: list[str]  # the runtime's parameters/buffers the copy wrote
    count: int
    positions: list[int]  # first flat positions in the destination view
    held_bits: list[int]
    expected_bits: list[int]


class RankAudit(_Msg):
    rank: int
    host: str = ""  # the rank's host (pod); a server spanning several hosts names each
    ok: bool
    tensors: int
    elements: int
    copies: int
    skipped: list[str] = Field(default_factory=list)
    mismatches: list[AuditMismatch] = Field(default_factory=list)


class AuditResponse(_Msg):
    node: str
    version: int  # the version audited
    held_version: int | None  # what the node held when the audit ended
    version_moved: bool  # the node did not hold `version`: nothing was compared
    ok: bool  # every rank holds exactly a dense load of the checkpoint
    seconds: float
    ranks: list[RankAudit] = Field(default_factory=list)
    #: Another host of a multi-host server: nothing compared here; the leader's audit reaches
    #: this host's ranks and reports each with its host.
    audited_by_leader: bool = False


class RankPrewarm(_Msg):
    rank: int
    host: str = ""  # the rank's host (pod); a server spanning several hosts names each
    skipped: list[str] = Field(default_factory=list)
    xor_incompatible: dict[str, str] = Field(default_factory=dict)
    unsupported: dict[str, str] = Field(default_factory=dict)
    scratch_bytes: int = 0


class PrewarmResponse(_Msg):
    node: str
    ranks: list[RankPrewarm]

    @property
    def xor_incompatible(self) -> set[str]:
        return {n for r in self.ranks for n in r.xor_incompatible}

    @property
    def unsupported(self) -> dict[str, str]:
        return {n: e for r in self.ranks for n, e in r.unsupported.items()}


class PrepareRequest(_Msg):
    """Bind a fresh attempt; replaces (obsoletes) any earlier attempt on this receiver."""

    attempt: str
    from_version: int = Field(ge=0)
    target_version: int = Field(ge=1)
    mode: AttemptMode
    sync: bool = True  # sync RL: apply during delivery after open_apply; async: stage first
    producers: list[int]
    coordinator: str = ""
    # Additions of the delivery layer (defaults keep older callers valid):
    check_samples: int = Field(
        default=0, ge=-1, description="Post-apply checks per payload: 0 off, N samples, -1 all."
    )
    relay_tree: list[str] = Field(
        default_factory=list,
        description="ZeroMQ endpoints of every relay node in tree order for this attempt "
        "(empty: the receiver's configured order). Membership changes only between attempts.",
    )
    relay_mac_tree: list[str] = Field(
        default_factory=list,
        description="The same nodes' MAC-only relay endpoints, in the same order: a relay "
        "forwards to a node's entry over a plain, tagged link, or over CurveZMQ to its "
        "relay_tree entry where the entry is empty. Empty: every relay link is encrypted.",
    )

    @model_validator(mode="after")
    def _same_nodes(self) -> PrepareRequest:
        if self.relay_mac_tree and len(self.relay_mac_tree) != len(self.relay_tree):
            raise ValueError("relay_mac_tree must name the nodes of relay_tree, in its order")
        return self


class PrepareResponse(_Msg):
    node: str
    accepted: bool
    reason: str = ""
    held_version: int | None = None  # version whose bits the receiver holds, if clean


class AttemptRequest(_Msg):
    """open-apply, stop, cleanup, status filters: an attempt id only."""

    attempt: str


class ManifestEntry(_Msg):
    """S3: a pointer to one payload object (the body never passes through HTTP)."""

    attempt: str
    producer: int
    payload_id: int
    order: int
    bucket: str
    key: str
    digest: str  # hex BLAKE2b-128 of the compressed body
    size: int = Field(ge=0)


class ManifestResponse(_Msg):
    """How a receiver took a manifest entry: staged (202), duplicate (200), wait (429)."""

    node: str
    status: str
    error: str = ""


class StreamEnd(_Msg):
    """A producer finished its stream of `attempt` with `total` payloads (orders 0..total-1)."""

    attempt: str
    producer: int = Field(ge=0)
    total: int = Field(ge=0)


class RelayFlushRequest(_Msg):
    attempt: str
    expected: dict[int, int]  # producer -> payloads it reported sent
    timeout_s: float | None = Field(default=None, gt=0, description="None: receiver default.")


class RelayFlushResponse(_Msg):
    node: str
    attempt: str
    ok: bool
    staged: int
    errors: list[str] = Field(default_factory=list)


class FlushRequest(_Msg):
    attempt: str
    expected: dict[int, int]  # producer -> payload count
    check_samples: int = 0
    timeout_s: float | None = Field(default=None, gt=0, description="None: receiver default.")


class FlushResponse(_Msg):
    """The completion ACK: everything expected arrived, was applied and the device synced."""

    node: str
    attempt: str
    ok: bool
    applied: int
    staged: int
    checks: int = 0
    errors: list[str] = Field(default_factory=list)
    timings: dict[str, float] = Field(default_factory=dict)


class StopResponse(_Msg):
    node: str
    attempt: str
    drained: bool
    errors: list[str] = Field(default_factory=list)


class GateRequest(_Msg):
    attempt: str
    closed: bool  # True: wait for in-flight requests, then hold new ones; False: reopen


class CommitNotice(_Msg):
    """The commit record now names `version` for `attempt`: held bits are that version."""

    attempt: str
    version: int
    dense: bool = False  # a dense restore wrote every bit of `version` (no attempt involved)


class ApplyProgress(_Msg):
    """How far a server leader's receiver has applied its attempt (`GET /v1/progress`), read by
    the receivers of the server's other hosts: their staged payload files may go once every
    rank has read them. Not a coordinator call (it does not count as operator contact)."""

    node: str
    attempt: str | None
    phase: str
    applied: int = 0  # payloads applied by every rank, in the attempt's declared order


class ReceiverStatus(_Msg):
    node: str
    held_version: int | None
    attempt: str | None
    phase: str
    staged: int = 0
    applied: int = 0
    gate_closed: bool = False
    errors: list[str] = Field(default_factory=list)
    dirty: bool = False  # partial writes since held_version: only overwrite attempts admissible
    # The version the node held before those partial writes (an overwrite attempt from it
    # repairs the node in place); equal to held_version when not dirty.
    base_version: int | None = None
    prewarmed: bool = False  # classified its loaders for the current metadata (prewarm/restore)
    dropped: int = 0  # payloads of obsolete attempts dropped since start
    #: Set when the node reopened its gate without a coordinator (`receiver.absence`); cleared
    #: by the next prepare.
    gate_released: str | None = None
    #: A vLLM server spanning several hosts: its name, and whether this node is the leader's
    #: (it applies, through every rank) or another host's (it stages for its ranks). A
    #: coordinator keeps or drops a server's nodes together.
    server: str | None = None
    server_role: Literal["leader", "host"] | None = None
