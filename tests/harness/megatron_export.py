"""Real Megatron Bridge on CPU (gloo) for the test harness: export an HF checkpoint through it
(this file's `main`), with the CPU builders of `refit_tools.megatron_cpu`.

Runs inside .venv-megatron, one process per rank, launched by tests/harness/bridge.py. `main`
writes the HF-named tensors the bridge yields on each rank to `<out>/rank<r>.safetensors` plus
the export order to `<out>/rank<r>.json`. Other harness scripts
(tests/sidecar/trainer/megatron_publish.py) reuse `init_distributed` and `build_model`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from refit_tools.megatron_cpu import (
    _transformer_engine_stand_in,
    build_model,
    init_distributed,
    rank_arguments,
)

__all__ = ["_transformer_engine_stand_in", "build_model", "init_distributed", "main"]


def main() -> None:
    ap = rank_arguments()
    args = ap.parse_args()

    import torch.distributed as dist
    from safetensors.torch import save_file

    rank, world = init_distributed(args.tp, args.pp)
    bridge, model = build_model(args.hf_dir, args.tp, args.pp)

    tensors: dict[str, Any] = {}
    order: list[str] = []
    for name, tensor in bridge.export_hf_weights(model, cpu=True, show_progress=False):
        order.append(name)
        tensors[name] = tensor.detach().to("cpu").contiguous().clone()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / f"rank{rank}.safetensors"))
    (out / f"rank{rank}.json").write_text(json.dumps({"order": order, "world": world}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
