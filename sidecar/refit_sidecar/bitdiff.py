"""Step 1 — change detection on stored bits through same-width integer views.

Float equality misses changes (0.0 == -0.0) and invents them (NaN != NaN); comparing the stored
bit patterns through an integer view of the same width finds exactly the elements a dense
refit would rewrite: signed zeros, NaN payloads and subnormals all count.
"""

from __future__ import annotations

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class UnsupportedDtypeError(TypeError):
    """The dtype has no same-width integer view (e.g. complex or sub-byte types)."""


def int_view(t: torch.Tensor) -> torch.Tensor:
    """A flat view of `t`'s stored bits as integers of the same width (no copy if contiguous)."""
    width = t.element_size()
    target = _INT_VIEW.get(width)
    if target is None or t.is_complex():
        raise UnsupportedDtypeError(f"no integer view for {t.dtype}")
    flat = t.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(target)


def changed_mask(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Boolean mask (flat) of elements whose stored bits differ between `old` and `new`."""
    if old.dtype != new.dtype or old.shape != new.shape:
        raise ValueError(
            f"cannot compare {old.dtype}{tuple(old.shape)} with {new.dtype}{tuple(new.shape)}"
        )
    return torch.ne(int_view(old), int_view(new))


def changed_locations(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Sorted int64 flat indices of the changed elements."""
    return torch.nonzero(changed_mask(old, new), as_tuple=False).reshape(-1)
