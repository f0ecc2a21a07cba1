"""The workload of `kuberefit bench refit`, rebuilt bit-identically by every process from a seed.

The producer (trainer namespace), every receiver (rollout namespace) and the driver each derive
the same synthetic canonical BF16 checkpoint from (`checkpoint_bytes`, `seed`), so no checkpoint
ever crosses a process boundary or the shaped link outside the measured transfers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from refit_protocol.tensors import TensorMetaModel
from refit_sidecar.codec.records import TensorMeta
from refit_tools.bench.synthetic import (
    FULL_SHAPE,
    QUICK_SHAPE,
    ModelShape,
    checkpoint_layout,
    iter_checkpoint,
)

MIB = 1 << 20
BF16 = torch.bfloat16
#: For the test-sized checkpoints (a few MiB) the quick shape's embedding alone is too large.
TINY_SHAPE = ModelShape(hidden=256, ffn=704, kv=64, vocab=4000)
Layout = list[tuple[str, tuple[int, ...]]]


def _minimum_bytes(shape: ModelShape) -> int:
    """Embedding, final norm, head and one layer, in BF16."""
    head = 2 * shape.vocab * shape.hidden + shape.hidden
    return 2 * (head + sum(math.prod(s) for _, s in shape.layer_tensors(0)))


class Workload(BaseModel):
    """A synthetic decoder-shaped BF16 checkpoint of at least `checkpoint_bytes`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    checkpoint_bytes: int = Field(
        default=512 * MIB,
        ge=1,
        description="Lower bound on H; whole layers are added until it is reached.",
    )
    seed: int = Field(default=0, ge=0, description="Seed of the initial weights.")
    family: Literal["decoder", "qwen3"] = Field(
        default="decoder",
        description="decoder: the synthetic decoder's tensors; qwen3: a real Qwen3 architecture "
        "(per-head q/k norms too) that vLLM serves from `hf_config()` (`bench refit --engine "
        "vllm`).",
    )

    @property
    def shape(self) -> ModelShape:
        """The largest of the bench shapes that still fits one layer into the size."""
        for shape in (FULL_SHAPE, QUICK_SHAPE, TINY_SHAPE):
            if shape is TINY_SHAPE or _minimum_bytes(shape) <= self.checkpoint_bytes:
                break
        return shape

    def layout(self) -> Layout:
        return checkpoint_layout(self.shape, self.checkpoint_bytes, qk_norm=self.family == "qwen3")

    def hf_config(self) -> dict[str, Any]:
        """config.json of the `qwen3` family: untied embeddings, grouped KV heads."""
        if self.family != "qwen3":
            raise ValueError(f"a {self.family} workload has no HF architecture")
        shape = self.shape
        layers = sum(1 for name, _ in self.layout() if name.endswith(".input_layernorm.weight"))
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": shape.hidden,
            "intermediate_size": shape.ffn,
            "num_hidden_layers": layers,
            "num_attention_heads": shape.hidden // shape.head_dim,
            "num_key_value_heads": shape.kv // shape.head_dim,
            "head_dim": shape.head_dim,
            "vocab_size": shape.vocab,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1_000_000.0,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "bos_token_id": 1,
            "eos_token_id": 2,
        }

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(name, shape, BF16) for name, shape in self.layout()]

    def meta_models(self) -> list[TensorMetaModel]:
        """What receivers prewarm with."""
        return [TensorMetaModel(name=n, shape=s, dtype="bfloat16") for n, s in self.layout()]

    @property
    def nbytes(self) -> int:
        """H: the canonical checkpoint's size in bytes."""
        return sum(2 * math.prod(s) for _, s in self.layout())

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Version 0, one tensor at a time, in export order."""
        return iter_checkpoint(self.layout(), self.seed)


#: One overwrite run of a full-checkpoint reference payload: (tensor, first flat index, count).
Run = tuple[TensorMeta, int, int]


def reference_plan(metas: list[TensorMeta], payload_bytes: int) -> list[list[Run]]:
    """Cut every element of every tensor, once, into payloads of `payload_bytes` of values.

    The driver needs only the number of payloads (a relay flush's expected count); the producer
    builds the payloads from the same plan.
    """
    payloads: list[list[Run]] = []
    current: list[Run] = []
    room = payload_bytes
    for meta in metas:
        width = meta.nbytes // max(meta.numel, 1)
        start = 0
        while start < meta.numel:
            count = min(meta.numel - start, max(room // width, 1))
            current.append((meta, start, count))
            start += count
            room -= count * width
            if room < width:
                payloads.append(current)
                current, room = [], payload_bytes
    if current:
        payloads.append(current)
    return payloads
