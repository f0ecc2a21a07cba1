"""The payloads a producer really builds, from the checkpoint's tensor sizes in export order.

The producer groups the export into chunks (`refit_sidecar.baseline.chunks`: a tensor larger
than the limit is a chunk of its own), producer `p` owns chunks `i % W == p` (❶), a changed
tensor above the split size travels in parts (`refit_sidecar.pipeline.parts`), and its
`Bucketer` coalesces its chunks and parts in order into payloads of about the bucket size.
The planner projects with these regions (bytes of H per payload, in send order) instead of
H / bucket whenever it knows the tensor layout: a bench run's, or a Hugging Face config's
(`sizing.from_hf_config`). Every chunk is taken to carry changes (true at the change rates
the planner is for: a chunk holds thousands of elements).
"""

from __future__ import annotations

from collections.abc import Sequence


def bucket_regions(
    chunk_bytes: Sequence[int], bucket_bytes: int, tensors: Sequence[object | None] = ()
) -> tuple[int, ...]:
    """Bytes of H of each payload when chunks (or parts) of these sizes are coalesced in order
    as the producer's `Bucketer` closes them: a bucket closes before a unit that would take it
    past `bucket_bytes`, as soon as it reaches it, and before a second part of one tensor
    (`tensors`: each unit's tensor when it is a part, else None; empty: no parts)."""
    regions: list[int] = []
    current = 0
    held: set[object] = set()
    for i, nbytes in enumerate(chunk_bytes):
        tensor = tensors[i] if tensors else None
        if current and (current + nbytes > bucket_bytes or tensor in held):
            regions.append(current)
            current = 0
            held = set()
        current += nbytes
        if tensor is not None:
            held.add(tensor)
        if current >= bucket_bytes:
            regions.append(current)
            current = 0
            held = set()
    if current:
        regions.append(current)
    return tuple(regions)


def producer_regions(
    tensor_bytes: Sequence[int],
    producers: int,
    chunk_bytes: int,
    bucket_bytes: int,
    split_bytes: int | None = None,
) -> list[tuple[int, ...]]:
    """Each producer's payload regions, for tensors of these sizes in export order;
    `split_bytes` None: tensors travel whole (the producer before tensors were split)."""
    from refit_sidecar.baseline.chunks import chunk_bounds
    from refit_sidecar.pipeline.parts import units

    # Each unit with the export position of its tensor when it is a part.
    chunks = [
        [(n, None if i is None else a + i) for n, i in units(tensor_bytes[a:b], split_bytes)]
        for a, b in chunk_bounds(tensor_bytes, chunk_bytes)
    ]
    regions = []
    for p in range(producers):
        owned = [u for chunk in chunks[p::producers] for u in chunk]
        regions.append(bucket_regions([n for n, _ in owned], bucket_bytes, [t for _, t in owned]))
    return regions


def payload_regions(
    tensor_bytes: Sequence[int],
    producers: int,
    chunk_bytes: int,
    bucket_bytes: int,
    split_bytes: int | None = None,
) -> tuple[int, ...]:
    """The payload regions of the producer with the most bytes of H (the one the attempt
    waits for)."""
    regions = producer_regions(tensor_bytes, producers, chunk_bytes, bucket_bytes, split_bytes)
    return max(regions, key=sum)
