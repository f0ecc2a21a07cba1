"""Canonical metadata (name, shape, dtype) of a safetensors checkpoint, read from its headers.

The coordinator prewarms joining receivers with it. A safetensors file starts with a little-endian
u64 header length and a JSON header, so no tensor bytes are read and torch is not needed.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from pydantic import ValidationError

from refit_protocol.tensors import SAFETENSORS_DTYPES, TensorMetaModel

#: Headers larger than this are refused (the format's own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000


class CheckpointMetaError(ValueError):
    """The directory holds no readable safetensors checkpoint."""


def read_metas(checkpoint_dir: str | Path) -> list[TensorMetaModel]:
    """Every tensor of every `*.safetensors` file in the directory, sorted by name."""
    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    if not files:
        raise CheckpointMetaError(f"no *.safetensors files in {checkpoint_dir}")
    metas: dict[str, TensorMetaModel] = {}
    for f in files:
        for meta in _file_metas(f):
            if meta.name in metas:
                raise CheckpointMetaError(f"{meta.name} appears in two files of {checkpoint_dir}")
            metas[meta.name] = meta
    return [metas[n] for n in sorted(metas)]


def _file_metas(path: Path) -> list[TensorMetaModel]:
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise CheckpointMetaError(f"{path}: truncated safetensors header")
        (size,) = struct.unpack("<Q", head)
        if size > MAX_HEADER_BYTES:
            raise CheckpointMetaError(f"{path}: header of {size} bytes is too large")
        raw = fh.read(size)
    if len(raw) != size:
        raise CheckpointMetaError(f"{path}: truncated safetensors header")
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise CheckpointMetaError(f"{path}: header is not JSON: {exc}") from exc
    out: list[TensorMetaModel] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(str(info.get("dtype")))
        if dtype is None:
            raise CheckpointMetaError(f"{path}: {name} has unsupported dtype {info.get('dtype')}")
        try:
            out.append(TensorMetaModel(name=name, shape=tuple(info["shape"]), dtype=dtype))
        except (ValidationError, TypeError) as exc:
            raise CheckpointMetaError(f"{path}: {name} cannot be carried: {exc}") from None
    return out
