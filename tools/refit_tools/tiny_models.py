"""Tiny random HF checkpoints (Qwen3 and Qwen3-MoE) made locally, for the demo and tests.

No hub access: configs are written out in full and weights come from a seeded random init.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

Family = Literal["qwen3", "qwen3_moe", "qwen3_tied"]

_COMMON = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_tiny_model(directory: Path, family: Family = "qwen3", *, seed: int = 0) -> Path:
    """Write config.json and model.safetensors (BF16) of a tiny random model to `directory`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model: Any
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**_COMMON))
    elif family == "qwen3_tied":  # embedding and output head shared, as in Qwen3-0.6B to 4B
        model = Qwen3ForCausalLM(Qwen3Config(**{**_COMMON, "tie_word_embeddings": True}))
    elif family == "qwen3_moe":
        cfg = Qwen3MoeConfig(
            **_COMMON,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
        model = Qwen3MoeForCausalLM(cfg)
    else:
        raise ValueError(f"unknown tiny model family {family!r}")
    # Random init with std 0.02 everywhere gives logits with some spread, so greedy decoding
    # depends on the weights (a constant-token output would hide a wrong refit).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.05)
    model.to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)
    return directory
