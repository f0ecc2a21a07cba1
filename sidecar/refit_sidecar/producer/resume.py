"""Resume rules: the source baseline and the rollout must start from the same HF weights.

Sparse refit never rebuilds a rollout baseline from an arbitrary trainer checkpoint (guide
"Baseline and ownership"): on a fresh start vLLM already holds the checkpoint, so the first
export becomes the baseline without a dense sync; on resume both sides must again hold the same
version. Only bits can prove it: per-tensor BLAKE2b-128 digests over (name, dtype, shape, stored
bits) of the first export are compared with the checkpoint the rollout engines were started
from, or with the baseline a surviving sidecar still holds. A mismatch is refused with the
names that differ, never repaired silently.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from safetensors import safe_open

from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.fingerprint import named_tensors_digest
from refit_sidecar.trainer.errors import FingerprintMismatchError


def tensor_digest(name: str, tensor: torch.Tensor) -> str:
    """Digest of one canonical tensor: name, dtype, shape and stored bits."""
    return named_tensors_digest([(name, tensor)])


def bits_digest(meta: TensorMeta, bits: npt.NDArray[np.generic]) -> str:
    """`tensor_digest` of stored bits held as a flat integer view (the baseline's storage)."""
    values = torch.from_numpy(np.array(bits, copy=True)).view(meta.dtype).reshape(meta.shape)
    return tensor_digest(meta.name, values)


def combined(digests: Mapping[str, str]) -> str:
    """One digest over a set of per-tensor digests (order independent)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(digests):
        h.update(f"{name}={digests[name]};".encode())
    return h.hexdigest()


def checkpoint_files(directory: Path) -> dict[str, Path]:
    """Which safetensors file of an HF checkpoint directory holds each tensor."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {directory}")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            out.update((name, f) for name in fh.keys())  # noqa: SIM118 - not a dict
    return out


#: A safetensors header larger than this is not one (real headers are kilobytes to a few MB).
MAX_HEADER_BYTES = 100 << 20


def checkpoint_nbytes(directory: Path) -> int:
    """H of an HF checkpoint: the bytes of every tensor, from the safetensors headers alone
    (each tensor's data_offsets, whatever its dtype)."""
    total = 0
    for file in sorted(set(checkpoint_files(directory).values())):
        with file.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            if size > MAX_HEADER_BYTES:
                raise ValueError(f"{file}: a {size}-byte safetensors header is not plausible")
            header = json.loads(fh.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                total += int(end) - int(start)
    return total


def checkpoint_digests(directory: Path, names: Iterable[str]) -> dict[str, str | None]:
    """Per-tensor digests of `names` in an HF checkpoint (None: the checkpoint lacks it)."""
    where = checkpoint_files(directory)
    wanted = list(names)
    out: dict[str, str | None] = {n: None for n in wanted if n not in where}
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        if name in where:
            by_file.setdefault(where[name], []).append(name)
    for file, file_names in by_file.items():
        with safe_open(str(file), framework="pt") as fh:
            for name in file_names:
                out[name] = tensor_digest(name, fh.get_tensor(name))
    return out


def require_same(
    ours: Mapping[str, str], theirs: Mapping[str, str | None], *, what: str, version: int
) -> None:
    """Refuse the first export of `version` when any tensor's bits differ from `what`."""
    differ = sorted(n for n, d in ours.items() if theirs.get(n) != d)
    if not differ:
        return
    missing = [n for n in differ if theirs.get(n) is None]
    shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
    raise FingerprintMismatchError(
        f"the trainer's export of v{version} differs from {what} in {len(differ)} of "
        f"{len(ours)} tensors ({shown}"
        + (f"; {len(missing)} missing there" if missing else "")
        + "). Sparse refit needs both sides to start from the same HF weights: resume the "
        "trainer from the checkpoint the rollout holds, or restart the rollout engines "
        "(dense load) from the trainer's weights of this version."
    )
