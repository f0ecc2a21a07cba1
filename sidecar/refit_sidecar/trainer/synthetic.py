"""A stand-in trainer for the demo and benchmarks: real mixed-precision update arithmetic.

Weights live as FP32 master copies; each step adds a small relative update and rounds to BF16,
as a BF16 optimizer step does. Only elements whose master value crosses a BF16 rounding
boundary change their stored bits, which is why few BF16 values change per step (paper §2.2).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


class SyntheticTrainer:
    """Produces successive BF16 state dicts from FP32 masters with seeded noisy updates."""

    def __init__(
        self,
        state: Mapping[str, torch.Tensor],
        *,
        relative_step: float = 2e-4,
        seed: int = 0,
    ) -> None:
        self._master = {n: t.detach().to(torch.float32).clone() for n, t in state.items()}
        self._dtypes = {n: t.dtype for n, t in state.items()}
        self._relative_step = relative_step
        self._gen = torch.Generator().manual_seed(seed)

    def step(self) -> dict[str, torch.Tensor]:
        """One update of every master weight; returns the new weights in their stored dtype."""
        out: dict[str, torch.Tensor] = {}
        for name, master in self._master.items():
            noise = torch.randn(master.shape, generator=self._gen, dtype=torch.float32)
            # Adam-like: the step is proportional to the weight's scale, not to the gradient.
            scale = master.abs().clamp_min(1e-3) * self._relative_step
            master.add_(noise.mul_(scale))
            out[name] = master.to(self._dtypes[name])
        return out
