"""What a trainer sidecar needs on disk to take the trainer's exports, checked at start-up and by
`/readyz`: the inbox the trainer writes chunk files to (`staging.inbox`) and, when configured,
the checkpoint the rollout engines started from (`staging.reference_checkpoint`).

At start-up a missing reference checkpoint refuses the start (one line naming the setting);
the inbox does not, since the sidecar itself creates it on the shared-memory volume and the
trainer may mount it later: `/readyz` reports it instead, until it is a writable directory. The
baseline is not a readiness condition: the trainer builds it with its first export, which it
sends to this sidecar only once it answers (a sidecar unready until then could hold back a
whole StatefulSet of trainers that start together).
"""

from __future__ import annotations

import os
from pathlib import Path

from refit_sidecar.producer.staging import StagingConfig

Check = tuple[str, bool, str]


def inbox_check(inbox: Path) -> Check:
    if not inbox.exists():
        return (
            "inbox",
            False,
            f"staging.inbox {inbox} is missing: mount the shared-memory volume the trainer "
            "writes its chunk files to (the publisher's inbox)",
        )
    if not inbox.is_dir():
        return ("inbox", False, f"staging.inbox {inbox} is not a directory")
    if not os.access(inbox, os.W_OK | os.X_OK):
        return ("inbox", False, f"staging.inbox {inbox} is not writable by this process")
    return ("inbox", True, f"staging.inbox {inbox} is a writable directory")


def reference_problem(reference: Path) -> str | None:
    """Why `reference` is not a safetensors checkpoint directory (None: it is one)."""
    setting = f"staging.reference_checkpoint {reference}"
    if not reference.exists():
        return f"{setting} is missing (the checkpoint the rollout engines started from)"
    if not reference.is_dir():
        return f"{setting} is not a directory"
    index = reference / "model.safetensors.index.json"
    if not index.is_file() and not any(reference.glob("*.safetensors")):
        return f"{setting} holds no *.safetensors files"
    return None


def reference_check(reference: Path | None) -> Check:
    if reference is None:
        return (
            "reference_checkpoint",
            True,
            "not configured: the first export is not compared with the rollout's checkpoint",
        )
    problem = reference_problem(reference)
    if problem is not None:
        return ("reference_checkpoint", False, problem)
    return ("reference_checkpoint", True, f"staging.reference_checkpoint {reference} present")


def staging_checks(config: StagingConfig | None) -> list[Check]:
    """The `/readyz` checks of a sidecar with this staging (None: candidates are staged in
    process, as the refit bench does)."""
    if config is None:
        return [("staging", True, "no inbox configured: candidates are staged in process")]
    return [inbox_check(config.inbox), reference_check(config.reference_checkpoint)]


def startup_problem(config: StagingConfig) -> str | None:
    """What refuses a start: a configured reference checkpoint that is not there."""
    if config.reference_checkpoint is None:
        return None
    return reference_problem(config.reference_checkpoint)
