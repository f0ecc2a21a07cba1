"""The producer's control plane: messages between the coordinator, a trainer sidecar's producer
and the trainer process's publisher (JSON over HTTP).

`AttemptPlan` and `SentReport` are used as they are on both sides of the wire: the coordinator
builds a plan, the producer service receives the same model; there is no in-memory twin.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer

from refit_protocol.commit import AttemptMode, CommitRecord
from refit_protocol.sizes import SizeOrAuto
from refit_protocol.tensors import TensorMetaModel

PRODUCER_PREFIX = "/v1/producer"


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StreamSettings(_Msg):
    """How a producer encodes and batches an attempt's payloads: the policy's `spec.encoding`
    and `spec.bucketBytes`. The coordinator sends them with every plan, so a trainer sidecar
    streams with its policy's current settings whatever it was injected with (a pod created
    before its policy, or before a change of the spec). Receivers need none of them: each
    payload says how it was encoded."""

    zstd_level: int = Field(ge=1, le=22)
    shuffle: bool
    bucket_bytes: SizeOrAuto


class FixedSettings(_Msg):
    """What a trainer sidecar took from its policy when its pod was created and keeps for the
    pod's life: its baseline is laid out in export chunks of this size and stored this way.
    The operator reports a pod whose values differ from its policy's; recreating it applies
    them."""

    chunk_bytes: SizeOrAuto
    baseline_storage: Literal["file", "memory"]


class AttemptPlan(_Msg):
    """Everything a producer needs to stream one attempt."""

    attempt: str
    from_version: int = Field(ge=0)
    target_version: int = Field(ge=1)
    baseline_id: str
    mode: AttemptMode
    xor_incompatible: frozenset[str] = frozenset()
    receivers: tuple[str, ...] = ()
    receiver_urls: tuple[str, ...] = Field(
        default=(),
        description="Base URLs of the same receivers' control planes, in the same order (a "
        "transport that announces payloads to every receiver over HTTP, S3, posts there).",
    )
    relay_tree: tuple[str, ...] = Field(
        default=(), description="Relay endpoints in tree order (ZeroMQ transport)."
    )
    settings: StreamSettings | None = Field(
        default=None,
        description="The policy's stream settings (None: the producer's own configuration, as "
        "for in-process producers).",
    )

    @field_serializer("xor_incompatible")
    def _sorted(self, names: frozenset[str]) -> list[str]:
        return sorted(names)


class SentReport(_Msg):
    """A producer's totals for one attempt, reported when its stream ended."""

    producer: int = Field(ge=0)
    payloads: int = Field(ge=0)
    wire_bytes: int = 0
    changed_elements: int = 0
    total_elements: int = 0
    timings: dict[str, float] = Field(default_factory=dict)


class BaselineUpdateRequest(_Msg):
    attempt: str
    version: int = Field(ge=0)
    baseline_id: str

    def record(self) -> CommitRecord:
        return CommitRecord(self.version, self.baseline_id)


class CommittedRecordRequest(_Msg):
    """The commit record, told to a producer that has no baseline yet (e.g. restarted): the
    trainer's first export must then be of this version, and it becomes the baseline."""

    version: int = Field(ge=0)
    baseline_id: str = Field(min_length=1)

    def record(self) -> CommitRecord:
        return CommitRecord(self.version, self.baseline_id)


class ProducerAttemptRequest(_Msg):
    attempt: str


class ProducerStatus(_Msg):
    producer: int
    committed_version: int
    committed_baseline: str
    candidate_version: int | None = None
    pending_attempt: str | None = None
    # What the trainer's publisher needs to plan and check an export (None/False: an older
    # sidecar, or a baseline that is not initialized yet).
    producers: int | None = None
    export_chunk_bytes: int | None = None
    baseline_ready: bool = False
    baseline_fingerprint: str | None = None
    #: The stream settings of its last attempt (its own configuration before the first one).
    settings: StreamSettings | None = None
    fixed: FixedSettings | None = None
    #: Why it could not send now (its transport's last check: e.g. the object store refuses
    #: its credentials); "" when nothing is known to be wrong.
    transport_problem: str = ""


# -- candidate staging: the trainer process hands its export of a version to its sidecar -------

#: "initial": the first export (becomes the baseline; version = the committed one);
#: "next": the candidate of committed + 1 (compared with the baseline by the next transition).
StagePurpose = Literal["initial", "next"]


class CandidateChunkRequest(_Msg):
    """One owned export chunk, written by the trainer as `file` in the sidecar's inbox."""

    version: int = Field(ge=0)
    purpose: StagePurpose = "next"
    index: int = Field(ge=0)
    file: str = Field(min_length=1, max_length=255)
    names: list[str] = Field(min_length=1, description="The chunk's tensors, in export order.")
    changed: list[str] = Field(
        default_factory=list,
        description="Those of `names` the file gives as changes against the committed "
        "baseline (direct projection): `<name>@positions` (sorted int64 flat indices) and "
        "`<name>@values` (their new values), not the whole tensor. Only for `next`.",
    )


class CandidateChunkAck(_Msg):
    index: int
    nbytes: int


class CandidateStageRequest(_Msg):
    """Every chunk was sent: check the whole export and stage it (or build the baseline)."""

    version: int = Field(ge=0)
    purpose: StagePurpose = "next"
    manifest: list[TensorMetaModel] = Field(description="Every tensor, in export order.")
    chunks: list[int] = Field(description="Indices of the owned chunks that were sent.")


class CandidateStaged(_Msg):
    version: int
    purpose: StagePurpose
    producer: int
    chunks: int
    nbytes: int
    fingerprint: str | None = None  # digest of the owned tensors (initial exports only)


class BaselineManifest(_Msg):
    """The baseline's export layout, so a trainer can check its export before sending it."""

    version: int
    tensors: list[TensorMetaModel]


class CandidateAbortRequest(_Msg):
    version: int = Field(ge=0)
