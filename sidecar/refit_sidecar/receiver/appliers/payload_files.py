"""Where a decoded payload is staged for vLLM workers: one file per payload, named only by the
attempt, producer and payload id, so every host of a server stages it at the same path; and
its release once applied or dropped."""

from __future__ import annotations

import hashlib
from pathlib import Path

from refit_sidecar.codec.decoded_file import write_decoded
from refit_sidecar.codec.wire import DecodedPayload, PayloadHeader
from refit_sidecar.receiver.appliers.base import StagedPayload


def staged_path(shm_dir: Path, header: PayloadHeader) -> Path:
    """The payload's file under `shm_dir`: the same name on every host of a server."""
    tag = hashlib.blake2b(header.attempt.encode(), digest_size=8).hexdigest()
    return shm_dir / f"{tag}-{header.producer}-{header.payload_id}.krd"


def stage_file(shm_dir: Path, decoded: DecodedPayload) -> StagedPayload:
    """Write the decoded payload to its file (atomically) for the workers to read."""
    path = staged_path(shm_dir, decoded.header)
    return StagedPayload(decoded.header, write_decoded(decoded, path), path=path)


def discard_file(staged: StagedPayload) -> None:
    """Delete a staged payload's file (applied by every rank, or dropped)."""
    if staged.path is not None:
        staged.path.unlink(missing_ok=True)
        staged.path = None
