"""Synthetic workloads of the codec benchmark: a transformer-shaped BF16 checkpoint and updates.

The checkpoint has the tensor shapes of a small dense decoder (embedding, attention with grouped
KV heads, gated MLP, norms, output head). An update changes a uniform random subset of elements
(Bernoulli rate, drawn as geometric gaps) by a relative amplitude of about 1e-2, and forces every
selected element to change its stored bits, so the change rate is exact.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from refit_sidecar.bits import bits_numpy

BF16 = torch.bfloat16


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of the synthetic decoder."""

    hidden: int
    ffn: int
    kv: int
    vocab: int

    @property
    def head_dim(self) -> int:
        """Attention head width: 128 where the widths allow it (Qwen3's), else 64."""
        return 128 if self.hidden % 128 == 0 and self.kv % 128 == 0 else 64

    def layer_tensors(self, i: int, *, qk_norm: bool = False) -> list[tuple[str, tuple[int, ...]]]:
        """One decoder layer's tensors; `qk_norm`: Qwen3's per-head RMS norms of q and k too."""
        d, f, kv = self.hidden, self.ffn, self.kv
        p = f"model.layers.{i}."
        norms = [
            (p + "self_attn.q_norm.weight", (self.head_dim,)),
            (p + "self_attn.k_norm.weight", (self.head_dim,)),
        ]
        return [
            (p + "input_layernorm.weight", (d,)),
            (p + "self_attn.q_proj.weight", (d, d)),
            (p + "self_attn.k_proj.weight", (kv, d)),
            (p + "self_attn.v_proj.weight", (kv, d)),
            (p + "self_attn.o_proj.weight", (d, d)),
            *(norms if qk_norm else []),
            (p + "post_attention_layernorm.weight", (d,)),
            (p + "mlp.gate_proj.weight", (f, d)),
            (p + "mlp.up_proj.weight", (f, d)),
            (p + "mlp.down_proj.weight", (d, f)),
        ]


FULL_SHAPE = ModelShape(hidden=2048, ffn=5632, kv=512, vocab=32000)
QUICK_SHAPE = ModelShape(hidden=1024, ffn=2816, kv=256, vocab=16000)


def checkpoint_layout(
    shape: ModelShape, min_bytes: int, *, qk_norm: bool = False
) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes in export order, with enough layers to reach `min_bytes` of BF16."""
    head = [("model.embed_tokens.weight", (shape.vocab, shape.hidden))]
    tail = [("model.norm.weight", (shape.hidden,)), ("lm_head.weight", (shape.vocab, shape.hidden))]
    fixed = sum(math.prod(s) for _, s in head + tail) * 2
    per_layer = sum(math.prod(s) for _, s in shape.layer_tensors(0, qk_norm=qk_norm)) * 2
    layers = max(1, math.ceil((min_bytes - fixed) / per_layer))
    body = [t for i in range(layers) for t in shape.layer_tensors(i, qk_norm=qk_norm)]
    return head + body + tail


def make_checkpoint(
    layout: list[tuple[str, tuple[int, ...]]], seed: int = 0
) -> list[tuple[str, torch.Tensor]]:
    """BF16 weights: N(0, 0.02) matrices, norms near 1 (values drawn directly in BF16)."""
    return list(iter_checkpoint(layout, seed))


def iter_checkpoint(
    layout: list[tuple[str, tuple[int, ...]]], seed: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """`make_checkpoint` one tensor at a time (a dense load then never holds two copies)."""
    gen = torch.Generator().manual_seed(seed)
    for name, shape in layout:
        t = torch.randn(shape, generator=gen, dtype=BF16)
        if len(shape) == 1:
            t = (t * 0.1 + 1.0).to(BF16)
        else:
            t.mul_(0.02)
        yield name, t


def perturb(
    base: list[tuple[str, torch.Tensor]], rate: float, *, amplitude: float = 1e-2, seed: int = 1
) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """A copy of `base` in which each element changes with probability `rate`.

    Returns the new tensors and the exact number of changed elements.
    """
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    out: list[tuple[str, torch.Tensor]] = []
    changed = 0
    for name, t in base:
        new = t.clone()
        n = new.numel()
        pos = _bernoulli_positions(rng, n, rate)
        if pos.size:
            idx = torch.from_numpy(pos)
            flat = new.view(-1)
            old_vals = flat[idx].float()
            noise = torch.randn(pos.size, generator=gen, dtype=torch.float32)
            upd = (old_vals * (1.0 + amplitude * noise)).to(BF16)
            bits = upd.view(torch.int16)
            same = bits == flat[idx].view(torch.int16)
            bits[same] ^= 1  # force a stored-bit change (one unit in the last place)
            flat[idx] = bits.view(BF16)
            changed += int(pos.size)
        out.append((name, new))
    return out, changed


def _bernoulli_positions(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    if rate <= 0 or n == 0:
        return np.empty(0, dtype=np.int64)
    parts: list[np.ndarray] = []
    last = -1
    while True:
        draw = int(max(n * rate * 1.1, 64))
        gaps = rng.geometric(rate, size=draw).astype(np.int64)
        pos = np.cumsum(gaps) + last
        parts.append(pos[pos < n])
        if pos[-1] >= n:
            break
        last = int(pos[-1])
    return np.concatenate(parts)


def count_changed(old: list[tuple[str, torch.Tensor]], new: list[tuple[str, torch.Tensor]]) -> int:
    """Changed elements by stored bits (a cross-check of `perturb`)."""
    return sum(
        int(np.count_nonzero(bits_numpy(a) != bits_numpy(b)))
        for (_, a), (_, b) in zip(old, new, strict=True)
    )
