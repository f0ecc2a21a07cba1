"""Start a local vLLM engine the way KubeRefit runs it (CPU-friendly, no tokenizer, eager)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from refit_sidecar.vllm.worker_extension import EXTENSION_QUALNAME


def start_llm(model_dir: Path, *, seed: int = 0, **overrides: Any) -> Any:
    """A `vllm.LLM` on `model_dir` with the KubeRefit worker extension installed."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "dtype": "bfloat16",
        "seed": seed,
        "max_model_len": 256,
        "worker_extension_cls": EXTENSION_QUALNAME,
    }
    kwargs.update(overrides)
    tp = int(kwargs.get("tensor_parallel_size", 1))
    if tp > 1:
        # vllm-cpu binds each worker's threads to its own NUMA node unless told otherwise; on a
        # one-node machine give each rank its own core (wrapping around).
        cores = os.cpu_count() or 1
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % cores) for r in range(tp))
        )
        kwargs.setdefault("distributed_executor_backend", "mp")
    return LLM(**kwargs)


def greedy_tokens(
    llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int = 16
) -> list[list[int]]:
    """Greedy continuations of token-id prompts (temperature 0, fixed length)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
    )
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def shutdown_llm(llm: Any) -> None:
    """Stop the engine's background processes now rather than at interpreter exit."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
