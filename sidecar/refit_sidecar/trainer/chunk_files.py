"""Chunk files: how an owned export chunk travels from the trainer process to its sidecar.

One safetensors file per chunk on a shared-memory volume. safetensors is a JSON header plus raw
little-endian bytes, so reading it never runs code (no pickle, no `torch.load`). The sidecar
treats the file as untrusted: the name must be a plain file name inside its inbox, the file a
regular file (not a symlink), and `read_header` checks the header completely (known dtypes,
sizes that match shapes, offsets that tile the data exactly, no trailing bytes) before anything
is loaded. The writer publishes a file atomically (temporary name, then rename).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from refit_protocol.tensors import SAFETENSORS_DTYPES as SAFETENSORS_TAGS
from refit_sidecar.codec import dtypes
from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.trainer.errors import ChunkFileError

SUFFIX = ".safetensors"
#: A chunk file name: no directories, no hidden files, nothing a shell or path join could twist.
FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.safetensors$")
#: Largest header accepted (a chunk of ~100k tensors has a header of a few MiB).
MAX_HEADER_BYTES = 64 << 20

#: safetensors dtype strings of the dtypes the codec carries (the protocol's one table).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    tag: dtypes.dtype_from_name(name) for tag, name in SAFETENSORS_TAGS.items()
}


#: A tensor given as changes (direct projection) travels as two entries of the chunk file: its
#: sorted int64 flat positions and their new values, under the tensor's name plus these.
POSITIONS_SUFFIX = "@positions"
VALUES_SUFFIX = "@values"


def change_keys(name: str) -> tuple[str, str]:
    """The two file entries of a tensor given as changes."""
    return name + POSITIONS_SUFFIX, name + VALUES_SUFFIX


def file_keys(names: Sequence[str], changed: Sequence[str]) -> set[str]:
    """Every entry a chunk file of `names` holds when `changed` of them are given as changes."""
    given = set(changed)
    return {n for n in names if n not in given} | {k for n in given for k in change_keys(n)}


def chunk_file_name(version: int, producer: int, index: int) -> str:
    """A fresh, unique name for chunk `index` of `version` (a retry never reuses a name)."""
    return f"v{version}-p{producer}-c{index:06d}-{secrets.token_hex(6)}{SUFFIX}"


def write_chunk_file(
    directory: Path, name: str, tensors: Sequence[tuple[str, torch.Tensor]]
) -> tuple[Path, int]:
    """Write the tensors as one safetensors file, atomically; returns the path and its size."""
    if not FILE_NAME.match(name):
        raise ChunkFileError(f"unsafe chunk file name {name!r}")
    payload = {n: _standalone(t) for n, t in tensors}
    if len(payload) != len(tensors):
        raise ChunkFileError("a chunk repeats a tensor name")
    final = directory / name
    tmp = directory / f".{name}.tmp"
    try:
        save_file(payload, str(tmp))
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final, final.stat().st_size


def _standalone(t: torch.Tensor) -> torch.Tensor:
    """safetensors refuses tensors that share memory; give views their own storage."""
    t = t.detach().to("cpu").contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def safe_path(directory: Path, name: str) -> Path:
    """`directory/name` for a plain chunk file name that is a regular file (never a link)."""
    if not FILE_NAME.match(name):
        raise ChunkFileError(f"unsafe chunk file name {name!r}: need a plain *{SUFFIX} name")
    path = directory / name
    try:
        st = os.lstat(path)
    except FileNotFoundError as exc:
        raise ChunkFileError(f"chunk file {name} is not in {directory}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise ChunkFileError(f"chunk file {name} is not a regular file")
    return path


def read_header(path: Path) -> dict[str, TensorMeta]:
    """Validate a safetensors file completely and return its tensors' metadata (file order)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        raw_len = fh.read(8)
        if len(raw_len) != 8:
            raise ChunkFileError(f"{path.name}: shorter than a safetensors header")
        header_len = int.from_bytes(raw_len, "little")
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise ChunkFileError(f"{path.name}: header length {header_len} out of bounds")
        try:
            header = json.loads(fh.read(header_len))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ChunkFileError(f"{path.name}: header is not JSON") from exc
    if not isinstance(header, dict):
        raise ChunkFileError(f"{path.name}: header is not a JSON object")
    header.pop("__metadata__", None)
    metas: dict[str, TensorMeta] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        meta, begin, end = _entry(path.name, name, info)
        metas[name] = meta
        spans.append((begin, end, name))
    spans.sort()
    cursor = 0
    for begin, end, name in spans:
        if begin != cursor:
            raise ChunkFileError(f"{path.name}: {name} does not start where the previous ends")
        cursor = end
    if 8 + header_len + cursor != size:
        raise ChunkFileError(f"{path.name}: {size} bytes, the header describes {cursor} of data")
    return metas


def _entry(file: str, name: str, info: object) -> tuple[TensorMeta, int, int]:
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise ChunkFileError(f"{file}: malformed header entry for {name!r}")
    dtype = SAFETENSORS_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        raise ChunkFileError(f"{file}: {name}: unsupported dtype {info['dtype']!r}")
    shape, offsets = info["shape"], info["data_offsets"]
    if not (isinstance(shape, list) and all(_nonneg_int(d) for d in shape)):
        raise ChunkFileError(f"{file}: {name}: bad shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_nonneg_int, offsets))):
        raise ChunkFileError(f"{file}: {name}: bad data_offsets {offsets!r}")
    meta = TensorMeta(name, tuple(shape), dtype)
    begin, end = offsets
    if end - begin != meta.numel * dtypes.width(dtype):
        raise ChunkFileError(f"{file}: {name}: data size does not match shape and dtype")
    return meta, begin, end


def _nonneg_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def load_tensors(path: Path, names: Sequence[str]) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a (validated) chunk file, in the given order."""
    with safe_open(str(path), framework="pt") as fh:
        return [(name, fh.get_tensor(name)) for name in names]
