"""Model states for the producer tests: a seeded BF16 state, a step that flips ~5% of its bits,
and a dense replay of payloads that the tests compare with the target through integer views."""

from __future__ import annotations

import torch

from refit_sidecar.bits import int_view
from refit_sidecar.codec import EncodedPayload, apply_item_, decode_payload


def state(seed: int) -> dict[str, torch.Tensor]:
    """Eight 64x64 BF16 tensors drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    return {
        f"layer{i}.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16) for i in range(8)
    }


def bump(s: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """`s` with the lowest bit of ~5% of its values flipped (a sparse step, like training's)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in s.items():
        v = int_view(t).clone()
        pick = torch.rand(v.shape, generator=g) < 0.05
        v[pick] ^= 1
        out[n] = v.view(torch.bfloat16).reshape(t.shape)
    return out


def replay(old: dict[str, torch.Tensor], payloads: list[EncodedPayload]) -> dict[str, torch.Tensor]:
    """`old` with every payload's items applied, as a receiver would."""
    out = {n: t.clone() for n, t in old.items()}
    for p in payloads:
        for item in decode_payload(p.body).items:
            apply_item_(out[item.meta.name], item)
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether `a` and `b` hold the same bits, compared through integer views."""
    return all(torch.equal(int_view(a[n]), int_view(b[n])) for n in a)
