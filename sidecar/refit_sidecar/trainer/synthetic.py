"""A stand-in trainer for the demo and benchmarks: real mixed-precision update arithmetic.

Weights live as FP32 master copies; each step adds a small relative update and rounds to BF16,
as a BF16 optimizer step does. Only elements whose master value crosses a BF16 rounding
boundary change their stored bits, which is why few BF16 values change per step (paper §2.2).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from refit_sidecar.bits import int_view


class SyntheticTrainer:
    """Produces successive BF16 state dicts from FP32 masters with seeded noisy updates."""

    def __init__(
        self,
        state: Mapping[str, torch.Tensor],
        *,
        relative_step: float = 1e-4,
        seed: int = 0,
    ) -> None:
        self._gen = torch.Generator().manual_seed(seed)
        self._dtypes = {n: t.dtype for n, t in state.items()}
        self._relative_step = relative_step
        # A trained model's FP32 masters are not exactly representable in BF16: start each one
        # at a random point of its rounding cell (it still rounds to the given weight), so the
        # very first step already changes a steady-state share of values.
        self._master = {n: _jittered_master(t, self._gen) for n, t in state.items()}

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


def _jittered_master(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """FP32 values spread over the rounding cell of each stored value of `t`."""
    w = t.detach().to(torch.float32)
    if not t.is_floating_point() or t.element_size() >= 4:
        return w.clone()
    bits = int_view(t.detach()).reshape(t.shape)
    gaps = []
    for step in (1, -1):  # both neighbours: the cell is asymmetric at powers of two
        gap = (bits + step).view(t.dtype).to(torch.float32).sub_(w).abs_()
        gaps.append(torch.where(torch.isfinite(gap), gap, torch.full_like(gap, float("inf"))))
    spacing = torch.minimum(gaps[0], gaps[1])
    spacing = torch.where(torch.isfinite(spacing), spacing, torch.zeros_like(spacing))
    jitter = torch.rand(w.shape, generator=gen).sub_(0.5).mul_(0.98)  # strictly inside the cell
    return w + jitter * spacing
