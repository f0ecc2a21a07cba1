"""Which storages belong to the model: parameters and buffers, found by storage identity."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch


def storage_key(t: torch.Tensor) -> int:
    """Identity of the memory behind `t`: every view of a tensor (any offset) shares it."""
    return int(t.untyped_storage().data_ptr())


@dataclass
class ModelStorages:
    """Parameter/buffer storage keys and the names that live in each storage."""

    names_by_key: dict[int, list[str]] = field(default_factory=dict)
    key_by_name: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, named: Iterable[tuple[str, torch.Tensor]]) -> ModelStorages:
        out = cls()
        for name, t in named:
            if t.numel() == 0 or t.device.type == "meta":
                continue  # nothing a copy could write into
            key = storage_key(t)
            out.names_by_key.setdefault(key, []).append(name)
            out.key_by_name[name] = key
        return out

    @classmethod
    def of_module(cls, module: torch.nn.Module) -> ModelStorages:
        named: list[tuple[str, torch.Tensor]] = list(
            module.named_parameters(remove_duplicate=False)
        )
        named += list(module.named_buffers(remove_duplicate=False))
        return cls.of(named)

    def names(self, t: torch.Tensor) -> list[str] | None:
        """Names whose storage `t` views, or None when `t` is not model storage."""
        if t.numel() == 0:
            return None  # a write of no elements cannot change any bit
        return self.names_by_key.get(storage_key(t))
