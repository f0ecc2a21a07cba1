"""Canonical sources and owned chunking: what every trainer rank iterates to publish a version.

A source yields `ExportEntry`s: the HF name and metadata of each canonical tensor in a
deterministic order, with a `fetch` that materializes the tensor. Ownership is decided from the
metadata before `fetch` runs, so an owner gets a CPU tensor while other ranks only take part in
whatever collective the source needs (Megatron Bridge's gathers, DTensor's all-gather) and keep
nothing. Chunk boundaries follow `baseline.chunks.chunk_export` exactly (whole tensors, a new
chunk when the next tensor would pass the byte limit), and chunk `i` belongs to producer
`i % producers`, so every rank computes the same plan without talking to the others.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from refit_protocol.producer_api import StagePurpose
from refit_sidecar.baseline.chunks import ExportChunk, owner_of
from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.trainer.errors import CandidateMismatchError

#: Materializes one entry: `fetch(True)` returns the tensor on CPU, `fetch(False)` only runs
#: the collective part (if any) and returns None. Called exactly once per entry, in order.
Fetch = Callable[[bool], torch.Tensor | None]


@dataclass(frozen=True)
class ExportEntry:
    """One canonical tensor of an export: its identity now, its values on demand."""

    meta: TensorMeta
    fetch: Fetch

    @property
    def name(self) -> str:
        return self.meta.name


class CanonicalSource(Protocol):
    """HF-named tensors in a deterministic order, the same on every rank and every call."""

    def entries(self) -> Iterator[ExportEntry]:
        """A fresh pass over the current weights; must be iterated to the end on every rank."""
        ...


@dataclass(frozen=True)
class StageIntent:
    """What a producer rank is about to stage, as its sidecar says: all a planning source needs
    to cut the export into the baseline's chunks and give each producer its own. `refusal`: the
    rank cannot publish (its sidecar refused, or is unreachable) and says why, so that a
    planning source refuses on every rank instead of leaving the others in a collective."""

    version: int
    purpose: StagePurpose
    producer: int
    producers: int
    limit_bytes: int
    committed: int
    layout: list[TensorMeta] | None
    refusal: str | None = None

    @classmethod
    def refusing(cls, version: int, purpose: StagePurpose, why: str) -> StageIntent:
        return cls(version, purpose, -1, 0, 0, -1, None, refusal=why)


@runtime_checkable
class PlanningSource(Protocol):
    """A source that plans the owned chunks itself (`trainer.projected`): the publisher hands it
    the intent of this rank (None on a rank without a sidecar) and sends what it yields."""

    def plan(self, intent: StageIntent | None) -> Iterator[PlannedChunk]:
        """This rank's part of one publish; a collective: every rank iterates it to the end."""
        ...


@dataclass(frozen=True)
class Change:
    """A canonical tensor given as its changed elements against the committed baseline: sorted
    flat positions (int64) and their new values (the tensor's dtype), both 1-D."""

    name: str
    positions: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True)
class PlannedChunk:
    """One chunk of the plan: every rank sees its metadata, only the owner its tensors.

    `chunk` holds the tensors sent whole; `changes` those sent as changes (a projecting source's
    `next` versions), so together they cover `metas`.
    """

    index: int
    metas: tuple[TensorMeta, ...]
    chunk: ExportChunk | None
    changes: tuple[Change, ...] = ()

    @property
    def owned(self) -> bool:
        return self.chunk is not None

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.metas)


def plan_owned(
    entries: Iterable[ExportEntry], limit_bytes: int, producer: int | None, producers: int
) -> Iterator[PlannedChunk]:
    """Chunk an export and keep the tensors of `producer`'s chunks only.

    `producer=None` keeps nothing (a rank without a sidecar that must still take part in the
    export's collectives). Every entry is fetched, in order, whatever its owner.
    """
    if limit_bytes < 1:
        raise ValueError("limit_bytes must be positive")
    if producers < 1 or (producer is not None and not 0 <= producer < producers):
        raise ValueError(f"producer {producer} not in [0, {producers})")
    metas: list[TensorMeta] = []
    tensors: list[tuple[str, torch.Tensor]] = []
    size = 0
    index = 0
    for entry in entries:
        nbytes = entry.meta.nbytes
        if metas and size + nbytes > limit_bytes:
            yield _planned(index, metas, tensors, producer, producers)
            index += 1
            metas, tensors, size = [], [], 0
        owned = producer is not None and owner_of(index, producers) == producer
        tensor = entry.fetch(owned)
        if owned:
            tensors.append((entry.name, checked_tensor(entry.meta, tensor)))
        metas.append(entry.meta)
        size += nbytes
    if metas:
        yield _planned(index, metas, tensors, producer, producers)


def _planned(
    index: int,
    metas: list[TensorMeta],
    tensors: list[tuple[str, torch.Tensor]],
    producer: int | None,
    producers: int,
) -> PlannedChunk:
    owned = producer is not None and owner_of(index, producers) == producer
    chunk = ExportChunk(index, tuple(tensors)) if owned else None
    return PlannedChunk(index, tuple(metas), chunk)


def checked_tensor(meta: TensorMeta, tensor: torch.Tensor | None) -> torch.Tensor:
    """The fetched tensor must be what the entry announced, on CPU and contiguous."""
    if tensor is None:
        raise CandidateMismatchError(f"{meta.name}: the source returned no tensor for its owner")
    got = TensorMeta.of(meta.name, tensor)
    if got != meta:
        raise CandidateMismatchError(
            f"{meta.name}: announced {list(meta.shape)} {meta.dtype}, "
            f"fetched {list(got.shape)} {got.dtype}"
        )
    return tensor.detach().to("cpu").contiguous()
