"""MegatronBridgeSource without Megatron installed: imports nothing of Megatron, and drives any
bridge's export to the end on every rank (collectives) while only owners keep tensors."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from refit_sidecar.bits import int_view
from refit_sidecar.trainer import MegatronBridgeSource, Publisher
from refit_sidecar.trainer.export import plan_owned


class BridgeFake:
    """Yields like `export_hf_weights`: (HF name, CPU tensor), and records how far it got."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.tensors = {
            f"model.layers.{i}.self_attn.o_proj.weight": torch.randn(32, 32, generator=g).to(
                torch.bfloat16
            )
            for i in range(6)
        }
        self.yielded = 0
        self.kwargs: dict[str, Any] = {}

    def export_hf_weights(
        self, model: Any, cpu: bool, **kwargs: Any
    ) -> Iterator[tuple[str, torch.Tensor]]:
        assert model == "model-chunks"
        self.kwargs = {"cpu": cpu, **kwargs}
        for name, t in self.tensors.items():
            self.yielded += 1
            yield name, t


def test_importing_the_trainer_package_imports_no_megatron() -> None:
    code = (
        "import sys, refit_sidecar.trainer, refit_sidecar.trainer.megatron;"
        "bad=[m for m in sys.modules if m.startswith(('megatron','transformer_engine'))];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_not_a_bridge() -> None:
    with pytest.raises(TypeError, match="export_hf_weights"):
        MegatronBridgeSource(object(), "model-chunks")


def test_owned_chunks_and_full_iteration() -> None:
    bridge = BridgeFake()
    source = MegatronBridgeSource(bridge, "model-chunks")
    kept: dict[str, torch.Tensor] = {}
    for producer in (0, 1):
        bridge.yielded = 0
        for planned in plan_owned(source.entries(), 4096, producer, 2):  # two tensors a chunk
            if planned.chunk is not None:
                kept.update(planned.chunk.tensors)
        assert bridge.yielded == len(bridge.tensors)
    assert bridge.kwargs == {"cpu": True, "show_progress": False}
    assert list(kept) != []
    assert set(kept) == set(bridge.tensors)
    for name, t in kept.items():
        assert torch.equal(int_view(t), int_view(bridge.tensors[name]))
        assert t.data_ptr() != bridge.tensors[name].data_ptr()  # the owner's own copy
    bridge.yielded = 0
    Publisher.participate(source)  # a rank without a sidecar still runs the whole export
    assert bridge.yielded == len(bridge.tensors)
