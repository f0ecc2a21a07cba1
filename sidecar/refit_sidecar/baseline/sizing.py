"""Export chunk and bucket sizes that keep the refit pipeline overlapped at any checkpoint size.

A producer streams its share S = H / P of the checkpoint through compare -> compress -> send,
and every receiver decodes and applies payloads as they arrive. The stages overlap only when
the share is cut into many units: with one or two per attempt, the first send waits for a whole
chunk's compare and the last apply starts only after the last whole transfer, so compare,
transport and apply run one after the other (docs/performance.md measured 19x instead of 39x at
H = 594 MiB with fixed 256/512 MiB sizes: two payloads per attempt).

Rule (`"auto"`, the default of `export_chunk_bytes` and `bucket_bytes`): the chunk is the
largest power of two not above S / TARGET_UNITS, kept within [MIN_CHUNK_BYTES,
MAX_CHUNK_BYTES]; a bucket is one chunk; a changed tensor above the chunk limit (or the
bucket, when larger) travels in parts of about that size (`pipeline.parts`). Small
checkpoints get ~16-32 units per producer; large ones keep 256 MiB chunks (hundreds of
units), the size ZeroMQ frames and the memory bound were set for. Smaller units also lower
the producer's in-flight memory (max_chunks_in_flight x chunk). Every producer computes the
same chunk from the same H and P: chunk ownership depends on it, so it is derived from the
reference checkpoint every producer reads (or falls back to MAX_CHUNK_BYTES, the same
everywhere, when none is configured).
"""

from __future__ import annotations

from dataclasses import dataclass

from refit_protocol.sizes import Auto

#: Units (chunks) each producer's share is cut into at least, where the size bounds allow.
TARGET_UNITS = 16
MIN_CHUNK_BYTES = 4 << 20
MAX_CHUNK_BYTES = 256 << 20


@dataclass(frozen=True)
class Sizes:
    """Resolved sizes and how they were chosen (logged at start-up)."""

    chunk_bytes: int
    bucket_bytes: int
    rule: str
    #: A changed tensor above this travels in parts (`refit_sidecar.pipeline.parts`); None in
    #: sizes recorded before tensors were split.
    split_bytes: int | None = None


def auto_split_bytes(chunk_bytes: int, bucket_bytes: int) -> int:
    """The split size for `auto`: the chunk limit, which only a tensor of its own passes, or
    the bucket target when larger, so that a part fills a bucket (and two parts of one tensor
    never share one)."""
    return max(chunk_bytes, bucket_bytes)


def auto_chunk_bytes(total_bytes: int, producers: int) -> int:
    """The chunk limit for a checkpoint of `total_bytes` split over `producers` (the rule in
    the module docstring)."""
    if total_bytes < 1 or producers < 1:
        raise ValueError(f"a checkpoint of {total_bytes} bytes over {producers} producers")
    per_unit = total_bytes // (producers * TARGET_UNITS)
    chunk = 1 << max(per_unit.bit_length() - 1, 0)  # largest power of two <= per_unit
    return min(max(chunk, MIN_CHUNK_BYTES), MAX_CHUNK_BYTES)


def resolve_sizes(
    chunk: int | Auto,
    bucket: int | Auto,
    *,
    total_bytes: int | None,
    producers: int,
    split: int | Auto = "auto",
) -> Sizes:
    """Concrete sizes for the configured ones; `total_bytes` None: the checkpoint's size is not
    known (no reference checkpoint), so an automatic chunk is MAX_CHUNK_BYTES."""
    if isinstance(chunk, int):
        rule = "export_chunk_bytes as configured"
        chunk_bytes = chunk
    elif total_bytes is None:
        chunk_bytes = MAX_CHUNK_BYTES
        rule = (
            f"auto without a checkpoint size (no staging.reference_checkpoint): "
            f"{MAX_CHUNK_BYTES >> 20} MiB chunks"
        )
    else:
        chunk_bytes = auto_chunk_bytes(total_bytes, producers)
        units = -(-total_bytes // (producers * chunk_bytes))
        rule = (
            f"auto: H = {total_bytes} bytes over {producers} producer(s), about {units} chunk(s) "
            f"each (target {TARGET_UNITS}, chunk within {MIN_CHUNK_BYTES >> 20}-"
            f"{MAX_CHUNK_BYTES >> 20} MiB)"
        )
    if isinstance(bucket, int):
        bucket_bytes = bucket
    else:
        bucket_bytes = chunk_bytes
        rule += "; a bucket is one chunk"
    if isinstance(split, int):
        return Sizes(chunk_bytes, bucket_bytes, rule + "; split_bytes as configured", split)
    split_bytes = auto_split_bytes(chunk_bytes, bucket_bytes)
    return Sizes(chunk_bytes, bucket_bytes, rule + "; larger tensors go in parts", split_bytes)
