"""Export chunks and their ownership: which producer snapshots, compares and sends which tensors.

Chunks group whole tensors in canonical export order until the next tensor would push the chunk
past the byte limit (a tensor larger than the limit forms its own chunk). Chunk `i` belongs to
producer `i % producers`. Both rules only depend on the export order, the shapes, the limit and
the producer count, so every producer computes the same plan without a manifest, and the plan
is complete and disjoint by construction.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from refit_sidecar.codec.records import TensorMeta


@dataclass(frozen=True)
class ExportChunk:
    """One bounded piece of the canonical export: whole (name, tensor) pairs, in export order."""

    index: int
    tensors: tuple[tuple[str, torch.Tensor], ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)

    def metas(self) -> tuple[TensorMeta, ...]:
        return tuple(TensorMeta.of(name, t) for name, t in self.tensors)


def owner_of(chunk_index: int, producers: int) -> int:
    """The producer that owns chunk `chunk_index`."""
    if producers < 1 or chunk_index < 0:
        raise ValueError("need producers >= 1 and chunk_index >= 0")
    return chunk_index % producers


def _starts_new_chunk(current_bytes: int, current_len: int, nbytes: int, limit: int) -> bool:
    return current_len > 0 and current_bytes + nbytes > limit


def chunk_export(
    named: Iterable[tuple[str, torch.Tensor]], limit_bytes: int
) -> Iterator[ExportChunk]:
    """Group an export stream into chunks lazily (tensors are never split)."""
    if limit_bytes < 1:
        raise ValueError("limit_bytes must be positive")
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    index = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if _starts_new_chunk(size, len(current), nbytes, limit_bytes):
            yield ExportChunk(index, tuple(current))
            index += 1
            current, size = [], 0
        current.append((name, t))
        size += nbytes
    if current:
        yield ExportChunk(index, tuple(current))


def plan_chunks(metas: Sequence[TensorMeta], limit_bytes: int) -> list[tuple[TensorMeta, ...]]:
    """The chunking `chunk_export` produces, computed from metadata alone."""
    bounds = chunk_bounds([m.nbytes for m in metas], limit_bytes)
    return [tuple(metas[a:b]) for a, b in bounds]


def chunk_bounds(sizes: Sequence[int], limit_bytes: int) -> list[tuple[int, int]]:
    """The chunking `chunk_export` produces, from tensor sizes alone (export order): each
    chunk as the [start, end) range of the tensors it holds (what the planner projects)."""
    if limit_bytes < 1:
        raise ValueError("limit_bytes must be positive")
    bounds: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, nbytes in enumerate(sizes):
        if _starts_new_chunk(size, i - start, nbytes, limit_bytes):
            bounds.append((start, i))
            start, size = i, 0
        size += nbytes
    if start < len(sizes):
        bounds.append((start, len(sizes)))
    return bounds
