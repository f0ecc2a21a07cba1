"""Control-plane messages between the coordinator and a trainer sidecar's producer."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from refit_operator.api import AttemptMode
from refit_operator.commit_store import CommitRecord
from refit_operator.ports import AttemptPlan, SentReport

PRODUCER_PREFIX = "/v1/producer"


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AttemptPlanModel(_Msg):
    attempt: str
    from_version: int = Field(ge=0)
    target_version: int = Field(ge=1)
    baseline_id: str
    mode: AttemptMode
    xor_incompatible: list[str] = Field(default_factory=list)
    receivers: list[str] = Field(default_factory=list)
    relay_tree: list[str] = Field(default_factory=list)

    @classmethod
    def of(cls, plan: AttemptPlan) -> AttemptPlanModel:
        return cls(
            attempt=plan.attempt,
            from_version=plan.from_version,
            target_version=plan.target_version,
            baseline_id=plan.baseline_id,
            mode=plan.mode,
            xor_incompatible=sorted(plan.xor_incompatible),
            receivers=list(plan.receivers),
            relay_tree=list(plan.relay_tree),
        )

    def plan(self) -> AttemptPlan:
        return AttemptPlan(
            self.attempt,
            self.from_version,
            self.target_version,
            self.baseline_id,
            self.mode,
            frozenset(self.xor_incompatible),
            tuple(self.receivers),
            tuple(self.relay_tree),
        )


class SentReportModel(_Msg):
    producer: int
    payloads: int
    wire_bytes: int = 0
    changed_elements: int = 0
    total_elements: int = 0
    timings: dict[str, float] = Field(default_factory=dict)

    @classmethod
    def of(cls, r: SentReport) -> SentReportModel:
        return cls(
            producer=r.producer,
            payloads=r.payloads,
            wire_bytes=r.wire_bytes,
            changed_elements=r.changed_elements,
            total_elements=r.total_elements,
            timings=dict(r.timings),
        )

    def report(self) -> SentReport:
        return SentReport(
            self.producer,
            self.payloads,
            self.wire_bytes,
            self.changed_elements,
            self.total_elements,
            dict(self.timings),
        )


class BaselineUpdateRequest(_Msg):
    attempt: str
    version: int = Field(ge=0)
    baseline_id: str

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


# -- candidate staging: the trainer process hands its export of a version to its sidecar -------

#: "initial": the first export (becomes the baseline; version = the committed one);
#: "next": the candidate of committed + 1 (compared with the baseline by the next transition).
StagePurpose = Literal["initial", "next"]


class TensorMetaModel(_Msg):
    """A canonical tensor's identity; dtype is torch's name without the prefix ("bfloat16")."""

    name: str = Field(min_length=1)
    shape: list[int]
    dtype: str


class CandidateChunkRequest(_Msg):
    """One owned export chunk, written by the trainer as `file` in the sidecar's inbox."""

    version: int = Field(ge=0)
    purpose: StagePurpose = "next"
    index: int = Field(ge=0)
    file: str = Field(min_length=1, max_length=255)
    names: list[str] = Field(min_length=1, description="The chunk's tensors, in export order.")


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
