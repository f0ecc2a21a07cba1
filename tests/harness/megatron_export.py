"""Real Megatron Bridge on CPU (gloo) for the test harness: build a Megatron model from an HF
checkpoint, and export it (this file's `main`).

Runs inside .venv-megatron (transformers<5), one process per rank, launched by
tests/harness/bridge.py. `main` writes the HF-named tensors the bridge yields on each rank to
`<out>/rank<r>.safetensors` plus the export order to `<out>/rank<r>.json`. Other harness scripts
(tests/sidecar/trainer/megatron_publish.py) reuse `init_distributed` and `build_model`.

CPU-only adjustments, all kept here and none in product code:
- Megatron Bridge imports `transformer_engine` (CUDA only) at module level in its PEFT modules;
  a stand-in module sits in sys.modules during that import only and is removed right after.
- `torch.cuda.current_device()` returns None (Bridge's replicated-weight loader compares a
  device index with it; None keeps tensors on CPU).
- Loading at TP>1: Bridge splits row-parallel weights with `torch.chunk(w, tp, dim=1)` and
  scatters the splits with `torch.distributed.scatter`. Those splits are non-contiguous views;
  on a GPU they are copied (`.to(cuda)`) before the NCCL scatter, on CPU `.to(cpu)` is a no-op
  and gloo's scatter sends `numel` elements from each view's data pointer as if it were
  contiguous (torch 2.13; reproduced with a bare 2-process gloo scatter of `chunk(dim=1)`
  views). Rank r then holds elements [r*cols/tp, r*cols/tp + numel) of the flattened weight
  instead of its column block, so the model is wrong and its export differs from the HF file
  exactly in o_proj and down_proj. `_contiguous_scatter` passes contiguous splits.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class _AnyAttr(type):
    """Placeholder classes whose attributes are placeholder classes too (te.ops.Sequential)."""

    def __getattr__(cls, attr: str) -> type:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _AnyAttr(attr, (), {})


def _stub_getattr(attr: str) -> type:
    if attr.startswith("__"):  # no __path__: `import transformer_engine.x.y` is an ImportError
        raise AttributeError(attr)
    return _AnyAttr(attr, (), {})


@contextlib.contextmanager
def _transformer_engine_stand_in() -> Iterator[None]:
    names = ["transformer_engine", "transformer_engine.pytorch"]
    saved = {n: sys.modules.get(n) for n in names}
    for n in names:
        stub = types.ModuleType(n)
        # Any attribute is a placeholder class (e.g. `class X(te.Linear)` at module level).
        stub.__getattr__ = _stub_getattr  # type: ignore[method-assign]
        sys.modules[n] = stub
    sys.modules["transformer_engine"].pytorch = sys.modules["transformer_engine.pytorch"]  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for n, mod in saved.items():
            if mod is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = mod


def _contiguous_scatter(mapping_cls: Any) -> None:
    """Make Bridge's TP scatter send contiguous splits (see the module docstring)."""
    original = mapping_cls.scatter_to_tp_ranks
    if getattr(original, "_kuberefit_contiguous", False):
        return

    def scatter_to_tp_ranks(self: Any, splits: Any, *args: Any, **kwargs: Any) -> Any:
        if splits is not None:
            splits = [s.contiguous() for s in splits]
        return original(self, splits, *args, **kwargs)

    scatter_to_tp_ranks._kuberefit_contiguous = True  # type: ignore[attr-defined]
    mapping_cls.scatter_to_tp_ranks = scatter_to_tp_ranks


def init_distributed(tp: int, pp: int) -> tuple[int, int]:
    """gloo process group and Megatron's model-parallel state; returns (rank, world)."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: None  # type: ignore[assignment,return-value]
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    # megatron.core first, without the stand-in, so its own feature checks see no TE.
    from megatron.core import parallel_state
    from megatron.core.models.gpt import gpt_layer_specs  # noqa: F401 - imported before the stand-in

    parallel_state.initialize_model_parallel(tp, pp)
    return rank, world


def build_model(hf_dir: str, tp: int, pp: int) -> tuple[Any, list[Any]]:
    """(bridge, model chunks) of `hf_dir` with BF16 parameters, on CPU, weights loaded."""
    import torch
    from megatron.core.transformer.enums import AttnBackend

    with _transformer_engine_stand_in():
        bridge_mod = importlib.import_module("megatron.bridge")
        gpt_provider = importlib.import_module("megatron.bridge.models.gpt_provider")
        param_mapping = importlib.import_module("megatron.bridge.models.conversion.param_mapping")
    _contiguous_scatter(param_mapping.MegatronParamMapping)

    bridge = bridge_mod.AutoBridge.from_hf_pretrained(hf_dir, torch_dtype=torch.bfloat16)
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.tensor_model_parallel_size = tp
    provider.pipeline_model_parallel_size = pp
    provider.transformer_layer_spec = gpt_provider.local_layer_spec
    provider.attention_backend = AttnBackend.local
    for flag in (
        "gradient_accumulation_fusion",
        "bias_activation_fusion",
        "bias_dropout_fusion",
        "masked_softmax_fusion",
        "persist_layer_norm",
        "apply_rope_fusion",
        "cross_entropy_loss_fusion",
    ):
        if hasattr(provider, flag):
            setattr(provider, flag, False)
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    return bridge, model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
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
