"""Control-plane messages between the coordinator and a trainer sidecar's producer."""

from __future__ import annotations

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
