"""Owned chunking: the same plan as the baseline's, complete and disjoint ownership, and every
entry fetched on every rank (collectives) while only owners keep tensors."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from refit_sidecar.baseline.chunks import chunk_export, plan_chunks
from refit_sidecar.bits import int_view
from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.trainer.errors import CandidateMismatchError
from refit_sidecar.trainer.export import ExportEntry, plan_owned
from refit_sidecar.trainer.state_dict import StateDictSource


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    for i, rows in enumerate([3, 40, 1, 17, 64, 2, 9, 33, 128, 5]):
        out[f"layers.{i}.weight"] = torch.randn(rows, 16, generator=g).to(torch.bfloat16)
    out["steps"] = torch.arange(7, dtype=torch.int64)
    return out


@pytest.mark.parametrize("limit", [1, 600, 2048, 10_000, 1 << 30])
def test_plan_equals_baseline_chunking(limit: int) -> None:
    s = state()
    want = [c.metas() for c in chunk_export(s.items(), limit)]
    got = [p.metas for p in plan_owned(StateDictSource(s).entries(), limit, 0, 1)]
    assert got == want == plan_chunks([TensorMeta.of(n, t) for n, t in s.items()], limit)


@pytest.mark.parametrize("producers", [1, 2, 3])
def test_ownership_complete_and_disjoint(producers: int) -> None:
    s = state()
    owned: dict[str, torch.Tensor] = {}
    indices: list[int] = []
    for p in range(producers):
        for planned in plan_owned(StateDictSource(s).entries(), 600, p, producers):
            assert planned.owned == (planned.index % producers == p)
            if planned.chunk is not None:
                indices.append(planned.index)
                for name, t in planned.chunk.tensors:
                    assert name not in owned
                    owned[name] = t
    assert sorted(indices) == list(range(len(plan_chunks(list(_metas(s)), 600))))
    assert owned.keys() == s.keys()
    assert all(torch.equal(int_view(owned[n]), int_view(s[n])) for n in s)


def _metas(s: dict[str, torch.Tensor]) -> Iterator[TensorMeta]:
    return (TensorMeta.of(n, t) for n, t in s.items())


def test_every_entry_is_fetched_and_only_owners_keep() -> None:
    calls: list[tuple[str, bool]] = []

    def entries() -> Iterator[ExportEntry]:
        for name, t in state().items():

            def fetch(keep: bool, name: str = name, t: torch.Tensor = t) -> torch.Tensor | None:
                calls.append((name, keep))
                return t if keep else None

            yield ExportEntry(TensorMeta.of(name, t), fetch)

    planned = list(plan_owned(entries(), 600, None, 2))
    assert [n for n, _ in calls] == list(state())
    assert not any(keep for _, keep in calls)
    assert all(p.chunk is None for p in planned)


def test_fetched_tensor_must_match_its_entry() -> None:
    t = torch.zeros(4, 4, dtype=torch.bfloat16)
    entry = ExportEntry(TensorMeta("w", (4, 4), torch.float32), lambda keep: t if keep else None)
    with pytest.raises(CandidateMismatchError, match="announced"):
        list(plan_owned([entry], 1 << 20, 0, 1))
