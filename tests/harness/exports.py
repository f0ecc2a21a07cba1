"""Synthetic trainer exports for the data plane's tests: random tensors of mixed dtypes, and
the next version made by flipping stored bits (through integer views) at a chosen rate."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from refit_sidecar.bits import int_view

Export = list[tuple[str, torch.Tensor]]


def random_export(
    n: int,
    seed: int,
    dtypes: Sequence[torch.dtype],
    shape: Callable[[int, torch.Generator], tuple[int, ...]],
    name: str = "layer.{i}.weight",
) -> Export:
    """`n` tensors named `name.format(i=i)`, tensor i of dtype `dtypes[i % len]` and shape
    `shape(i, generator)`, drawn from one generator seeded `seed` (reproducible)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        size = shape(i, gen)
        out.append((name.format(i=i), torch.randn(size, generator=gen).to(dtypes[i % len(dtypes)])))
    return out


def flip_bits(
    export: Export, seed: int, rate: float, *, xor: int = 1, keep_every: int = 0
) -> Export:
    """The next version: each stored element's bits XOR `xor` with probability `rate`; every
    `keep_every`-th tensor stays unchanged (0: none does)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, (name, t) in enumerate(export):
        new = t.clone()
        if not keep_every or i % keep_every != keep_every - 1:
            bits = int_view(new)
            bits[torch.rand(bits.shape, generator=gen) < rate] ^= xor
        out.append((name, new))
    return out
