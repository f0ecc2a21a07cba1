"""A RefitPolicy's status, computed from what the operator observed (pure functions).

Conditions follow Kubernetes conventions: `Ready` (is refit working?), `Progressing` (is a
transition running?), `Degraded` (does something need attention?), each with a CamelCase
reason and a message; `lastTransitionTime` changes only when a condition's status changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from refit_operator.kube.api import now_iso


@dataclass(frozen=True)
class Observed:
    """What one reconcile pass saw."""

    generation: int
    spec_error: str = ""
    token_error: tuple[str, str] | None = None  # (reason, message)
    paused: bool = False
    committed_version: int | None = None
    aborted_by: str | None = None
    producers_expected: int = 1
    trainers: int = 0
    trainers_ready: int = 0
    rollouts: int = 0
    rollouts_ready: int = 0
    #: vLLM servers among the rollout pods (a server may span several pods) and those with
    #: every pod running; equal to the pod counts when every server is one pod.
    servers: int = 0
    servers_ready: int = 0
    current: str = ""
    current_summary: str = ""
    last: str = ""
    last_outcome: str = ""
    last_message: str = ""
    error: str = ""  # the operator's own last failure (e.g. the API server unreachable)
    producers_error: str = ""  # why the running trainer pods cannot be used as producers
    producers_reason: str = "ProducersNotReady"  # the Ready condition's reason for it
    coordinator: str = ""
    not_injected: tuple[str, ...] = ()  # opted-in pods admitted without the sidecar
    #: "pod: setting ..." for pods holding settings fixed at creation other than the spec's.
    restart_required: tuple[str, ...] = ()
    verify_every: int = 0  # spec.verify.everyVersions
    verified: tuple[bool, str, str] | None = None  # the last audit: (ok, reason, message)


def _ready(o: Observed) -> tuple[bool, str, str]:
    if o.spec_error:
        return False, "InvalidSpec", o.spec_error
    if o.token_error:
        return False, *o.token_error
    if o.aborted_by:
        return (
            False,
            "Aborted",
            f"aborted by {o.aborted_by}; the request gate stays closed until the abort is "
            "cleared (kubectl annotate refitpolicy <name> kuberefit.io/clear-abort=now)",
        )
    if o.paused:
        return False, "Paused", "spec.paused is true: no new transition starts"
    if o.trainers_ready < o.producers_expected:
        return (
            False,
            "WaitingForTrainers",
            f"{o.trainers_ready} of {o.producers_expected} trainer pods running "
            f"({o.trainers} annotated)",
        )
    if o.producers_error:
        return False, o.producers_reason, o.producers_error
    if o.rollouts_ready == 0:
        return False, "WaitingForRollouts", f"no rollout pod running ({o.rollouts} annotated)"
    return (
        True,
        "Ready",
        (
            f"{o.trainers_ready} trainer and {o.rollouts_ready} rollout pods; "
            f"v{o.committed_version} committed"
        ),
    )


def conditions(o: Observed) -> list[dict[str, Any]]:
    ready, reason, message = _ready(o)
    out = [_cond("Ready", ready, reason, message, o.generation)]
    if o.current:
        out.append(
            _cond(
                "Progressing", True, "Transitioning", o.current_summary or o.current, o.generation
            )
        )
    else:
        idle = reason if not ready else "Idle"
        out.append(_cond("Progressing", False, idle, "no transition running", o.generation))
    out.append(_injected(o))
    out.append(_settings(o))
    if o.verify_every or o.verified is not None:
        every = max(o.verify_every, 1)
        first = every * (1 + (o.committed_version or 0) // every)
        ok, why, text = o.verified or (
            False,
            "NotVerifiedYet",
            f"no audit yet: the first runs when v{first} is committed",
        )
        out.append(_cond("Verified", ok, why, text, o.generation))
    degraded: tuple[str, str] | None = None
    if o.aborted_by:
        degraded = ("Aborted", f"aborted by {o.aborted_by}")
    elif o.spec_error:
        degraded = ("InvalidSpec", o.spec_error)
    elif o.error:
        degraded = ("OperatorError", o.error)
    elif o.last_outcome and o.last_outcome != "committed":
        degraded = (f"Last{o.last_outcome.capitalize()}", f"{o.last}: {o.last_message}")
    elif o.not_injected:
        degraded = ("PodsNotInjected", _injected(o)["message"])
    elif o.restart_required:
        degraded = ("RestartRequired", _settings(o)["message"])
    elif o.verified is not None and not o.verified[0] and o.verified[1] == "Mismatch":
        degraded = ("AuditMismatch", o.verified[2])
    elif o.rollouts_ready < o.rollouts or o.trainers_ready < o.trainers:
        degraded = (
            "PodsNotRunning",
            f"{o.trainers - o.trainers_ready} trainer and {o.rollouts - o.rollouts_ready} "
            "rollout pods annotated but not running",
        )
    if degraded:
        out.append(_cond("Degraded", True, degraded[0], degraded[1], o.generation))
    else:
        out.append(_cond("Degraded", False, "AsExpected", "nothing needs attention", o.generation))
    return out


def _injected(o: Observed) -> dict[str, Any]:
    """`SidecarsInjected`: every selected opted-in pod got its sidecar at admission."""
    if not o.not_injected:
        return _cond(
            "SidecarsInjected",
            True,
            "AllInjected",
            "every opted-in pod has its sidecar",
            o.generation,
        )
    shown = ", ".join(o.not_injected[:5]) + (" ..." if len(o.not_injected) > 5 else "")
    return _cond(
        "SidecarsInjected",
        False,
        "PodsNotInjected",
        f"{len(o.not_injected)} opted-in pod(s) were admitted without the sidecar (the webhook "
        f"did not inject them): {shown}; recreate them",
        o.generation,
    )


def _settings(o: Observed) -> dict[str, Any]:
    """`SettingsApplied`: every pod runs with its policy's settings (pod_settings)."""
    if not o.restart_required:
        return _cond(
            "SettingsApplied",
            True,
            "AllApplied",
            "every pod runs with the policy's settings",
            o.generation,
        )
    shown = "; ".join(o.restart_required[:3]) + (" ..." if len(o.restart_required) > 3 else "")
    return _cond(
        "SettingsApplied",
        False,
        "RestartRequired",
        f"{len(o.restart_required)} pod(s) hold settings fixed when they were created, other "
        f"than the policy's ({shown}); delete them to apply the policy's",
        o.generation,
    )


def _cond(kind: str, status: bool, reason: str, message: str, generation: int) -> dict[str, Any]:
    return {
        "type": kind,
        "status": "True" if status else "False",
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


def policy_status(o: Observed, previous: Mapping[str, Any] | None) -> dict[str, Any]:
    """The status to write; conditions keep their lastTransitionTime while unchanged."""
    before = {c.get("type"): c for c in (previous or {}).get("conditions") or []}
    conds = []
    for c in conditions(o):
        old = before.get(c["type"])
        same = old is not None and old.get("status") == c["status"]
        c["lastTransitionTime"] = old.get("lastTransitionTime") if same and old else now_iso()
        conds.append(c)
    ready = conds[0]["status"] == "True"
    phase = "Ready" if ready else conds[0]["reason"]
    if o.current:
        phase = "Transitioning"
    return {
        "observedGeneration": o.generation,
        "phase": phase,
        "committedVersion": o.committed_version,
        "aborted": o.aborted_by,
        "trainers": f"{o.trainers_ready}/{o.producers_expected}",
        "rollouts": _rollouts(o),
        "producers": {"discovered": o.trainers, "ready": o.trainers_ready},
        "receivers": {"discovered": o.rollouts, "ready": o.rollouts_ready},
        "currentTransition": o.current or None,
        "lastTransition": o.last or None,
        "coordinator": o.coordinator or None,
        "conditions": conds,
    }


def _rollouts(o: Observed) -> str:
    """The ROLLOUTS column: pods, or servers then pods where a server spans several pods."""
    pods = f"{o.rollouts_ready}/{o.rollouts}"
    if o.servers in (0, o.rollouts):
        return pods
    return f"{o.servers_ready}/{o.servers} servers ({pods} pods)"


def same_status(a: Mapping[str, Any] | None, b: Mapping[str, Any]) -> bool:
    """True when writing `b` over `a` would change nothing a user sees."""
    if a is None:
        return False
    keys: Sequence[str] = [k for k in b if k != "conditions"]
    if any(a.get(k) != b[k] for k in keys):
        return False
    return _timeless(a.get("conditions")) == _timeless(b.get("conditions"))


def _timeless(conds: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    return [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in conds or []]
