"""Row maps against plain torch references of each split (no Megatron): every local element lands
where slicing the canonical tensor puts it, and projected records applied to the canonical
tensor give the tensor with the new shard in place."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from refit_sidecar.bitdiff import BitDiff
from refit_sidecar.bits import int_view
from refit_sidecar.codec.records import Op, TensorMeta, apply_item_
from refit_sidecar.trainer import projection
from refit_sidecar.trainer.projection import RowMap


def _ids(*shape: int, start: int = 0) -> torch.Tensor:
    n = int(np.prod(shape))
    return torch.arange(start, start + n, dtype=torch.int64).reshape(shape)


def _check(rowmap: RowMap, shard: torch.Tensor, canon: list[torch.Tensor]) -> None:
    """Each local element's canonical position holds the same id, and each destination's
    positions are sorted."""
    local = np.arange(shard.numel(), dtype=np.int64)
    flat = shard.reshape(-1).numpy()
    for (where, mask), target in zip(rowmap.route(local), canon, strict=True):
        assert np.all(np.diff(where) > 0)
        mine = flat if mask is None else flat[mask]
        assert np.array_equal(target.reshape(-1).numpy()[where], mine)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_and_row_shards(tp: int) -> None:
    w = _ids(8, 12)
    meta = TensorMeta("w", (8, 12), torch.int64)
    for r, shard in enumerate(torch.chunk(w, tp, dim=0)):
        _check(projection.column(meta, r, tp), shard.contiguous(), [w])
    for r, shard in enumerate(torch.chunk(w, tp, dim=1)):
        _check(projection.row(meta, r, tp), shard.contiguous(), [w])
    bias = _ids(8)
    for r, shard in enumerate(torch.chunk(bias, tp)):
        _check(projection.column(TensorMeta("b", (8,), torch.int64), r, tp), shard, [bias])
    _check(projection.identity(TensorMeta("b", (8,), torch.int64)), bias, [bias])


@pytest.mark.parametrize("tp", [1, 2])
def test_gated_mlp_shards(tp: int) -> None:
    gate, up = _ids(8, 4), _ids(8, 4, start=1000)
    gm, um = TensorMeta("gate", (8, 4), torch.int64), TensorMeta("up", (8, 4), torch.int64)
    for r, (g, u) in enumerate(zip(torch.chunk(gate, tp), torch.chunk(up, tp), strict=True)):
        shard = torch.cat([g, u])  # Megatron's linear_fc1 shard: [gate_r; up_r]
        _check(projection.gated(gm, um, r, tp), shard, [gate, up])


@pytest.mark.parametrize(("heads", "groups", "tp"), [(4, 2, 1), (4, 2, 2), (8, 4, 2), (8, 8, 4)])
def test_fused_qkv_shards(heads: int, groups: int, tp: int) -> None:
    d, h = 3, 5
    q, k, v = (
        _ids(heads * d, h),
        _ids(groups * d, h, start=10_000),
        _ids(groups * d, h, start=20_000),
    )
    per = heads // groups
    fused = torch.cat(
        [
            torch.cat(
                [q[g * per * d : (g + 1) * per * d], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]
            )
            for g in range(groups)
        ]
    )
    metas = [TensorMeta(n, tuple(t.shape), torch.int64) for n, t in (("q", q), ("k", k), ("v", v))]
    for r, shard in enumerate(torch.chunk(fused, tp)):
        rowmap = projection.qkv(
            *metas, heads=heads, groups=groups, head_dim=d, tp_rank=r, tp_size=tp
        )
        _check(rowmap, shard.contiguous(), [q, k, v])


def test_projected_records_rebuild_the_canonical_tensor() -> None:
    gen = torch.Generator().manual_seed(0)
    gate, up = (
        torch.randn(8, 16, generator=gen).bfloat16(),
        torch.randn(8, 16, generator=gen).bfloat16(),
    )
    gm, um = TensorMeta.of("gate", gate), TensorMeta.of("up", up)
    rowmap = projection.gated(gm, um, 1, 2)
    old = torch.cat([gate[4:], up[4:]]).contiguous()
    new = old.clone()
    bits = int_view(new)
    bits[torch.rand(bits.shape, generator=gen) < 0.1] ^= 1
    bits[:16] ^= 2  # a whole row: a contiguous run
    for op in (Op.XOR, Op.OVERWRITE):
        items = projection.project_shard(rowmap, old, new, op)
        assert {i.meta.name for i in items} == {"gate", "up"}
        g, u = gate.clone(), up.clone()
        for item in items:
            apply_item_(g if item.meta.name == "gate" else u, item)
        assert torch.equal(int_view(g[4:]), int_view(new[:4]))
        assert torch.equal(int_view(u[4:]), int_view(new[4:]))
        assert torch.equal(int_view(g[:4]), int_view(gate[:4]))
    assert projection.project_shard(rowmap, old, old.clone(), Op.XOR) == []


def test_bad_maps_and_shards_are_refused() -> None:
    meta = TensorMeta("w", (4, 6), torch.bfloat16)
    with pytest.raises(ValueError, match="does not split"):
        projection.column(meta, 0, 3)
    with pytest.raises(ValueError, match="must increase"):
        RowMap((2, 6), (meta,), np.zeros(2, np.int16), np.array([1, 0]), 0, 6)
    with pytest.raises(ValueError, match="outside"):
        RowMap((2, 6), (meta,), np.zeros(2, np.int16), np.array([3, 4]), 0, 6)
    with pytest.raises(ValueError, match="not 5 wide"):
        RowMap((2, 5), (meta,), np.zeros(2, np.int16), np.array([0, 1]), 0, 5)
    with pytest.raises(ValueError, match="1-D and 2-D"):
        projection.identity(TensorMeta("x", (2, 2, 2), torch.bfloat16))
    rowmap = projection.column(meta, 0, 2)
    shard = torch.zeros(2, 6, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="row map for"):
        projection.project_shard(rowmap, shard, torch.zeros(3, 6, dtype=torch.bfloat16), Op.XOR)
    outside = BitDiff(np.array([12]), np.zeros(1, np.int16), np.zeros(1, np.int16))
    with pytest.raises(ValueError, match="changes outside"):
        projection.project_diff(rowmap, outside, Op.XOR)
    with pytest.raises(ValueError, match="not canonical"):
        projection.project_shard(rowmap, shard.float(), shard.float(), Op.XOR)
