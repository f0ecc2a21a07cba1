"""Where a producer keeps the stored bits of the chunks it owns: a file mapping or RAM.

File-backed storage (the default) maps one file per chunk, so the page cache rather than
anonymous memory holds the baseline; it does not reduce the logical baseline bytes. Each tensor
is an integer view at a 64-byte aligned offset, ready for `bitdiff.diff_bits`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from refit_sidecar.codec import dtypes
from refit_sidecar.codec.records import TensorMeta

_ALIGN = 64


class ChunkStore:
    """The stored bits of one owned chunk, one flat integer view per tensor."""

    def __init__(self, metas: tuple[TensorMeta, ...], path: Path | None) -> None:
        offsets: list[int] = []
        end = 0
        for meta in metas:
            end += -end % _ALIGN
            offsets.append(end)
            end += meta.nbytes
        self.path = path
        self.nbytes = sum(m.nbytes for m in metas)
        buf: npt.NDArray[np.uint8]
        if path is None or end == 0:
            buf = np.zeros(end, dtype=np.uint8)
        else:
            buf = np.memmap(path, dtype=np.uint8, mode="w+", shape=(end,)).view(np.ndarray)
        self._buf: npt.NDArray[np.uint8] | None = buf
        self.views: dict[str, npt.NDArray[Any]] = {
            m.name: buf[off : off + m.nbytes].view(dtypes.np_value_dtype(m.dtype))
            for m, off in zip(metas, offsets, strict=True)
        }

    def close(self) -> None:
        """Drop the mapping and delete the backing file."""
        self.views.clear()
        self._buf = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)
