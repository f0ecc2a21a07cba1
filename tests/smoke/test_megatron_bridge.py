"""The harness's Megatron Bridge is real: its HF export equals the HF checkpoint bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from refit_sidecar.bits import int_view
from tests.harness.bridge import run_export


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (1, 2), (2, 1)])
def test_export_hf_weights_is_bit_identical(
    tp: int, pp: int, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    hf_dir = tiny_models["qwen3"]
    out = run_export(hf_dir, tmp_path / "export", tp=tp, pp=pp)
    reference = load_file(str(hf_dir / "model.safetensors"))
    exported = load_file(str(out / "rank0.safetensors"))
    order = json.loads((out / "rank0.json").read_text())["order"]

    assert sorted(exported) == sorted(reference)
    assert len(order) == len(set(order)) == len(reference)
    for name, ref in reference.items():
        got = exported[name]
        assert got.dtype == ref.dtype == torch.bfloat16, name
        assert got.shape == ref.shape, name
        assert torch.equal(int_view(got), int_view(ref)), f"{name}: stored bits differ"
