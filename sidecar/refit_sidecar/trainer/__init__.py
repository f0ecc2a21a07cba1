"""❷ projection / conversion, trainer side: canonical sources of HF-named tensors and the
publisher that hands each version to the local trainer sidecar (docs/trainer.md). The handoff's
file format (`chunk_files`), manifest and typed errors live here too; the sidecar's side of it
is `refit_sidecar.producer`.

Importable without Megatron: `MegatronBridgeSource` only calls the bridge object it is given.
"""

from refit_sidecar.trainer.errors import (
    CandidateDroppedError,
    CandidateMismatchError,
    ChunkFileError,
    FingerprintMismatchError,
    SidecarUnreachableError,
    StagingError,
    StagingStateError,
    TransitionTimeoutError,
    VersionMismatchError,
)
from refit_sidecar.trainer.export import (
    CanonicalSource,
    Change,
    ExportEntry,
    PlannedChunk,
    PlanningSource,
    StageIntent,
    plan_owned,
)
from refit_sidecar.trainer.megatron import MegatronBridgeSource
from refit_sidecar.trainer.publisher import Publisher, PublisherConfig, PublishResult
from refit_sidecar.trainer.state_dict import StateDictSource

__all__ = [
    "CandidateDroppedError",
    "CandidateMismatchError",
    "CanonicalSource",
    "Change",
    "ChunkFileError",
    "ExportEntry",
    "FingerprintMismatchError",
    "MegatronBridgeSource",
    "PlannedChunk",
    "PlanningSource",
    "PublishResult",
    "Publisher",
    "PublisherConfig",
    "SidecarUnreachableError",
    "StageIntent",
    "StagingError",
    "StagingStateError",
    "StateDictSource",
    "TransitionTimeoutError",
    "VersionMismatchError",
    "plan_owned",
]
