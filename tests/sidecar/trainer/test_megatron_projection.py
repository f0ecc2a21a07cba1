"""Direct projection against the export path on real Megatron Bridge (gloo, CPU), four ranks:
TP=2 × PP=2 for the tiny Qwen3 and Qwen3-MoE (experts: SequentialMLP, ETP=2, EP=1; see
refit_tools.megatron_cpu for what the MoE needs on CPU), and TP=2 × DP=2 for the tiny Qwen3
(one data-parallel replica owns each shard).

One run of tests/sidecar/trainer/megatron_project.py per layout is shared by the tests: the
identity probe of every affine row map against the bridge's own export of source ids, the
ownership of projected elements, and the records of one real AdamW step through projection plus
the residual export, compared bit for bit with the records of the export path (the dense v0 and
v1 exports diffed tensor by tensor), for `project_qkv` off (Q/K/V residual) and on.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from refit_sidecar.bits import int_view
from refit_sidecar.codec.records import Op, diff_item
from tests.harness.bridge import run_ranks

SCRIPT = Path(__file__).with_name("megatron_project.py")
WORLD = 4
#: (model, TP, PP); the data-parallel size is what is left of the four ranks.
LAYOUTS = [("qwen3", 2, 2), ("qwen3_moe", 2, 2), ("qwen3", 2, 1)]
SETTINGS = ("default", "qkv")
QKV = ("q_proj", "k_proj", "v_proj")


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda p: f"{p[0]}-tp{p[1]}-pp{p[2]}")
def run(
    request: pytest.FixtureRequest,
    tiny_models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    model, tp, pp = request.param
    out = tmp_path_factory.mktemp(f"projection-{model}-tp{tp}-pp{pp}")
    args = [f"--hf-dir={tiny_models[model]}", f"--out={out}", f"--tp={tp}", f"--pp={pp}"]
    run_ranks(SCRIPT, args, world=WORLD, logs=out, timeout=600)
    return out


def _reports(run: Path) -> list[dict[str, Any]]:
    return [json.loads((run / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _items(run: Path, setting: str) -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]:
    """Every rank's items of `setting`, merged per (name, op) and sorted by position."""
    parts: dict[tuple[str, str], list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
    for r in range(WORLD):
        flat = load_file(str(run / f"rank{r}-{setting}.safetensors"))
        for key in flat:
            if key.endswith("|loc"):
                name, op, _ = key[: -len("|loc")].rsplit("|", 2)
                parts[(name, op)].append((flat[key], flat[key[: -len("loc")] + "val"]))
    merged = {}
    for key, pieces in parts.items():
        loc = torch.cat([p[0] for p in pieces]).numpy()
        val = torch.cat([p[1] for p in pieces]).numpy()
        order = np.argsort(loc, kind="stable")
        merged[key] = (loc[order], val[order])
    return merged


def test_the_identity_probe_finds_every_row_where_its_map_says(run: Path) -> None:
    reports = _reports(run)
    for report in reports:
        assert report["param_elements_changed"] > 0, report
        for setting in SETTINGS:
            assert report[setting]["probe_failures"] == [], (setting, report[setting])
    default, qkv = reports[0]["default"], reports[0]["qkv"]
    print(f"\n[projection] {run.name}: {default['coverage']}\n[projection] {qkv['coverage']}")
    assert default["residual"] == ["fused Q/K/V (project_qkv off)"], default
    assert 0.8 < default["coverage_fraction"] < 0.9, default
    assert qkv["residual"] == [], qkv
    assert qkv["coverage_fraction"] == 1.0, qkv
    assert all(r[s]["coverage"] == reports[0][s]["coverage"] for r in reports for s in SETTINGS)


@pytest.mark.parametrize("setting", SETTINGS)
def test_owned_shards_cover_each_projected_element_exactly_once(run: Path, setting: str) -> None:
    v0 = load_file(str(run / "v0.safetensors"))
    positions: dict[str, list[torch.Tensor]] = defaultdict(list)
    for r in range(WORLD):
        for key, where in load_file(str(run / f"rank{r}-{setting}-positions.safetensors")).items():
            positions[key.rsplit("|", 1)[0]].append(where)
    for name, pieces in positions.items():
        got = torch.sort(torch.cat(pieces)).values
        assert torch.equal(got, torch.arange(v0[name].numel())), name
    residual = set(v0) - set(positions)
    want = {n for n in v0 if any(q in n for q in QKV)} if setting == "default" else set()
    assert residual == want


@pytest.mark.parametrize("setting", SETTINGS)
def test_projected_and_residual_records_equal_the_export_paths(run: Path, setting: str) -> None:
    """Same names, same positions, same XOR masks and new bits as diffing the dense exports;
    applied to v0 they give the dense v1 bit for bit."""
    v0 = load_file(str(run / "v0.safetensors"))
    v1 = load_file(str(run / "v1.safetensors"))
    items = _items(run, setting)
    for op in (Op.XOR, Op.OVERWRITE):
        want = {}
        for name in v0:
            item = diff_item(name, v0[name], v1[name], op)
            if item is not None:
                idx = item.index()
                loc = torch.arange(idx.start, idx.stop) if isinstance(idx, slice) else idx
                want[name] = (loc.numpy(), item.values.numpy())
        got = {name: v for (name, o), v in items.items() if o == op.name}
        assert set(got) == set(want), sorted(set(got) ^ set(want))
        for name, (loc, val) in want.items():
            assert np.array_equal(got[name][0], loc), name
            assert np.array_equal(got[name][1], val), name
    if setting == "default":  # the residual path caught the changes of Q/K/V
        assert {n for n, _ in items if any(q in n for q in QKV)}
    for name, tensor in v0.items():
        applied = int_view(tensor.clone())
        if (name, "XOR") in items:
            loc, val = items[(name, "XOR")]
            applied[torch.from_numpy(loc)] ^= torch.from_numpy(val)
        assert torch.equal(applied, int_view(v1[name])), name
