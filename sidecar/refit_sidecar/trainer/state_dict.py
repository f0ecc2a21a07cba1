"""`StateDictSource`: any HF-named `nn.Module` or state dict as a canonical source.

For plain PyTorch, HF Transformers, DDP or FSDP2 trainers whose parameter names already are the
HF names the rollout loads. The order is the state dict's own (module definition order), which
is the same on every rank. Tensors sharing storage (tied embeddings) are exported once, under
the first name, as `save_pretrained` does. DTensor (FSDP2) parameters: `full_tensor()` is an
all-gather over the tensor's mesh, so every rank of the mesh runs it in export order and only
the owner keeps the result (the others drop it at once); a fully replicated DTensor needs no
collective at all and is read from the owner's local copy.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import partial

import torch

from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.trainer.export import ExportEntry

StateLike = torch.nn.Module | Mapping[str, torch.Tensor]


class StateDictSource:
    """Canonical source over a module's `state_dict()` (read afresh on every pass) or a dict."""

    def __init__(self, state: StateLike, *, dedupe_shared: bool = True) -> None:
        """`dedupe_shared`: export tensors that alias an earlier one's storage only once."""
        self._state = state
        self._dedupe = dedupe_shared

    def _items(self) -> Mapping[str, torch.Tensor]:
        if isinstance(self._state, torch.nn.Module):
            return self._state.state_dict()
        return self._state

    def entries(self) -> Iterator[ExportEntry]:
        seen: set[tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]]] = set()
        for name, tensor in self._items().items():
            if self._dedupe:
                key = _alias_key(tensor)
                if key is not None and key in seen:
                    continue
                if key is not None:
                    seen.add(key)
            meta = TensorMeta(name, tuple(int(d) for d in tensor.shape), tensor.dtype)
            yield ExportEntry(meta, partial(_fetch, tensor))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    if _is_dtensor(tensor):
        return tensor.to_local()  # type: ignore[attr-defined,no-any-return]
    return tensor


def _alias_key(
    tensor: torch.Tensor,
) -> tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]] | None:
    """Identity of the memory a tensor views (None for empty tensors: nothing to alias)."""
    local = _local(tensor)
    if local.numel() == 0 or local.device.type == "meta":
        return None
    return (local.data_ptr(), local.dtype, tuple(local.shape), tuple(local.stride()))


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed support
        return False
    return isinstance(tensor, DTensor)


def _fetch(tensor: torch.Tensor, keep: bool) -> torch.Tensor | None:
    full: torch.Tensor | None = tensor if keep else None
    if _is_dtensor(tensor):
        placements = tensor.placements  # type: ignore[attr-defined]
        if all(p.is_replicate() for p in placements):
            full = tensor.to_local() if keep else None  # type: ignore[attr-defined]
        else:
            full = tensor.full_tensor()  # type: ignore[attr-defined]  # collective on the mesh
            if not keep:
                return None
    if full is None:
        return None
    # A copy, not a view of the live parameter: the chunk outlives this step of the export.
    return full.detach().to("cpu", copy=True).contiguous()
