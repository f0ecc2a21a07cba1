"""How a producer keeps its source baseline (`SourceBaseline`) and chunks its export."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from refit_protocol.kit.config_files import ConfigPath
from refit_protocol.sizes import AUTO, SizeOrAuto


class BaselineConfig(BaseModel):
    """Where and how the source baseline is kept, and how the export is chunked."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    directory: ConfigPath | None = Field(
        default=None,
        description="Directory for the file-backed baseline (a private subdirectory is created "
        "in it); None uses the system temp directory.",
    )
    in_memory: bool = Field(default=False, description="Keep the baseline in RAM, not in files.")
    export_chunk_bytes: SizeOrAuto = Field(
        default=AUTO,
        description="Export chunk limit in bytes; `auto` sizes it from the checkpoint so each "
        "producer's share makes ~16 chunks, 4-256 MiB (refit_sidecar/baseline/sizing.py; "
        "256 MiB without staging.reference_checkpoint). Must come out the same on every "
        "producer because ownership depends on it.",
    )
    commit_workers: int = Field(
        default=2, ge=1, description="Threads writing new bits into the baseline (and undoing)."
    )
    early_update: bool = Field(
        default=True,
        description="Write each compared chunk's new bits into the baseline while its payloads "
        "travel, so the commit only waits for writes still running; a discard writes the old "
        "bits back from the XOR masks. False: write them all at commit (the paper's order; the "
        "commit then costs a pass over every changed element).",
    )
    reuse_delta_buffers: bool = Field(
        default=True,
        description="Keep a committed or discarded delta's buffers (about 12 bytes per changed "
        "BF16 element, plus 1/8 spare) and compare the next export into them, instead of "
        "fresh memory whose page faults cost about a sixth of the encode time.",
    )
