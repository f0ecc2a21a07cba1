"""Digests of stored bits: the one way KubeRefit compares weights (never float equality)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


def tensor_bits(t: torch.Tensor) -> bytes:
    """The tensor's stored bytes in logical (row-major) order, independent of strides."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def named_tensors_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """BLAKE2b-128 over (name, dtype, shape, stored bits) of every tensor, sorted by name."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(named, key=lambda kv: kv[0]):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(tensor_bits(t))
    return h.hexdigest()


def module_fingerprint(module: torch.nn.Module) -> str:
    """Digest of every parameter and buffer bit of `module` (Proposition 1's `bits`)."""
    tensors: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(("buffer:" + n, b) for n, b in module.named_buffers(remove_duplicate=False))
    return named_tensors_digest(tensors.items())
