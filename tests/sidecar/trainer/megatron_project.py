"""A real Megatron trainer rank for the projection tests: the export path and the projection
path side by side on one real AdamW step.

Runs inside .venv-megatron, one process per rank (tests/harness/bridge.py `run_ranks`). For
`project_qkv` off and on, each rank builds a `MegatronProjection` of the real bridge and:
1. Identity probe: exports, through the bridge itself, int64 source ids in place of every
   parameter (`4 * id + 1`, so any arithmetic would show), and checks that each affine shard held
   here lands exactly where its row map says. Writes the canonical positions of the shards it
   owns, for the test's exactly-once check.
2. Snapshots its owned shards (the shard-local tracker of v0) and its owned residual chunks.
Then one real AdamW step (megatron_publish.train_step), and, per setting, the projected items
of the owned shards and the residual path's items (the residual export, chunked and owned as
the publisher would, compared tensor by tensor). Rank 0 also writes the dense export of v0 and
v1, from which the test builds the export path's items.

Writes `<out>/rank<r>.json` (coverage, probe failures, residual reasons) and
`<out>/rank<r>-<setting>.safetensors` (items as `<name>|<op>|<n>|loc` and `|val`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from refit_tools.megatron_cpu import rank_arguments

CHUNK_BYTES = 16 << 10
SETTINGS = {"default": False, "qkv": True}


def probe(bridge: Any, model: list[Any], proj: Any, rank: int) -> tuple[list[str], dict[str, Any]]:
    """Check every affine row map held here against the bridge's export of source ids; returns
    (failures, {f"{name}|pos{n}": canonical positions of each owned shard})."""
    import numpy as np
    import torch

    tasks = bridge.get_conversion_tasks(model)
    probe_tasks = []
    ids: dict[int, torch.Tensor] = {}
    for i, task in enumerate(tasks):
        if task is not None and task.param_weight is not None:
            n = task.param_weight.numel()
            assert n < 1 << 20
            base = (rank * 1000 + i) << 20
            ids[i] = (torch.arange(n, dtype=torch.int64) + base).reshape(task.param_weight.shape)
            task = dataclasses.replace(task, param_weight=ids[i] * 4 + 1)
        probe_tasks.append(task)
    exported = {
        name: t.detach().to("cpu").contiguous().reshape(-1)
        for name, t in bridge.export_hf_weights(
            model, cpu=True, show_progress=False, conversion_tasks=probe_tasks
        )
    }
    failures: list[str] = []
    for shard in proj.held_shards():
        i, rowmap = shard.task.index, shard.rowmap
        local = np.arange(ids[i].numel(), dtype=np.int64)
        flat_ids = ids[i].reshape(-1).numpy()
        for meta, (where, mask) in zip(rowmap.dests, rowmap.route(local), strict=True):
            got = exported[meta.name].numpy()
            mine = flat_ids if mask is None else flat_ids[mask]
            if got.size != meta.numel:
                failures.append(f"{meta.name}: exported {got.size} elements, map says {meta.numel}")
            elif not np.array_equal(got[where], mine * 4 + 1):
                failures.append(f"{meta.name}: rows of task {proj.plans[i].name} land elsewhere")
    owned = {}
    for n, shard in enumerate(proj.owned_shards()):
        local = np.arange(shard.param.numel(), dtype=np.int64)
        for meta, (where, _) in zip(shard.rowmap.dests, shard.rowmap.route(local), strict=True):
            owned[f"{meta.name}|pos{n}"] = torch.from_numpy(where.copy())
    return failures, owned


def residual_owned(proj: Any, rank: int, world: int) -> dict[str, Any]:
    """This rank's residual tensors, chunked and owned as the publisher plans them."""
    from refit_sidecar.trainer.export import plan_owned

    kept = {}
    for planned in plan_owned(proj.residual_source().entries(), CHUNK_BYTES, rank, world):
        if planned.chunk is not None:
            kept.update(planned.chunk.tensors)
    return kept


def main() -> None:
    ap = rank_arguments()
    ap.add_argument("--lr", type=float, default=1e-6)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from refit_sidecar.bitdiff import diff_bits
    from refit_sidecar.bits import bits_numpy
    from refit_sidecar.codec.records import Op, TensorMeta, item_from_diff
    from refit_sidecar.trainer.megatron_projection import MegatronProjection
    from refit_sidecar.trainer.projection import project_diff
    from tests.harness.megatron_export import build_model, init_distributed
    from tests.sidecar.trainer.megatron_publish import train_step

    rank, world = init_distributed(args.tp, args.pp)
    bridge, model = build_model(args.hf_dir, args.tp, args.pp)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def dense() -> dict[str, Any]:
        return {
            n: t.detach().to("cpu").contiguous().clone()
            for n, t in bridge.export_hf_weights(model, cpu=True, show_progress=False)
        }

    v0 = dense()
    state: dict[str, dict[str, Any]] = {}
    report: dict[str, Any] = {"rank": rank}
    for setting, project_qkv in SETTINGS.items():
        proj = MegatronProjection(bridge, model, project_qkv=project_qkv)
        failures, positions = probe(bridge, model, proj, rank)
        save_file(positions, str(out / f"rank{rank}-{setting}-positions.safetensors"))
        report[setting] = {
            "coverage": proj.coverage().line(),
            "coverage_fraction": proj.coverage().fraction,
            "probe_failures": failures,
            "residual": sorted({p.reason for p in proj.plans if not p.affine if p.reason}),
            "residual_tasks": len(proj.residual_tasks),
            "owned_shards": sum(1 for _ in proj.owned_shards()),
        }
        state[setting] = {
            "proj": proj,
            "tracker": {s.task.index: s.snapshot() for s in proj.owned_shards()},
            "residual_v0": residual_owned(proj, rank, world),
        }

    changed, total = train_step(model, args.lr, model[0].config.hidden_size)
    report["param_elements_changed"], report["param_elements"] = changed, total

    for setting, st in state.items():
        proj = st["proj"]
        items = []
        for shard in proj.owned_shards():
            old, new = st["tracker"][shard.task.index], shard.snapshot()
            diff = diff_bits(bits_numpy(old), bits_numpy(new))
            items += project_diff(shard.rowmap, diff, Op.XOR)
            items += project_diff(shard.rowmap, diff, Op.OVERWRITE)
        residual_v1 = residual_owned(proj, rank, world)
        assert set(residual_v1) == set(st["residual_v0"])
        for name, new in residual_v1.items():
            diff = diff_bits(bits_numpy(st["residual_v0"][name]), bits_numpy(new))
            for op in (Op.XOR, Op.OVERWRITE):
                item = item_from_diff(TensorMeta.of(name, new), diff, op)
                if item is not None:
                    items.append(item)
        tensors = {}
        for n, item in enumerate(items):
            key = f"{item.meta.name}|{item.op.name}|{n}"
            idx = item.index()
            if isinstance(idx, slice):
                idx = torch.arange(idx.start, idx.stop, dtype=torch.int64)
            tensors[f"{key}|loc"] = idx.clone()  # an XOR and an overwrite item share them
            tensors[f"{key}|val"] = item.values.clone()
        save_file(tensors, str(out / f"rank{rank}-{setting}.safetensors"))

    v1 = dense()
    if rank == 0:
        save_file(v0, str(out / "v0.safetensors"))
        save_file(v1, str(out / "v1.safetensors"))
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
