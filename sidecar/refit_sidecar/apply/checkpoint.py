"""Dense loads from a safetensors checkpoint directory through a runtime's own `load_weights`.

Used by joining receivers (`POST /v1/restore`) and the vLLM worker extension. safetensors only:
a checkpoint is read without unpickling anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch


class _Loader(Protocol):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object: ...


def checkpoint_files(directory: str | Path) -> list[Path]:
    """The directory's `*.safetensors` files; FileNotFoundError when there are none (a wrong or
    unmounted path must fail loudly, never load nothing)."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    return files


def feed_checkpoint(model: _Loader, files: Iterable[Path]) -> set[str]:
    """Stream every tensor of `files` into `model.load_weights`; returns the names fed."""
    from safetensors import safe_open

    fed: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            names = list(fh.keys())
            model.load_weights(_tensors(fh, names))
            fed.update(names)
    return fed


def checkpoint_tensors(files: Iterable[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of `files`, one at a time (the audit holds one canonical tensor at once)."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            yield from _tensors(fh, list(fh.keys()))


def _tensors(fh: Any, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for name in names:
        yield name, fh.get_tensor(name)
