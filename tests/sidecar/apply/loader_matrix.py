"""A generic loader matrix: plain torch modules whose `load_weights` place canonical tensors the
way serving runtimes do (split, fused, transposed, transformed, cast, padded, skipped,
overlapping), with no model names. Used by the apply tests as the "native loader"."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn

# canonical name -> (shape, dtype)
CANONICAL: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "split.weight": ((8, 4), BF16),  # rows split over two parameters
    "q.weight": ((4, 4), BF16),  # q, k, v fused into one parameter at offsets
    "k.weight": ((2, 4), BF16),
    "v.weight": ((2, 4), BF16),
    "t.weight": ((4, 6), BF16),  # stored transposed
    "negexp.weight": ((3, 5), torch.float32),  # stored as -exp(w): a pointwise transform
    "cast.weight": ((4, 4), torch.float32),  # canonical fp32, stored bf16
    "padded.weight": ((5, 4), BF16),  # stored in a padded parameter (rows 5..7 zero-filled)
    "overlap.weight": ((6,), BF16),  # two copies whose destinations overlap
    "skip.weight": ((3, 3), BF16),  # not held on this rank: explicit native skip
    "fp8.weight": ((16, 16), FP8),  # one-byte float, plain copy
    "scale": ((4,), torch.float32),  # a buffer
    "count": ((3,), torch.int32),  # an integer buffer
    "plain.weight": ((1000,), BF16),  # identity copy
}


def canonical_random(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in CANONICAL.items():
        if dtype == torch.int32:
            out[name] = torch.randint(-1000, 1000, shape, generator=g, dtype=torch.int32)
        elif dtype == FP8:
            out[name] = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(FP8)
        else:
            out[name] = torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    return out


class MatrixModel(nn.Module):
    """Parameters in runtime layout; `load_weights` is the only way values get in."""

    def __init__(self) -> None:
        super().__init__()
        p = lambda *s, dtype=BF16: nn.Parameter(torch.zeros(*s, dtype=dtype), requires_grad=False)  # noqa: E731
        self.split_a = p(4, 4)
        self.split_b = p(4, 4)
        self.qkv = p(8, 4)
        self.t_stored = p(6, 4)
        self.negexp = p(3, 5, dtype=torch.float32)
        self.cast = p(4, 4)
        self.padded = p(8, 4)
        self.overlap = p(6)
        self.fp8 = p(16, 16, dtype=FP8)
        self.plain = p(1000)
        self.register_buffer("scale", torch.zeros(4))
        self.register_buffer("count", torch.zeros(3, dtype=torch.int32))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        for name, w in weights:
            if name == "split.weight":
                self.split_a.data.copy_(w[:4])
                self.split_b.data.copy_(w[4:])
                loaded |= {"split_a", "split_b"}
            elif name in ("q.weight", "k.weight", "v.weight"):
                offset = {"q.weight": 0, "k.weight": 4, "v.weight": 6}[name]
                self.qkv.data.narrow(0, offset, w.shape[0]).copy_(w)
                loaded.add("qkv")
            elif name == "t.weight":
                self.t_stored.data.copy_(w.t())
                loaded.add("t_stored")
            elif name == "negexp.weight":
                self.negexp.data.copy_(-torch.exp(w))
                loaded.add("negexp")
            elif name == "cast.weight":
                self.cast.data.copy_(w)  # fp32 -> bf16 inside copy_
                loaded.add("cast")
            elif name == "padded.weight":
                self.padded.data[: w.shape[0]].copy_(w)
                self.padded.data[w.shape[0] :].fill_(0)  # vLLM's padded vocabulary rows
                loaded.add("padded")
            elif name == "overlap.weight":
                self.overlap.data[0:4].copy_(w[0:4])
                self.overlap.data[2:6].copy_(w[2:6])
                loaded.add("overlap")
            elif name == "skip.weight":
                continue  # held by another rank
            elif name == "fp8.weight":
                self.fp8.data.copy_(w)
                loaded.add("fp8")
            elif name == "scale":
                self.scale.copy_(w)
                loaded.add("scale")
            elif name == "count":
                self.count.copy_(w)
                loaded.add("count")
            elif name == "plain.weight":
                self.plain.data.copy_(w)
                loaded.add("plain")
            else:
                raise KeyError(f"unknown weight {name}")
        return loaded


class FillingModel(MatrixModel):
    """A loader that zero-fills a parameter before copying: a non-copy write (must fail)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, w in weights:
            if name == "plain.weight":
                self.plain.data.fill_(0)
                self.plain.data.copy_(w)
                return {"plain"}
        return super().load_weights(weights)


class SwappingModel(MatrixModel):
    """A loader that replaces the parameter's storage instead of writing into it."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, w in weights:
            if name == "plain.weight":
                self.plain.data = w.clone()
                return {"plain"}
        return super().load_weights(weights)


class LyingModel(MatrixModel):
    """A loader that reports a name loaded but writes nothing into it."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, _ in weights:
            if name == "plain.weight":
                return {"plain"}
        return super().load_weights(weights)


class InPlaceScalingModel(MatrixModel):
    """A loader that edits its input in place before copying it (`w.mul_(2); p.copy_(w)`): the
    copy's source is still scratch, but no longer the bits that were scattered into it."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        for name, w in weights:
            if name == "plain.weight":
                w.mul_(2)
                self.plain.data.copy_(w)
                loaded.add("plain")
            else:
                loaded |= super().load_weights([(name, w)])
        return loaded
