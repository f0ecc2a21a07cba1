"""A real Megatron trainer rank for the tests: publish v0, take one AdamW step, publish v1.

Runs inside .venv-megatron, one process per rank (tests/harness/bridge.py `run_ranks`); rank r
publishes through `MegatronBridgeSource` to the trainer sidecar at `--urls[r]`. The step is a
real forward/backward of the Megatron GPT model on a fixed batch and the BF16 mixed-precision
AdamW update Megatron's `Float16OptimizerWithFloat16Params` performs (FP32 main copies of the
BF16 parameters, `torch.optim.AdamW` - what Megatron uses without TE/apex - on them, then a copy
back into the BF16 parameters). Megatron's own optimizer class and pipeline schedules allocate
on CUDA unconditionally (`device="cuda"`) in megatron-core 0.16, so they cannot run here; the
pipeline (PP=2) is a one-microbatch forward/backward with gloo send/recv instead.

After the publish, every rank (in the same order: the exports run the bridge's TP/PP
collectives) also checks `MegatronBridgeSource` over the real bridge with owned chunking
(`bridge_checks`): for producer 0 and 1 of 2, the kept tensors are complete, disjoint, the
owner's own copies and bit for bit the dense export, and the whole export runs on every rank
although each keeps only its own chunks; so does `Publisher.participate` (a rank without a
sidecar).

Writes `<out>/rank<r>.json` (publish results, elements changed on this rank, the facts of
`bridge_checks`) and, on rank 0, `<out>/v1/model.safetensors`: a full dense export of v1 for the
dense-load reference.

With `--projected` the rank publishes through `ProjectedSource` instead (direct projection):
v0 whole, then v1 and v2 after two AdamW steps, each waited for (the test commits them); before
v2 the fused Q/K/V of each pipeline stage's first layer is put back to its v1 bits, so the
change flags skip those two residual tasks. Rank 0 writes the dense export of v1 and v2. Last,
rank 0 asks for a version its sidecar refuses while the others publish v3: every rank must
raise. The bridge checks are left to the export-path runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from refit_tools.megatron_cpu import rank_arguments

SEQ, BATCH = 32, 2
CHECK_CHUNK_BYTES = 16 << 10  # many chunks for the tiny Qwen3: both producers own several


class CountingBridge:
    """Wraps the real Megatron Bridge (not a fake): `export_hf_weights` passes the call to it
    unchanged and yields what it yields, only counting the tensors, recording the keyword
    arguments and the storage address of each yielded tensor."""

    def __init__(self, bridge: Any) -> None:
        self._bridge = bridge
        self.yielded = 0
        self.kwargs: dict[str, Any] = {}
        self.storage: dict[str, int] = {}

    def reset(self) -> None:
        self.yielded, self.kwargs, self.storage = 0, {}, {}

    def export_hf_weights(self, model: Any, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        self.kwargs = dict(kwargs)
        for name, tensor in self._bridge.export_hf_weights(model, **kwargs):
            self.yielded += 1
            self.storage[name] = tensor.untyped_storage().data_ptr()
            yield name, tensor


def bridge_checks(bridge: Any, model: list[Any], dense: dict[str, Any]) -> dict[str, Any]:
    """`MegatronBridgeSource` over the real bridge, chunked and owned by producer 0 and 1 of 2,
    then `Publisher.participate`: three more exports, each run to the end on every rank. Returns
    the facts (the test asserts them too) after asserting them here."""
    import torch

    from refit_sidecar.bits import int_view
    from refit_sidecar.trainer import MegatronBridgeSource, Publisher
    from refit_sidecar.trainer.export import plan_owned

    counting = CountingBridge(bridge)
    source = MegatronBridgeSource(counting, model)
    kept: dict[str, torch.Tensor] = {}
    kept_per_producer, owned_chunks, yields, kwargs = [], [], [], []
    overlapping, shared, mismatched, chunks = [], [], [], 0
    for producer in (0, 1):
        counting.reset()
        mine: dict[str, torch.Tensor] = {}
        owned = 0
        chunks = 0
        for planned in plan_owned(source.entries(), CHECK_CHUNK_BYTES, producer, 2):
            chunks += 1
            if planned.chunk is not None:
                owned += 1
                mine.update(planned.chunk.tensors)
        yields.append(counting.yielded)
        kwargs.append(counting.kwargs)
        for name, t in mine.items():
            if t.untyped_storage().data_ptr() == counting.storage[name]:
                shared.append(name)  # not the owner's own copy of what the bridge yielded
        overlapping += sorted(set(mine) & set(kept))
        kept.update(mine)
        kept_per_producer.append(len(mine))
        owned_chunks.append(owned)
    for name, t in kept.items():
        want = dense.get(name)
        if (
            want is None
            or t.dtype != want.dtype
            or t.shape != want.shape
            or not torch.equal(int_view(t), int_view(want))
        ):
            mismatched.append(name)
    counting.reset()
    Publisher.participate(source)  # a rank without a sidecar still runs the whole export
    yields.append(counting.yielded)
    kwargs.append(counting.kwargs)

    facts = {
        "dense_tensors": len(dense),
        "chunks": chunks,
        "owned_chunks": owned_chunks,
        "kept_per_producer": kept_per_producer,
        "kept_names_equal_dense": set(kept) == set(dense),
        "overlapping": overlapping,
        "not_bit_equal": mismatched,
        "shared_with_bridge": shared,
        "yields": yields,  # producer 0, producer 1, participate
        "export_kwargs": kwargs,
    }
    assert facts["kept_names_equal_dense"], sorted(set(kept) ^ set(dense))
    assert all(owned_chunks), facts
    assert not overlapping, overlapping
    assert not mismatched, mismatched
    assert not shared, shared
    assert yields == [len(dense)] * 3, facts
    assert kwargs == [{"cpu": True, "show_progress": False}] * 3, kwargs
    return facts


def train_step(model: list[Any], lr: float, hidden: int) -> tuple[int, int]:
    """One forward/backward on a fixed batch and a mixed-precision AdamW step; returns the
    number of BF16 parameter elements whose stored bits changed, and the total (this rank)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    # No dropout is configured; Megatron still forks its CUDA RNG tracker around attention.
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    params = [p for chunk in model for p in chunk.parameters() if p.requires_grad]
    main = [p.detach().float().clone().requires_grad_(True) for p in params]
    optimizer = torch.optim.AdamW(main, lr=lr, weight_decay=0.01)

    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 512, (BATCH, SEQ + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]
    first = parallel_state.is_pipeline_first_stage()
    last = parallel_state.is_pipeline_last_stage()
    shape = (SEQ, BATCH, hidden)
    m = model[0]
    # Megatron refuses to train MoE with TP>1 without sequence parallelism, which needs TE or
    # Apex norms; in eval mode the same forward runs (no dropout is configured), without the
    # router's auxiliary loss. The gradients and the AdamW update are real either way.
    moe_tp = (
        bool(m.config.num_moe_experts) and parallel_state.get_tensor_model_parallel_world_size() > 1
    )
    m.train(not moe_tp)
    received = None
    if not first:
        received = torch.empty(shape, dtype=torch.bfloat16)
        dist.recv(received, src=parallel_state.get_pipeline_model_parallel_prev_rank())
        received.requires_grad_(True)
    m.set_input_tensor(received)
    out = m(inputs, positions, mask, labels=labels if last else None)
    if last:
        out.float().mean().backward()
    else:
        nxt = parallel_state.get_pipeline_model_parallel_next_rank()
        dist.send(out.detach().contiguous(), dst=nxt)
        grad = torch.empty(shape, dtype=torch.bfloat16)
        dist.recv(grad, src=nxt)
        out.backward(grad)
    if received is not None:
        assert received.grad is not None
        dist.send(
            received.grad.contiguous(), dst=parallel_state.get_pipeline_model_parallel_prev_rank()
        )

    for p, mp in zip(params, main, strict=True):
        assert p.grad is not None, "every parameter gets a gradient"
        mp.grad = p.grad.float()
        p.grad = None
    optimizer.step()
    changed = total = 0
    with torch.no_grad():
        for p, mp in zip(params, main, strict=True):
            before = p.detach().view(torch.int16).clone()
            p.copy_(mp)  # round to nearest BF16, as Megatron's main -> model param copy
            changed += int((before != p.detach().view(torch.int16)).sum())
            total += p.numel()
    return changed, total


def dense_export(bridge: Any, model: list[Any]) -> dict[str, Any]:
    return {
        name: t.detach().to("cpu").contiguous().clone()
        for name, t in bridge.export_hf_weights(model, cpu=True, show_progress=False)
    }


def projected(args: Any, rank: int, bridge: Any, model: list[Any]) -> None:
    """Publish v0 (the whole export) and, after each of two AdamW steps, v1 and v2 through
    `ProjectedSource`; rank 0 writes the dense export of each version. Ranks beyond the given
    sidecars have none: they take part through `Publisher.participate`."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from refit_sidecar.trainer import Publisher, PublisherConfig, StagingError
    from refit_sidecar.trainer.projected import ProjectedSource

    source = ProjectedSource.megatron(bridge, model)
    urls = args.urls.split(",")
    publisher = None
    if rank < len(urls):
        config = PublisherConfig(
            url=urls[rank],
            inbox=Path(args.inboxes.split(",")[rank]),
            token=args.token,
            commit_timeout_s=300,
        )
        publisher = Publisher(config)

    def publish(version: int) -> dict[str, Any] | None:
        if publisher is None:
            Publisher.participate(source)
            return None
        if version == 0:
            return dataclasses.asdict(publisher.initialize(source))
        return dataclasses.asdict(publisher.publish(version, source, wait=True))

    result: dict[str, Any] = {
        "rank": rank,
        "coverage": source.coverage().line(),
        "initialize": publish(0),
        "publish": [],
    }
    out = Path(args.out)
    # The fused Q/K/V of each stage's first layer is put back after the second step: that
    # residual task is unchanged in v2, so its change flag skips it (two tasks in all).
    qkv = [
        p
        for chunk in model
        for n, p in chunk.named_parameters()
        if n.endswith("layers.0.self_attention.linear_qkv.weight")
    ]
    for version in (1, 2):
        before = [p.detach().clone() for p in qkv]
        changed, _ = train_step(model, args.lr, model[0].config.hidden_size)
        if version == 2:
            with torch.no_grad():
                for p, b in zip(qkv, before, strict=True):
                    p.copy_(b)
        published = publish(version)  # the test commits it
        result["publish"].append(
            (published or {}) | {"changed": changed, "skipped_residuals": source.skipped_residuals}
        )
        dense = dense_export(bridge, model)  # a collective: every rank
        if rank == 0:
            (out / f"v{version}").mkdir(parents=True, exist_ok=True)
            save_file(dense, str(out / f"v{version}" / "model.safetensors"))
    # A refusal on one rank reaches every rank: rank 0 asks for a version its sidecar refuses,
    # the other publishing ranks for the right one, the rank without a sidecar takes part.
    try:
        if publisher is None:
            Publisher.participate(source)
        else:
            publisher.publish(5 if rank == 0 else 3, source)
    except StagingError as exc:
        result["refused"] = f"{type(exc).__name__}: {exc}"
    (out / f"rank{rank}.json").write_text(json.dumps(result, default=str))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = rank_arguments()
    ap.add_argument("--urls", required=True, help="comma-separated sidecar URLs, one per rank")
    ap.add_argument("--inboxes", required=True, help="comma-separated inbox dirs, one per rank")
    ap.add_argument("--token", required=True)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument(
        "--projected",
        action="store_true",
        help="publish through ProjectedSource, two AdamW steps (v1, v2), no bridge checks",
    )
    args = ap.parse_args()

    import torch.distributed as dist
    from safetensors.torch import save_file

    from refit_sidecar.trainer import MegatronBridgeSource, Publisher, PublisherConfig
    from tests.harness.megatron_export import build_model, init_distributed

    rank, _world = init_distributed(args.tp, args.pp)
    bridge, model = build_model(args.hf_dir, args.tp, args.pp)
    if args.projected:
        projected(args, rank, bridge, model)
        return
    # The product's own constructor (megatron.bridge is already imported, so the harness's
    # transformer-engine stand-in is not needed again); `bridge` is the harness's own.
    source = MegatronBridgeSource.from_hf_pretrained(args.hf_dir, model)
    publisher = Publisher(
        PublisherConfig(
            url=args.urls.split(",")[rank],
            inbox=Path(args.inboxes.split(",")[rank]),
            token=args.token,
            commit_timeout_s=300,
        )
    )
    first = publisher.initialize(source)
    changed, total = train_step(model, args.lr, model[0].config.hidden_size)
    second = publisher.publish(1, source, wait=True)  # the test runs the transition meanwhile

    dense = dense_export(bridge, model)
    out = Path(args.out)
    if rank == 0:
        (out / "v1").mkdir(parents=True, exist_ok=True)
        save_file(dense, str(out / "v1" / "model.safetensors"))
    checks = bridge_checks(bridge, model, dense)  # same calls in the same order on every rank
    result = {
        "rank": rank,
        "initialize": dataclasses.asdict(first),
        "publish": dataclasses.asdict(second),
        "param_elements_changed": changed,
        "param_elements": total,
        "bridge_checks": checks,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
