"""The structural limits of a canonical tensor, shared by every producer and every receiver.

An encoder refuses to write what a decoder would refuse to read, and a receiver refuses the
same metadata on its control plane (prewarm, restore), so one table serves all three
(`refit_sidecar.codec.wire.DecodeLimits` takes its defaults from here).

- `MAX_NAME_BYTES`: longest UTF-8 tensor name (HF names are well under 256 bytes).
- `MAX_NDIM`: most dimensions (HF checkpoints use at most 5 or 6).
- `MAX_NUMEL`: most elements of one tensor, 2**39 (512 Gi). A receiver holds a whole canonical
  tensor in its scratch on one device, and at one byte per element 2**39 bytes exceeds the memory
  of any single accelerator; the largest canonical tensors of today's open models have about
  2**34 elements (fused MoE expert weights), 32 times less. Any larger declared size is an
  error, never an allocation.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_NAME_BYTES = 4096
MAX_NDIM = 16
MAX_NUMEL = 1 << 39


def shown_name(name: str, most: int = 120) -> str:
    """`name` for an error message: cut after `most` characters (an over-long name is the error)."""
    return name if len(name) <= most else f"{name[:most]}... ({len(name)} characters)"


def limit_violation(name: str, shape: Sequence[int]) -> str | None:
    """Why a tensor of this name and shape exceeds the shared limits (None when it does not).

    The reason names the limit; callers prefix the tensor's name and raise their own typed
    error. Dimensions must be non-negative integers; an empty name is not checked here.
    """
    try:
        name_bytes = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "name is not valid UTF-8"
    if name_bytes > MAX_NAME_BYTES:
        return f"name is {name_bytes} bytes, more than MAX_NAME_BYTES={MAX_NAME_BYTES}"
    if len(shape) > MAX_NDIM:
        return f"{len(shape)} dimensions, more than MAX_NDIM={MAX_NDIM}"
    if any(d < 0 for d in shape):
        return f"negative dimension in shape {tuple(shape)}"
    numel = 1
    for d in shape:
        numel *= d
    if numel > MAX_NUMEL:
        return f"shape {tuple(shape)} has {numel} elements, more than MAX_NUMEL={MAX_NUMEL} (2**39)"
    if any(d > MAX_NUMEL for d in shape):  # a 0 elsewhere must not let a dimension be absurd
        return f"a dimension of shape {tuple(shape)} is larger than MAX_NUMEL={MAX_NUMEL} (2**39)"
    return None
