"""❶ ownership and compare: owned export chunks, their committed bits (the source baseline) and
the per-attempt pending delta."""

from refit_sidecar.baseline.chunk_writer import PendingTensor
from refit_sidecar.baseline.chunks import ExportChunk, chunk_export, owner_of, plan_chunks
from refit_sidecar.baseline.config import BaselineConfig
from refit_sidecar.baseline.errors import (
    BaselineError,
    BaselinePoisonedError,
    ExportMismatchError,
    PendingStateError,
)
from refit_sidecar.baseline.source import ChunkDelta, SourceBaseline

__all__ = [
    "BaselineConfig",
    "BaselineError",
    "BaselinePoisonedError",
    "ChunkDelta",
    "ExportChunk",
    "ExportMismatchError",
    "PendingStateError",
    "PendingTensor",
    "SourceBaseline",
    "chunk_export",
    "owner_of",
    "plan_chunks",
]
