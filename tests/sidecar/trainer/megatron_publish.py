"""A real Megatron trainer rank for the tests: publish v0, take one AdamW step, publish v1.

Runs inside .venv-megatron, one process per rank (tests/harness/bridge.py `run_ranks`); rank r
publishes through `MegatronBridgeSource` to the trainer sidecar at `--urls[r]`. The step is a
real forward/backward of the Megatron GPT model on a fixed batch and the BF16 mixed-precision
AdamW update Megatron's `Float16OptimizerWithFloat16Params` performs (FP32 main copies of the
BF16 parameters, `torch.optim.AdamW` - what Megatron uses without TE/apex - on them, then a copy
back into the BF16 parameters). Megatron's own optimizer class and pipeline schedules allocate
on CUDA unconditionally (`device="cuda"`) in megatron-core 0.16, so they cannot run here; the
pipeline (PP=2) is a one-microbatch forward/backward with gloo send/recv instead.

Writes `<out>/rank<r>.json` (publish results, elements changed on this rank) and, on rank 0,
`<out>/v1/model.safetensors`: a full dense export of v1 for the dense-load reference.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any

SEQ, BATCH = 32, 2


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
    m.train()
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--urls", required=True, help="comma-separated sidecar URLs, one per rank")
    ap.add_argument("--inboxes", required=True, help="comma-separated inbox dirs, one per rank")
    ap.add_argument("--token", required=True)
    ap.add_argument("--lr", type=float, default=1e-6)
    args = ap.parse_args()

    import torch.distributed as dist
    from safetensors.torch import save_file

    from refit_sidecar.trainer import MegatronBridgeSource, Publisher, PublisherConfig
    from tests.harness.megatron_export import build_model, init_distributed

    rank, _world = init_distributed(args.tp, args.pp)
    bridge, model = build_model(args.hf_dir, args.tp, args.pp)
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

    dense = {
        name: t.detach().to("cpu").contiguous().clone()
        for name, t in bridge.export_hf_weights(model, cpu=True, show_progress=False)
    }
    out = Path(args.out)
    if rank == 0:
        (out / "v1").mkdir(parents=True, exist_ok=True)
        save_file(dense, str(out / "v1" / "model.safetensors"))
    result = {
        "rank": rank,
        "initialize": dataclasses.asdict(first),
        "publish": dataclasses.asdict(second),
        "param_elements_changed": changed,
        "param_elements": total,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
