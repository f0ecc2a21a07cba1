"""Real Megatron Bridge on CPU (gloo): build a Megatron model from an HF checkpoint, and run a
script as one process per rank in the Megatron environment (`.venv-megatron`). The tests' harness
(tests/harness/bridge.py, megatron_export.py) and `kuberefit bench construct` share it.

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
- MoE: the fused MoE kernels and grouped GEMM need Transformer Engine and the alltoall token
  dispatcher a CUDA stream, so experts are `SequentialMLP`s dispatched by allgather, and
  `_sequential_expert_numbers` lets Bridge's EP gather parse their names. The router's gating
  function reads `te_general_gemm`, which megatron-core 0.16 binds only when TE imports: it is
  set to None, its own fallback (`torch.mm`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import subprocess
import sys
import time
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from refit_tools.local.procs import ComponentError, free_port, log_tail

#: The checkout (tools/refit_tools/megatron_cpu.py -> the repository root).
_REPO = Path(__file__).resolve().parents[2]


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


def _sequential_expert_numbers(mapping_cls: Any) -> None:
    """Let Bridge's EP gather read the expert number of a SequentialMLP parameter.

    Without grouped GEMM (Transformer Engine) experts are `SequentialMLP`s, named
    `...experts.local_experts.<E>.linear_fc1.weight`; `gather_from_ep_ranks` (bridge 0.3.1)
    parses the number after `.weight`, as in TEGroupedMLP's `linear_fc1.weight<E>`, and fails
    with `int("")`. The wrapper shows it the TEGroupedMLP spelling for the call.
    """
    original = mapping_cls.gather_from_ep_ranks
    if getattr(original, "_kuberefit_sequential", False):
        return

    def gather_from_ep_ranks(self: Any, *args: Any, **kwargs: Any) -> Any:
        name = self.megatron_param
        found = re.search(r"\.local_experts\.(\d+)\.", name)
        if found is None or re.search(r"\.(weight|bias)\d+$", name):
            return original(self, *args, **kwargs)
        self.megatron_param = f"{name}{found.group(1)}"
        try:
            return original(self, *args, **kwargs)
        finally:
            self.megatron_param = name

    gather_from_ep_ranks._kuberefit_sequential = True  # type: ignore[attr-defined]
    mapping_cls.gather_from_ep_ranks = gather_from_ep_ranks


def rank_arguments(*, tp: int = 1, pp: int = 1) -> argparse.ArgumentParser:
    """The arguments every rank script takes: the HF checkpoint, its output directory and the
    TP × PP layout (the data-parallel size is what is left of the world)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=tp)
    ap.add_argument("--pp", type=int, default=pp)
    return ap


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
        # MoE: the fused permute, grouped GEMM and router kernels need Transformer Engine
        "moe_permute_fusion",
        "moe_grouped_gemm",
        "moe_router_fusion",
    ):
        if hasattr(provider, flag):
            setattr(provider, flag, False)
    if getattr(provider, "num_moe_experts", None):
        # the default alltoall dispatcher makes a CUDA stream; allgather runs on gloo
        provider.moe_token_dispatcher_type = "allgather"  # noqa: S105 - not a secret
        _sequential_expert_numbers(param_mapping.MegatronParamMapping)
        moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
        if not hasattr(moe_utils, "te_general_gemm"):  # only bound when TE imports
            moe_utils.te_general_gemm = None  # type: ignore[attr-defined]
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    return bridge, model


def megatron_python() -> Path:
    """The interpreter of the Megatron environment (transformers<5; see the Makefile)."""
    override = os.environ.get("KUBEREFIT_MEGATRON_PYTHON")
    path = Path(override) if override else _REPO / ".venv-megatron" / "bin" / "python"
    if not path.exists():
        raise ComponentError(f"Megatron environment not found at {path}: run `make megatron-venv`")
    return path


def run_ranks(
    script: Path,
    args: Sequence[str],
    *,
    world: int,
    logs: Path,
    timeout: float = 600,
    env: Mapping[str, str] | None = None,
) -> None:
    """Run `script` as `world` gloo ranks in .venv-megatron; fails with the log tail of the
    first rank that failed or timed out (`logs/rank<r>.log`). Every rank is killed at the end."""
    port = free_port()
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for rank in range(world):
            rank_env = dict(
                os.environ,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                OMP_NUM_THREADS="1",
                PYTHONPATH=str(_REPO),
                **(env or {}),
            )
            log = logs / f"rank{rank}.log"
            with log.open("wb") as fh:
                proc = subprocess.Popen(
                    [str(megatron_python()), str(script), *args],
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=rank_env,
                    start_new_session=True,
                )
            procs.append((proc, log))
        deadline = time.monotonic() + timeout
        # Poll every rank: one that fails leaves the others blocked in a collective, so report
        # the failed rank's log at once instead of waiting for the others to time out.
        while True:
            codes = [proc.poll() for proc, _ in procs]
            failed = [(c, log) for c, (_, log) in zip(codes, procs, strict=True) if c]
            if failed:
                code, log = failed[0]
                raise ComponentError(f"{script.name} rank failed ({code}); {log}:\n{log_tail(log)}")
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                log = procs[codes.index(None)][1]
                raise ComponentError(f"{script.name} timed out; {log}:\n{log_tail(log)}")
            time.sleep(0.2)
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
