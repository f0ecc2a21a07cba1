"""Chunks given as changes (direct projection): the candidate tensor is the committed baseline
with the changed elements overwritten, rebuilt here so that everything after staging (the delta,
fingerprints, the overwrite retry, dense restore) works from whole tensors as before.

A projecting trainer (`trainer.projected`) sends each tensor it projected as two entries of the
chunk file, its sorted flat positions and their new values (`chunk_files.change_keys`). The file
is untrusted: the header must hold exactly the expected entries, positions an int64 vector and
values a vector of the tensor's dtype of the same length, no longer than the tensor (checked
before anything is loaded); then the positions must increase strictly and stay inside it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from refit_sidecar.bits import int_view
from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.trainer.chunk_files import change_keys, file_keys
from refit_sidecar.trainer.errors import ChunkFileError

#: A tensor's committed stored bits (flat, read-only): the producer baseline's `stored_bits`.
CommittedBits = Callable[[str], npt.NDArray[np.generic]]


def chunk_metas(
    index: int,
    header: Mapping[str, TensorMeta],
    names: Sequence[str],
    changed: Sequence[str],
    expected: tuple[TensorMeta, ...] | None,
) -> tuple[TensorMeta, ...]:
    """The chunk's tensors in `names` order: from the header for whole tensors, from the
    baseline's chunk for changed ones, whose two entries are checked against it here."""
    given = set(changed)
    if len(given) != len(changed) or not given <= set(names):
        raise ChunkFileError(f"chunk {index}: the changed tensors must be distinct chunk tensors")
    keys = file_keys(names, changed)
    if len(keys) != len(names) + len(given):
        raise ChunkFileError(f"chunk {index}: a tensor's name collides with a change's entry")
    if set(header) != keys:
        raise ChunkFileError(
            f"chunk {index}: the file holds {sorted(header)[:5]}..., the request names "
            f"{list(names)[:5]}... ({len(given)} as changes)"
        )
    if not given:
        return tuple(header[n] for n in names)
    if expected is None:
        raise ChunkFileError(
            f"chunk {index}: changes need a committed baseline; the first export sends whole "
            "tensors"
        )
    baseline = {m.name: m for m in expected}
    metas = []
    for name in names:
        if name not in given:
            metas.append(header[name])
            continue
        meta = baseline.get(name)
        if meta is None:
            raise ChunkFileError(f"chunk {index}: {name} is not in the baseline's chunk")
        positions, values = (header[k] for k in change_keys(name))
        if positions.dtype != torch.int64 or len(positions.shape) != 1:
            raise ChunkFileError(f"chunk {index}: {name}: positions must be a 1-D int64 vector")
        if values.dtype != meta.dtype or values.shape != positions.shape:
            raise ChunkFileError(
                f"chunk {index}: {name}: values must be {positions.shape[0]} {meta.dtype} "
                f"elements, got {list(values.shape)} {values.dtype}"
            )
        if positions.shape[0] > meta.numel:
            raise ChunkFileError(f"chunk {index}: {name}: more changes than elements")
        metas.append(meta)
    return tuple(metas)


def rebuild(
    path: Path, metas: Sequence[TensorMeta], changed: Sequence[str], committed: CommittedBits
) -> None:
    """Rewrite the chunk file at `path` with whole tensors: each changed one is a copy of its
    committed bits with the given elements overwritten. Leaves `path` as it was on error."""
    given = set(changed)
    if not given:
        return
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as fh:  # one header parse for the whole chunk
        for meta in metas:
            if meta.name not in given:
                out[meta.name] = fh.get_tensor(meta.name)
                continue
            positions, values = (fh.get_tensor(k) for k in change_keys(meta.name))
            _check_positions(meta, positions)
            out[meta.name] = _overwritten(meta, committed, positions, int_view(values))
    tmp = path.with_name(f".{path.name}.whole")
    try:
        save_file(out, str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _overwritten(
    meta: TensorMeta, committed: CommittedBits, positions: torch.Tensor, lanes: torch.Tensor
) -> torch.Tensor:
    """A copy of the tensor's committed bits with `lanes` written at `positions`."""
    try:
        bits = np.array(committed(meta.name), copy=True)  # never the store itself
    except KeyError as exc:
        raise ChunkFileError(f"{meta.name} is not in this producer's baseline") from exc
    if bits.size != meta.numel or bits.dtype.itemsize != lanes.element_size():
        raise ChunkFileError(f"{meta.name}: the baseline holds {bits.size} {bits.dtype} lanes")
    tensor = torch.from_numpy(bits)
    tensor[positions] = lanes.to(tensor.dtype)  # same width: the conversion keeps the bits
    return tensor.view(meta.dtype).reshape(meta.shape)


def _check_positions(meta: TensorMeta, positions: torch.Tensor) -> None:
    if positions.numel() == 0:
        return
    if int(positions[0]) < 0 or int(positions[-1]) >= meta.numel:
        raise ChunkFileError(f"{meta.name}: a position is outside its {meta.numel} elements")
    if positions.numel() > 1 and not bool(torch.all(positions[1:] > positions[:-1])):
        raise ChunkFileError(f"{meta.name}: positions must increase strictly")
