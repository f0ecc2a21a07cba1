"""Whether the trainer process still runs, told through the inbox both containers mount.

A trainer sidecar is a regular container where the API server has no native sidecars (before
Kubernetes 1.29), so a Job's pod would never complete while it runs. The trainer's publisher
holds a shared `flock` on `TRAINER_ALIVE_FILE` for its process's life (`TrainerPresence`): the
kernel releases it however the process ends, a crash or OOM kill included, with no cooperation
from the trainer's code. It writes `TRAINER_DONE_FILE` when closed, for pods whose failed
trainer is restarted (`restartPolicy: OnFailure`), where a lock released by a crash must not end
the sidecar. The sidecar probes the lock (`trainer_state`) without ever holding it for longer
than the probe, so a trainer starting meanwhile waits microseconds at most.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from enum import Enum
from pathlib import Path

import structlog

from refit_protocol.pod_contract import TRAINER_ALIVE_FILE, TRAINER_DONE_FILE

log = structlog.get_logger("kuberefit.trainer")


class TrainerState(Enum):
    ABSENT = "absent"  # no trainer has started (no lock file yet)
    RUNNING = "running"  # a trainer process holds the lock
    GONE = "gone"  # one started, and none holds the lock now
    DONE = "done"  # ...and one closed its publisher


class TrainerPresence:
    """Held by the trainer process: the shared lock that says it runs, and the done marker."""

    def __init__(self, inbox: Path) -> None:
        self.inbox = inbox
        self._fd: int | None = None
        self._warned = self._closed = False

    def announce(self, *, warn: bool = True) -> None:
        """Hold the lock, taking it if not held yet (and clearing a done marker of an earlier
        run). Called again before each call to the sidecar: the inbox may appear only once the
        sidecar runs. Best effort: a trainer never fails because its pod does not support it
        (one warning says what is lost).

        The lock file appears already locked (made aside, locked, then linked into place), so
        a probe never mistakes a trainer that is starting for one that is gone."""
        if self._fd is not None or self._closed:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                (self.inbox / TRAINER_DONE_FILE).unlink()
            self._fd = _lock_shared(self.inbox)
        except OSError as exc:
            if warn and not self._warned:
                self._warned = True
                log.warning(
                    "trainer.presence_unavailable",
                    inbox=str(self.inbox),
                    error=str(exc),
                    effect="a trainer sidecar set to exit with its trainer will not see this one",
                )

    def done(self) -> None:
        """The trainer finished on purpose: write the done marker, then release the lock."""
        self._closed = True
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            (self.inbox / TRAINER_DONE_FILE).write_bytes(b"")
        os.close(self._fd)  # releases the lock
        self._fd = None


def _open_locked(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _lock_shared(inbox: Path) -> int:
    """A descriptor holding a shared lock on the inbox's lock file (several ranks may hold it)."""
    alive = inbox / TRAINER_ALIVE_FILE
    try:
        return _open_locked(alive)
    except FileNotFoundError:
        pass
    aside = inbox / f".{TRAINER_ALIVE_FILE}.{os.getpid()}"
    # Readable by the sidecar, which may run as another user (it only reads to probe).
    fd = os.open(aside, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.link(aside, alive)
    except FileExistsError:  # another rank was first: share its lock
        os.close(fd)
        return _open_locked(alive)
    except OSError:
        os.close(fd)
        raise
    finally:
        aside.unlink(missing_ok=True)
    return fd


def trainer_state(inbox: Path) -> TrainerState:
    """Probe whether a trainer holds the lock (never keeping it longer than the probe)."""
    try:
        fd = os.open(inbox / TRAINER_ALIVE_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return TrainerState.ABSENT
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return TrainerState.RUNNING
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    return TrainerState.DONE if (inbox / TRAINER_DONE_FILE).exists() else TrainerState.GONE
