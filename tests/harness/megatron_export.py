"""Export a HF checkpoint through real Megatron Bridge on CPU (gloo), for the test harness.

Runs inside .venv-megatron (transformers<5), one process per rank, launched by
tests/harness/bridge.py. Each rank writes the HF-named tensors the bridge yields on it to
`<out>/rank<r>.safetensors` plus the export order to `<out>/rank<r>.json`.

Megatron Bridge imports `transformer_engine` (CUDA only) at module level in its PEFT modules;
a stand-in module sits in sys.modules during that import only and is removed right after.
This stays in the test harness: product code never installs such a stand-in.
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    if not torch.cuda.is_available():
        # Bridge's replicated-weight loader compares a CPU device index (None) with
        # torch.cuda.current_device(), which raises on a CPU-only torch; None keeps it on CPU.
        torch.cuda.current_device = lambda: None  # type: ignore[assignment,return-value]
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)

    # megatron.core first, without the stand-in, so its own feature checks see no TE.
    from megatron.core import parallel_state
    from megatron.core.models.gpt import gpt_layer_specs  # noqa: F401 - imported before the stand-in
    from megatron.core.transformer.enums import AttnBackend

    parallel_state.initialize_model_parallel(args.tp, args.pp)
    with _transformer_engine_stand_in():
        bridge_mod = importlib.import_module("megatron.bridge")
        gpt_provider = importlib.import_module("megatron.bridge.models.gpt_provider")

    bridge = bridge_mod.AutoBridge.from_hf_pretrained(args.hf_dir, torch_dtype=torch.bfloat16)
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.tensor_model_parallel_size = args.tp
    provider.pipeline_model_parallel_size = args.pp
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

    tensors: dict[str, torch.Tensor] = {}
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
