"""`MegatronBridgeSource`: Megatron Bridge's canonical HF export as a canonical source.

`bridge.export_hf_weights(model, cpu=True)` converts Megatron shards to HF tensors with TP/EP
gathers and PP broadcasts, so every policy rank must run it to the end even though only the
owner of a chunk keeps it (guide "Baseline and ownership"). QKV, gate/up, tied and MoE weights
follow Bridge's own conversion rules; no model-specific logic lives here. Nothing imports
Megatron at module level: the source only calls the bridge object it is given, and
`from_hf_pretrained` imports `megatron.bridge` when called.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch

from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.trainer.export import ExportEntry


class MegatronBridgeSource:
    """Canonical source over `bridge.export_hf_weights(model, cpu=...)` (a fresh pass per call)."""

    def __init__(
        self,
        bridge: Any,
        model: Any,
        *,
        cpu: bool = True,
        export_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """`bridge`: a Megatron Bridge `AutoBridge`; `model`: the Megatron model (chunks) it
        exports; `export_kwargs`: extra keyword arguments for `export_hf_weights`."""
        if not hasattr(bridge, "export_hf_weights"):
            raise TypeError(f"{type(bridge).__name__} has no export_hf_weights: not a bridge")
        self._bridge = bridge
        self._model = model
        self._cpu = cpu
        self._kwargs = {"show_progress": False, **(export_kwargs or {})}

    @classmethod
    def from_hf_pretrained(
        cls, hf_path: str | Path, model: Any, **kwargs: Any
    ) -> MegatronBridgeSource:
        """Build the bridge for `hf_path` (needs megatron-bridge installed; imported here)."""
        from megatron.bridge import AutoBridge

        return cls(AutoBridge.from_hf_pretrained(str(hf_path)), model, **kwargs)

    def entries(self) -> Iterator[ExportEntry]:
        exported = self._bridge.export_hf_weights(self._model, cpu=self._cpu, **self._kwargs)
        for name, tensor in exported:
            meta = TensorMeta(str(name), tuple(int(d) for d in tensor.shape), tensor.dtype)
            yield ExportEntry(meta, partial(_keep, tensor))


def _keep(tensor: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """The owner's own copy (on a CPU model Bridge may yield a view of a live parameter, and
    the chunk outlives this step of the export); non-owners drop the tensor at once."""
    return tensor.detach().to("cpu", copy=True).contiguous() if keep else None
