"""What kubectl shows, computed without a cluster: RefitPolicy conditions and RefitTransition
status (the e2e checks the same fields on a real API server)."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

from refit_operator.policy_status import Observed, policy_status, same_status
from refit_operator.ports import TransitionProgress
from refit_operator.transition_types import TransitionResult
from refit_operator.transitions import (
    failure_reason,
    human_bytes,
    latency_status,
    outcome_status,
    progress_status,
    stamp,
    to_prune,
    transition_name,
)

HEALTHY = Observed(
    generation=3,
    committed_version=7,
    trainers=1,
    trainers_ready=1,
    rollouts=2,
    rollouts_ready=2,
    coordinator="op-a",
)


def _conds(o: Observed) -> dict[str, dict[str, object]]:
    return {c["type"]: c for c in policy_status(o, None)["conditions"]}


def test_healthy_policy() -> None:
    status = policy_status(HEALTHY, None)
    assert status["trainers"] == "1/1"
    assert status["rollouts"] == "2/2"
    assert status["observedGeneration"] == 3
    conds = _conds(HEALTHY)
    assert conds["Ready"]["status"] == "True"
    assert conds["Degraded"]["reason"] == "AsExpected"
    assert conds["Progressing"]["status"] == "False"


def test_verified_condition_only_when_asked_for_and_mismatch_degrades() -> None:
    assert "Verified" not in _conds(HEALTHY)
    waiting = _conds(replace(HEALTHY, verify_every=5))["Verified"]
    assert (waiting["status"], waiting["reason"]) == ("False", "NotVerifiedYet")
    assert "v10" in str(waiting["message"])  # v7 committed: the next multiple of 5
    ok = _conds(replace(HEALTHY, verify_every=5, verified=(True, "Verified", "v5: 2 nodes")))
    assert (ok["Verified"]["status"], ok["Degraded"]["status"]) == ("True", "False")
    bad = (False, "Mismatch", "v5: n1: MISMATCH v5 ...")
    conds = _conds(replace(HEALTHY, verify_every=5, verified=bad))
    assert (conds["Verified"]["status"], conds["Verified"]["reason"]) == ("False", "Mismatch")
    assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", "AuditMismatch")


def test_pods_holding_other_settings_than_the_policy_are_listed() -> None:
    assert _conds(HEALTHY)["SettingsApplied"]["status"] == "True"
    held = ("t0: spec.chunkBytes is 67108864; its baseline is laid out in auto-byte chunks",)
    conds = _conds(replace(HEALTHY, restart_required=held))
    applied = conds["SettingsApplied"]
    assert (applied["status"], applied["reason"]) == ("False", "RestartRequired")
    assert held[0] in str(applied["message"])
    assert "delete them" in str(applied["message"])
    assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", "RestartRequired")
    assert conds["Ready"]["status"] == "True"  # refits go on with the pods' values


def test_reasons_in_priority_order() -> None:
    cases = [
        (Observed(1, spec_error="spec.mode: bad"), "InvalidSpec"),
        (Observed(1, token_error=("TokenSecretMissing", "no Secret")), "TokenSecretMissing"),
        (
            Observed(1, trainers_ready=1, rollouts_ready=1, producers_error="pod t0: timeout"),
            "ProducersNotReady",
        ),
        (Observed(1, aborted_by="op-a: stuck", trainers_ready=1, rollouts_ready=1), "Aborted"),
        (Observed(1, paused=True, trainers_ready=1, rollouts_ready=1), "Paused"),
        (Observed(1, producers_expected=2, trainers=2, trainers_ready=1), "WaitingForTrainers"),
        (Observed(1, trainers_ready=1, rollouts=1), "WaitingForRollouts"),
    ]
    for observed, reason in cases:
        ready = _conds(observed)["Ready"]
        assert (ready["status"], ready["reason"]) == ("False", reason), observed
    aborted = _conds(next(o for o, r in cases if r == "Aborted"))
    assert aborted["Degraded"]["reason"] == "Aborted"
    assert "kuberefit.io/clear-abort" in str(aborted["Ready"]["message"])


def test_degraded_after_a_failed_transition_and_transition_time_kept() -> None:
    failed = Observed(**{**HEALTHY.__dict__, "last": "p-v000008", "last_outcome": "rejected"})
    assert _conds(failed)["Degraded"]["reason"] == "LastRejected"
    first = policy_status(HEALTHY, None)
    again = policy_status(HEALTHY, first)
    assert same_status(first, again)
    assert [c["lastTransitionTime"] for c in again["conditions"]] == [
        c["lastTransitionTime"] for c in first["conditions"]
    ]
    running = Observed(**{**HEALTHY.__dict__, "current": "p-v000008"})
    assert not same_status(first, policy_status(running, first))
    assert policy_status(running, first)["phase"] == "Transitioning"


def test_transition_status_columns() -> None:
    p = TransitionProgress("p", 4, 5, phase="Committed", attempt=2, mode="overwrite")
    p.wire_bytes, p.payloads = 3 * 1024 * 1024 + 512 * 1024, 2
    p.changed_elements, p.total_elements = 1234, 100_000
    p.timings = {"latency_s": 2.345}
    status = progress_status(p)
    assert status["wireBytesHuman"] == "3.5 MiB"
    assert status["changedPercent"] == "1.23%"
    assert status["lastAttemptLatency"] == "2.35s"
    assert "latency" not in status  # LATENCY is written once, when the transition finishes
    assert status["mode"] == "overwrite"
    assert human_bytes(900) == "900 B"
    assert transition_name("p", 5) == "p-v000005"
    assert transition_name("p", 5, retry=1) == "p-v000005-2"
    assert sorted([transition_name("p", 10), transition_name("p", 9)])[0] == "p-v000009"


def test_every_failure_has_a_reason() -> None:
    for outcome, given, reason in [
        ("rejected", "", "PrepareRejected"),
        ("conflict", "", "CoordinatorConflict"),
        ("aborted", "ReceiverUnresponsive", "ReceiverUnresponsive"),
        ("aborted", "", "Aborted"),
        ("failed", "OperatorError", "OperatorError"),
    ]:
        result = TransitionResult(outcome, 3, 1, ["mixed"], message="why", reason=given)  # type: ignore[arg-type]
        assert failure_reason(result) == reason
        status = outcome_status(result)
        assert status["reason"] == reason
        assert status["message"] == "why"
    done = outcome_status(TransitionResult("committed", 4, 2, ["mixed", "overwrite"]))
    assert "reason" not in done
    assert done["modes"] == ["mixed", "overwrite"]
    recovered = outcome_status(TransitionResult("committed", 4, 0))
    assert "attempt" not in recovered  # finished by recover(): the attempts are already recorded


def test_latency_spans_from_the_first_attempt_to_completion() -> None:
    """LATENCY is startTime to completionTime, whoever finished the transition."""
    started = stamp(dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=22.5))
    done = outcome_status(TransitionResult("committed", 4, 0), started)  # a recovered one
    assert 22.4 < done["latencySeconds"] < 30
    assert done["latency"].endswith("s")
    assert latency_status("2026-12-05T04:00:00Z", "2026-12-05T04:01:30.250Z") == {
        "latencySeconds": 90.25,
        "latency": "1.5m",
    }
    assert stamp(dt.datetime(2026, 12, 5, 4, 0, 1, 250000, dt.timezone.utc)) == (
        "2026-12-05T04:00:01.250Z"
    )
    assert "latency" not in outcome_status(TransitionResult("committed", 4, 1))  # no start known


def test_pruning_keeps_the_newest_finished() -> None:
    def t(name: str, to: int, phase: str) -> dict[str, object]:
        return {
            "metadata": {"name": name},
            "spec": {"policy": "p", "toVersion": to},
            "status": {"phase": phase},
        }

    items = [
        t("p-v000001", 1, "Committed"),
        t("p-v000002", 2, "Aborted"),
        t("p-v000002-2", 2, "Committed"),
        t("p-v000003", 3, "Streaming"),
        {
            "metadata": {"name": "q-v000001"},
            "spec": {"policy": "q", "toVersion": 1},
            "status": {"phase": "Committed"},
        },
    ]
    assert to_prune(items, "p", keep=2) == ["p-v000001"]  # type: ignore[arg-type]
    assert to_prune(items, "p", keep=5) == []  # type: ignore[arg-type]
