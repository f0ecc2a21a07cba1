"""One Megatron rank of `kuberefit bench construct` (runs in .venv-megatron, gloo, CPU).

For each change rate, the rank restores the loaded weights, takes the baseline of its path (not
timed), flips the lowest stored bit of that fraction of every parameter's elements (the same
elements on every TP replica of a replicated parameter, so replicas stay equal), then times the
construction of its delta records:
- `export`: today's path, `MegatronBridgeSource` through `plan_owned` (every rank runs the whole
  export; the owner of each chunk diffs its tensors against its canonical baseline);
- `project`: the publisher's `ProjectedSource`: the owned affine shards diffed against the shard
  baseline, projected and routed to the rank that owns their chunk (`all_to_all_single`), plus
  the residual tasks through the bridge's export, diffed by their chunk's owner as above.
Construction time is the rank's wall time from a barrier; peak memory is the rank's resident
set above what it held at the barrier (baselines included before). Each rank also folds what it
found (name, position, new bits of every changed element) into an order-free digest, so the
driver can check that both paths found the same elements: in a second, untimed pass over the
same weights, so the timed one does exactly what construction does. Writes
`<out>/rank<r>.json`.
"""

from __future__ import annotations

import ctypes
import json
import time
import zlib
from pathlib import Path
from typing import Any

from refit_tools.megatron_cpu import rank_arguments

CHUNK_BYTES = 64 << 20
_LIBC = ctypes.CDLL("libc.so.6")


def fold(name: str, positions: Any, new_bits: Any) -> int:
    """An order-free digest of changed elements (name, flat position, new stored bits): a sum
    modulo 2**64 of a mixed 64-bit hash per element, so records split over ranks and items add
    up to the same value as one tensor's diff."""
    import numpy as np

    lanes = new_bits.view(f"<u{new_bits.dtype.itemsize}").astype(np.uint64)
    with np.errstate(over="ignore"):
        h = positions.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        h += np.uint64(zlib.crc32(name.encode())) * np.uint64(0xC2B2AE3D27D4EB4F)
        h ^= lanes * np.uint64(0x165667B19E3779F9)
        h ^= h >> np.uint64(31)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(29)
    return int(h.sum(dtype=np.uint64))


def _perturb(model: list[Any], rate: float, seed: int) -> None:
    import torch

    with torch.no_grad():
        for chunk in model:
            for name, p in chunk.named_parameters():
                gen = torch.Generator().manual_seed(seed ^ zlib.crc32(name.encode()))
                bits = p.data.view(torch.int16).reshape(-1)
                bits[torch.rand(bits.numel(), generator=gen) < rate] ^= 1


def _owned_tensors(source: Any, rank: int, world: int) -> Any:
    """The tensors of `source` this rank owns, chunked as the publisher plans them (every rank
    runs the whole export: its collectives need them all)."""
    from refit_sidecar.trainer.export import plan_owned

    for planned in plan_owned(source.entries(), CHUNK_BYTES, rank, world):
        if planned.chunk is not None:
            yield from planned.chunk.tensors


def _diff_canonical(base: dict[str, Any], tensors: Any, check: bool) -> tuple[int, int]:
    """(changed elements, digest if `check`) of canonical tensors against their baseline."""
    from refit_sidecar.bitdiff import diff_bits
    from refit_sidecar.bits import bits_numpy

    changed = digest = 0
    for n, t in tensors:
        diff = diff_bits(bits_numpy(base[n]), bits_numpy(t))
        changed += diff.count
        if check:
            digest += fold(n, diff.locations, diff.new_bits)
    return changed, digest


def _export_path(bridge: Any, model: list[Any], rank: int, world: int) -> Any:
    """(baseline, construct): today's canonical baseline, and the timed construction."""
    from refit_sidecar.trainer import MegatronBridgeSource

    source = MegatronBridgeSource(bridge, model)

    def baseline() -> dict[str, Any]:
        return dict(_owned_tensors(source, rank, world))

    def construct(base: dict[str, Any], check: bool) -> tuple[int, int]:
        return _diff_canonical(base, _owned_tensors(source, rank, world), check)

    return baseline, construct


def _project_path(source: Any, rank: int, world: int) -> Any:
    """(baseline, construct) of the publisher's projecting source, every rank a producer: the
    first publish (the whole export, then the shard baseline) and the next one's chunks, whose
    projected tensors come as changes (routed to their chunk's owner) and residual ones whole,
    diffed here against the owner's canonical baseline as the sidecar would."""
    from refit_sidecar.bits import bits_numpy
    from refit_sidecar.trainer.export import StageIntent

    first = StageIntent(0, "initial", rank, world, CHUNK_BYTES, 0, None)

    def baseline() -> tuple[list[Any], dict[str, Any]]:
        layout: list[Any] = []
        residual: dict[str, Any] = {}
        for planned in source.plan(first):
            layout.extend(planned.metas)
            if planned.chunk is not None:
                residual.update(
                    (n, t) for n, t in planned.chunk.tensors if n not in source.projected_names
                )
        return layout, residual

    def construct(base: tuple[list[Any], dict[str, Any]], check: bool) -> tuple[int, int]:
        layout, canonical = base
        changed = digest = 0
        for planned in source.plan(StageIntent(1, "next", rank, world, CHUNK_BYTES, 0, layout)):
            for change in planned.changes:
                changed += change.positions.numel()
                if check:
                    new_bits = bits_numpy(change.values)
                    digest += fold(change.name, change.positions.numpy(), new_bits)
            if planned.chunk is not None:
                more, more_digest = _diff_canonical(canonical, planned.chunk.tensors, check)
                changed, digest = changed + more, digest + more_digest
        return changed, digest

    return baseline, construct


def main() -> None:
    ap = rank_arguments(tp=2, pp=2)
    ap.add_argument("--path", choices=("export", "project"), required=True)
    ap.add_argument("--rates", default="0.01,0.03,0.05")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    from refit_sidecar.trainer.projected import ProjectedSource
    from refit_tools.megatron_cpu import build_model, init_distributed
    from refit_tools.peak_rss import PeakRss

    rank, world = init_distributed(args.tp, args.pp)
    bridge, model = build_model(args.hf_dir, args.tp, args.pp)
    params = [p for chunk in model for p in chunk.parameters()]
    loaded = [p.detach().clone() for p in params]
    report: dict[str, Any] = {"rank": rank, "path": args.path, "rates": []}
    if args.path == "project":
        started = time.perf_counter()
        source = ProjectedSource.megatron(bridge, model)
        report["plan_s"] = time.perf_counter() - started
        report["coverage"] = source.coverage().line()
        report["coverage_fraction"] = source.coverage().fraction
        baseline, construct = _project_path(source, rank, world)
    else:
        baseline, construct = _export_path(bridge, model, rank, world)
    rates = [float(r) for r in args.rates.split(",")]
    for k, rate in enumerate([rates[0], *rates]):  # the first round warms up, untimed
        with torch.no_grad():
            for p, w in zip(params, loaded, strict=True):
                p.data.copy_(w)
        base = baseline()
        _perturb(model, rate, args.seed)
        _LIBC.malloc_trim(0)  # freed heap back to the system: the peak counts this round only
        dist.barrier()
        with PeakRss(every_s=0.005) as rss:
            started = time.perf_counter()
            changed, _ = construct(base, False)
            seconds = time.perf_counter() - started
        dist.barrier()
        checked, digest = construct(base, True)  # the check pass, untimed
        if checked != changed:
            raise RuntimeError(f"{checked} changes in the check pass, {changed} in the timed one")
        if k:
            report["rates"].append(
                {
                    "rate": rate,
                    "construct_s": seconds,
                    "peak_extra_bytes": rss.extra,
                    "changed": changed,
                    "digest": digest % (1 << 64),
                }
            )
        del base
        dist.barrier()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
