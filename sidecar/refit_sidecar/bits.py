"""Stored bits through same-width integer views: the one table of those views.

KubeRefit never compares or writes weights as floats: 0.0 == -0.0 and NaN != NaN would miss or
invent changes. Every tensor is looked at through an integer dtype of its element width (bool
as uint8), which every dtype the codec carries has.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

#: torch dtype of the same-width integer view, by element width in bytes.
TORCH_INT_VIEW: dict[int, torch.dtype] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}
#: numpy twin of `TORCH_INT_VIEW`.
NP_INT_VIEW: dict[int, np.dtype[np.generic]] = {
    w: np.dtype(str(dt).removeprefix("torch.")) for w, dt in TORCH_INT_VIEW.items()
}


class UnsupportedDtypeError(TypeError):
    """The dtype has no same-width integer view (e.g. complex or sub-byte types)."""


def int_dtype(t: torch.Tensor) -> torch.dtype:
    """The integer dtype `t`'s stored bits are viewed as (bool as uint8)."""
    target = TORCH_INT_VIEW.get(t.element_size())
    if target is None or t.is_complex():
        raise UnsupportedDtypeError(f"no integer view for {t.dtype}")
    return target


def int_view(t: torch.Tensor) -> torch.Tensor:
    """A flat view of `t`'s stored bits as integers of the same width (no copy if contiguous)."""
    target = int_dtype(t)
    flat = t.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(target)


def bits_numpy(t: torch.Tensor) -> npt.NDArray[np.generic]:
    """`int_view(t)` as a numpy array sharing memory (CPU tensors only)."""
    return int_view(t.detach()).cpu().numpy()
