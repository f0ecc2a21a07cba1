"""Decoded items compared bit for bit: metadata and op equal, values equal through their integer
views (never float equality: NaN payloads and -0.0 count), and the same positions, whether an
item names them as a range or as explicit locations."""

from __future__ import annotations

import numpy as np

from refit_sidecar.bits import int_view
from refit_sidecar.codec import Item


def same_bits(a: list[Item], b: list[Item]) -> bool:
    for x, y in zip(a, b, strict=True):
        if (x.meta, x.op) != (y.meta, y.op):
            return False
        if not np.array_equal(int_view(x.values).numpy(), int_view(y.values).numpy()):
            return False
        if not np.array_equal(positions(x), positions(y)):
            return False
    return True


def positions(item: Item) -> np.ndarray:
    """The flat indices an item writes."""
    if item.locations is not None:
        return item.locations.numpy()
    assert item.range_start is not None
    return np.arange(item.range_start, item.range_start + item.count)
