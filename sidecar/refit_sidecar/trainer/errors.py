"""Typed errors of the trainer -> sidecar handoff, shared by both sides.

The sidecar answers a refused request with `{"error": message, "code": code}`; the publisher
turns the code back into the same class, so a trainer can tell "the sidecar is down" from "my
export does not match the baseline" from "this is not the next version" without parsing text.
"""

from __future__ import annotations

from typing import ClassVar


class StagingError(RuntimeError):
    """Base class: staging or publishing a version failed; nothing was committed."""

    code: ClassVar[str] = "staging_error"
    http_status: ClassVar[int] = 409


class SidecarUnreachableError(StagingError):
    """The trainer sidecar's producer endpoint did not answer (not running, wrong URL/port)."""

    code = "sidecar_unreachable"
    http_status = 503


class VersionMismatchError(StagingError):
    """The version is not the one the sidecar expects (next after the committed one, or the
    committed one itself for the first export)."""

    code = "version_mismatch"


class CandidateMismatchError(StagingError):
    """The export's names, shapes, dtypes, order or chunking differ from the baseline's."""

    code = "export_mismatch"
    http_status = 422


class FingerprintMismatchError(StagingError):
    """The first export's bits differ from the weights the other side holds (resume rule)."""

    code = "fingerprint_mismatch"


class StagingStateError(StagingError):
    """The request does not fit the sidecar's state (not configured, already staged, ...)."""

    code = "staging_state"


class ChunkFileError(StagingError):
    """A chunk file is unsafe (name, symlink) or not a well-formed safetensors file."""

    code = "bad_chunk_file"
    http_status = 400


class TransitionTimeoutError(StagingError):
    """The staged version was not committed in time (the coordinator did not finish)."""

    code = "transition_timeout"
    http_status = 504


class CandidateDroppedError(StagingError):
    """The sidecar no longer holds the staged candidate and did not commit it (restarted?)."""

    code = "candidate_dropped"


ERROR_CLASSES: dict[str, type[StagingError]] = {
    cls.code: cls
    for cls in (
        StagingError,
        SidecarUnreachableError,
        VersionMismatchError,
        CandidateMismatchError,
        FingerprintMismatchError,
        StagingStateError,
        ChunkFileError,
        TransitionTimeoutError,
        CandidateDroppedError,
    )
}


def error_for(code: str | None, message: str) -> StagingError:
    """The typed error for a code the sidecar sent (the base class for unknown codes)."""
    return ERROR_CLASSES.get(code or "", StagingError)(message)
