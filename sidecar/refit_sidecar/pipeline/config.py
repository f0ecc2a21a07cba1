"""Producer pipeline settings (defaults follow the paper's Appendix C "Pipeline settings")."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from refit_protocol.sizes import AUTO, SizeOrAuto
from refit_sidecar.codec.wire import CodecConfig


class PipelineConfig(BaseModel):
    """Sizes of the bounded stages; together they bound the producer's in-flight memory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    compare_workers: int = Field(default=2, ge=1, description="Threads comparing chunks.")
    bucket_bytes: SizeOrAuto = Field(
        default=AUTO,
        description="Bucket target: input bytes of the chunks (with records) coalesced into one "
        "payload. Only tensors above `split_bytes` are cut, so a bucket can exceed it. `auto`: "
        "one chunk (the export chunk limit in effect), so payloads keep the pipeline "
        "overlapped.",
    )
    split_bytes: SizeOrAuto = Field(
        default=AUTO,
        description="A changed tensor larger than this travels as several payloads: its "
        "changes are cut into near-equal flat element ranges of about this many bytes of the "
        "tensor, each coalesced with neighbouring chunks like a chunk (never with another part "
        "of its tensor), so a large first or last tensor (the embedding, the output head) does "
        "not delay the stream's start or drain. In vLLM each part runs the tensor's loader "
        "once (its XOR covers the part's rows only), so keep it near the bucket size. `auto`: "
        "the export chunk limit in "
        "effect (a tensor above it is a chunk of its own), or the bucket target when larger.",
    )
    max_chunks_in_flight: int = Field(
        default=4,
        ge=1,
        description="Export chunks taken in but not yet coalesced (being or waiting to be "
        "compared). The export is not read further while this many are held.",
    )
    payload_queue: int = Field(
        default=2,
        ge=1,
        description="Buckets waiting for compression, and payloads waiting to be sent.",
    )
    cancel_grace_s: float = Field(
        default=30.0,
        gt=0,
        description="After a failure, how long to wait for a blocked send or export read "
        "before giving up on it (the transport's stop_and_wait releases it).",
    )
    codec: CodecConfig = Field(default_factory=CodecConfig, description="Encoder settings.")
