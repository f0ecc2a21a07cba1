"""Exit with the trainer: what lets a Job's pod complete when its sidecar is a regular container.

Set by injection for trainer pods that end (`restartPolicy` Never or OnFailure) where the API
server has no native sidecars. The sidecar waits until its trainer has started and is gone
(`when_gone`: the lock released, however the process ended) or gone after closing its
publisher (`when_done`: under OnFailure a crashed trainer is restarted, so only a deliberate
end counts; `trainer.liveness`). Then it lets what the trainer published finish (no staged candidate
above the committed version, no attempt pending), for at most `grace_s`, and returns: the
process exits 0, and the pod's phase is the trainer's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import structlog

from refit_protocol.producer_api import ProducerStatus
from refit_sidecar.trainer.liveness import TrainerState, trainer_state

log = structlog.get_logger("kuberefit.producer")

ExitWithTrainer = Literal["no", "when_gone", "when_done"]


def pending(status: ProducerStatus) -> bool:
    """Something the trainer published is not committed yet."""
    staged = status.candidate_version
    return status.pending_attempt is not None or (
        staged is not None and staged > status.committed_version
    )


async def wait_for_trainer_exit(
    inbox: Path,
    mode: ExitWithTrainer,
    status: Callable[[], ProducerStatus],
    *,
    grace_s: float,
    poll_s: float = 1.0,
) -> str:
    """Return once the sidecar should exit (never for mode "no"); the reason, for the log."""
    if mode == "no":
        await asyncio.Event().wait()
    seen = False
    ends = {TrainerState.DONE} if mode == "when_done" else {TrainerState.GONE, TrainerState.DONE}
    while (state := await asyncio.to_thread(trainer_state, inbox)) not in ends:
        if state is TrainerState.RUNNING and not seen:
            log.info("producer.trainer_seen", inbox=str(inbox))
            seen = True
        await asyncio.sleep(poll_s)
    log.info("producer.trainer_exited", state=state.value, waiting_for_commit_s=grace_s)
    deadline = time.monotonic() + grace_s
    while pending(current := status()):
        if time.monotonic() >= deadline:
            log.warning(
                "producer.exit_with_pending",
                committed=current.committed_version,
                candidate=current.candidate_version,
                attempt=current.pending_attempt,
                grace_s=grace_s,
            )
            return "trainer exited; grace ended with a version pending"
        await asyncio.sleep(poll_s)
    return "trainer exited; nothing pending"
