"""What one transition is configured with and how it ended: the types the coordinator, the
metrics recorder, the RefitTransition writer and the spec share, apart from the algorithm
(`coordinator.py`) so that none of them imports it for a type."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from refit_operator.ports import TransitionProgress
from refit_protocol.commit import AttemptMode

#: "failed" is never the coordinator's own outcome: the operator records it when the
#: coordinator itself raised (e.g. the API server failed); the next coordinator takes over.
Outcome = Literal["committed", "rejected", "conflict", "aborted", "failed"]
#: The coordinator's own outcomes (series created at 0 for each).
OUTCOMES: tuple[Outcome, ...] = ("committed", "rejected", "conflict", "aborted")
MODES: tuple[AttemptMode, ...] = ("mixed", "overwrite")
#: How one attempt ended: the one that committed, one that failed (retried in overwrite mode
#: or the transition aborted), a rejected first prepare, a conflict with another coordinator.
ATTEMPT_OUTCOMES = ("committed", "failed", "rejected", "conflict")
#: A committed transition's stages and the `TransitionProgress.timings` key of each: construct
#: (the slowest producer's delta construction and encoding), transport (its sending), apply
#: (the slowest receiver's applier calls and device sync), finalize (flush acknowledged to the
#: last baseline update).
STAGE_TIMINGS = {
    "construct": "construct_s",
    "transport": "transport_s",
    "apply": "apply_s",
    "finalize": "finalization_s",
}
STAGES = tuple(STAGE_TIMINGS)


class CoordinatorConfig(BaseModel):
    """Coordinator settings (defaults are the RefitPolicy CRD's)."""

    model_config = ConfigDict(extra="forbid")  # a misspelt key is an error, not a default

    sync: bool = Field(True, description="Sync RL: close the gate first, apply during delivery.")
    relay_tree: bool = Field(True, description="ZeroMQ relay tree: relay-flush before flush.")
    intra_cluster: Literal["mac", "encrypted"] = Field(
        "mac",
        description="Relay-to-relay links inside the rollout cluster: MAC-only (plain TCP, "
        "every frame tagged) where a node has a MAC-only port, or CurveZMQ (docs/security.md).",
    )
    commit_timeout_s: float = Field(600.0, gt=0, description="Deadline of each attempt's commit.")
    control_timeout_s: float = Field(60.0, gt=0, description="Timeout of one control call.")
    flush_timeout_s: float = Field(600.0, gt=0, description="Timeout of a receiver flush.")
    max_attempts: int = Field(5, ge=1, description="Attempts before the operator must step in.")
    stop_retries: int = Field(3, ge=1, description="Tries to drain a silent receiver.")
    stop_drain_s: float = Field(
        300.0,
        gt=0,
        description="How long a receiver that acknowledged a stop (its status shows the "
        "attempt stopped) is waited for while its apply call in progress ends; a receiver's "
        "own stop waits at most its stop_timeout_s (120 s by default).",
    )
    check_samples: int = Field(
        0, ge=-1, description="Post-apply checks per payload (0 off, N samples, -1 all)."
    )
    liveness_probe_s: float = Field(
        1.0,
        gt=0,
        description="While producers stream, probe receivers this often; one confirmed dead "
        "fails the attempt at once instead of after the transport's timeouts.",
    )


@dataclass
class TransitionResult:
    outcome: Outcome
    version: int  # the committed version when the transition ended
    attempts: int
    modes: list[AttemptMode] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    receivers: list[str] = field(default_factory=list)  # those of the last attempt
    message: str = ""
    reason: str = ""  # CamelCase cause of an outcome other than committed
    progress: TransitionProgress | None = None
    latency_s: float = 0.0  # timed window: first producer start .. last baseline update
    finalization_s: float = 0.0  # flush acknowledged .. last baseline update

    def summary(self) -> dict[str, object]:
        """The fields of the `transition.done` log line."""
        return {
            "outcome": self.outcome,
            "version": self.version,
            "attempts": self.attempts,
            "modes": self.modes,
            "retired": self.retired,
            "latency_s": round(self.latency_s, 3),
        }

    def stage_seconds(self) -> dict[str, float]:
        """The stage times of a committed transition (those its progress recorded)."""
        timings = self.progress.timings if self.progress is not None else {}
        return {stage: timings[key] for stage, key in STAGE_TIMINGS.items() if key in timings}

    def attempt_outcomes(self) -> list[tuple[str, str]]:
        """(mode, outcome) of each attempt: every attempt but the last failed; the last one
        ended as the transition did (an abort: failed)."""
        if not self.modes:
            return []
        last = self.outcome if self.outcome in ATTEMPT_OUTCOMES else "failed"
        return [*((m, "failed") for m in self.modes[:-1]), (self.modes[-1], last)]
