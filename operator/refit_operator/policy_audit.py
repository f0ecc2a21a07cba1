"""spec.verify: prove that every ready rollout node holds exactly a dense load of the committed
checkpoint (`kuberefit verify` against each node), and say so.

`audit` returns the `Verified` condition's value and posts one Event; the loop decides when
(every `spec.verify.everyVersions` commits, or once on the `kuberefit.io/verify-now`
annotation). A node with a mismatch closed its gate and forgot its version: the next transition
restores it densely before it serves again. An audit never raises into the policy's loop.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import structlog

from refit_operator import metrics
from refit_operator.discovery import PodView
from refit_operator.kube.api import KubeApi, object_ref
from refit_operator.verify import EXIT_MISMATCH, EXIT_OK, exit_code, render, verify_nodes

log = structlog.get_logger("kuberefit.policy")


class Verified(NamedTuple):
    """The `Verified` condition: status, reason, message."""

    ok: bool
    reason: str
    message: str


NO_CHECKPOINT = Verified(
    False,
    "NoCheckpointTemplate",
    "an audit compares against the committed checkpoint: set spec.restore.checkpointTemplate",
)


async def audit(
    api: KubeApi,
    policy: Mapping[str, Any],
    pods: Sequence[PodView],
    checkpoint: str,
    version: int,
    *,
    token: str,
    timeout_s: float,
    labels: Mapping[str, str],
) -> Verified:
    """Audit `pods` against `checkpoint` (the committed `version`'s) once; `policy` is the
    object the Event is about, `labels` its metrics' namespace and policy."""
    t0 = time.monotonic()
    try:
        results = await verify_nodes(
            [p.url for p in pods], checkpoint, version, token=token, timeout_s=timeout_s
        )
    except Exception as exc:  # never let an audit stop the policy's transitions
        log.exception("policy.audit_failed", policy=labels["policy"], version=version)
        metrics.AUDITS.labels(**labels, result="incomplete").inc()
        return Verified(False, "Incomplete", f"v{version}: audit failed: {exc}")
    code, lines = exit_code(results), render(results)
    if code == EXIT_OK:
        outcome, verdict = (
            "verified",
            Verified(
                True,
                "Verified",
                f"v{version}: {len(results)} rollout node(s) hold exactly the bits of a dense "
                f"load of {checkpoint} ({time.monotonic() - t0:.1f}s)",
            ),
        )
        metrics.AUDITED_VERSION.labels(**labels).set(version)
    else:
        outcome = "mismatch" if code == EXIT_MISMATCH else "incomplete"
        problems = [line for line in lines if ": OK v" not in line]
        verdict = Verified(False, outcome.capitalize(), f"v{version}: " + "; ".join(problems)[:900])
    metrics.AUDITS.labels(**labels, result=outcome).inc()
    log.info("policy.audited", policy=labels["policy"], version=version, result=outcome)
    with contextlib.suppress(Exception):
        await api.post_event(
            object_ref(dict(policy)),
            "Verified" if verdict.ok else f"Audit{verdict.reason}",
            verdict.message,
            warning=not verdict.ok,
        )
    return verdict
