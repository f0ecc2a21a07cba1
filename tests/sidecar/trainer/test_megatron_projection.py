"""Direct projection against the export path on real Megatron Bridge (gloo, CPU), four ranks:
TP=2 × PP=2 for the tiny Qwen3 and Qwen3-MoE (experts: SequentialMLP, ETP=2, EP=1; see
refit_tools.megatron_cpu for what the MoE needs on CPU), and TP=2 × DP=2 for a tiny Qwen3 with
tied embeddings (one data-parallel replica owns each shard; the shared embedding is residual).
Tied embeddings at PP > 1 need CUDA in Megatron-Core (the first and last stages all-reduce the
copy on the device), hence DP for that model.

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
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from refit_sidecar.bits import int_view
from refit_sidecar.codec.records import Op, diff_item
from refit_sidecar.trainer import megatron_projection as mp
from refit_tools.tiny_models import write_tiny_model
from tests.harness.bridge import run_ranks

SCRIPT = Path(__file__).with_name("megatron_project.py")
WORLD = 4
#: (model, TP, PP); the data-parallel size is what is left of the four ranks.
LAYOUTS = [("qwen3", 2, 2), ("qwen3_moe", 2, 2), ("qwen3_tied", 2, 1)]
SETTINGS = ("default", "qkv")
QKV = ("q_proj", "k_proj", "v_proj")
QKV_REASON = "fused Q/K/V (project_qkv off)"
TIED_REASON = "tied embeddings (two canonical names)"


def _tied(run: Path) -> bool:
    return "qwen3_tied" in run.name


def _residual_names(run: Path, names: set[str], setting: str) -> set[str]:
    """What must take the residual path: Q/K/V with project_qkv off, a shared embedding."""
    want = {n for n in names if any(q in n for q in QKV)} if setting == "default" else set()
    return want | ({"model.embed_tokens.weight"} if _tied(run) else set())


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda p: f"{p[0]}-tp{p[1]}-pp{p[2]}")
def run(
    request: pytest.FixtureRequest,
    tiny_models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    model, tp, pp = request.param
    out = tmp_path_factory.mktemp(f"projection-{model}-tp{tp}-pp{pp}")
    if model == "qwen3_tied":
        hf_dir = write_tiny_model(tmp_path_factory.mktemp("tied"), "qwen3_tied", seed=1)
    else:
        hf_dir = tiny_models[model]
    args = [f"--hf-dir={hf_dir}", f"--out={out}", f"--tp={tp}", f"--pp={pp}"]
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
    tied = [TIED_REASON] if _tied(run) else []
    assert default["residual"] == sorted([QKV_REASON, *tied]), default
    assert qkv["residual"] == tied, qkv
    assert 0.6 < default["coverage_fraction"] < qkv["coverage_fraction"] <= 1.0
    assert (qkv["coverage_fraction"] == 1.0) is not _tied(run), qkv
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
    assert set(v0) - set(positions) == _residual_names(run, set(v0), setting)


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
    if _tied(run):  # and those of the shared embedding
        assert ("model.embed_tokens.weight", "XOR") in items
    for name, tensor in v0.items():
        applied = int_view(tensor.clone())
        if (name, "XOR") in items:
            loc, val = items[(name, "XOR")]
            applied[torch.from_numpy(loc)] ^= torch.from_numpy(val)
        assert torch.equal(applied, int_view(v1[name])), name


# The plan's rules, without Megatron: stand-in tasks (`fake_task`) reach the branches the tiny
# models cannot (FP8 and integer parameters, permuted dimensions, an output gate, expert layouts
# other than ETP = TP at EP = 1, classes the bridge does not ship).


def fake_task(
    cls_name: str,
    *,
    shape: tuple[int, ...] = (4, 6),
    dtype: torch.dtype = torch.bfloat16,
    module: str = mp._MAPPINGS,
    detected: str = "column",
    **attrs: Any,
) -> Any:
    """A conversion task whose mapping class is named `cls_name` in `module`."""
    mapping_cls = type(cls_name, (), {"__module__": module})
    mapping = mapping_cls()
    mapping.tp_rank, mapping.tp_size, mapping.ep_size, mapping.is_expert = 0, 2, 1, False
    mapping.hf_param = "w"
    mapping.permute_dims = None
    mapping._detect_parallelism_type = lambda module: detected
    for k, v in attrs.items():
        setattr(mapping, k, v)
    param = torch.zeros(shape, dtype=dtype)
    return SimpleNamespace(
        mapping=mapping, param_weight=param, megatron_module=None, global_param_name="decoder.w"
    )


def _ctx(**changes: Any) -> Any:
    config = SimpleNamespace(num_attention_heads=4, num_query_groups=2, kv_channels=2)
    base = {"config": config, "project_qkv": False, "tied": False, "tp_size": 2, "whole": None}
    return mp._Context(**{**base, **changes})


@pytest.mark.parametrize(
    ("task", "ctx", "reason"),
    [
        (fake_task("AutoMapping", permute_dims=(1, 0)), {}, "permuted dimensions"),
        (fake_task("AutoMapping", dtype=torch.int32), {}, "torch.int32 Tensor parameters"),
        (fake_task("AutoMapping", detected="diagonal"), {}, "parallelism 'diagonal' not known"),
        (fake_task("ColumnParallelMapping", module="my.bridge"), {}, "not a known row move"),
        (fake_task("RMSNorm2ZeroCenteredRMSNormMapping"), {}, "not a known row move"),
        (fake_task("QKVMapping"), {}, "fused Q/K/V (project_qkv off)"),
        (fake_task("AutoMapping", is_expert=True, ep_size=2), {}, "expert parallelism > 1"),
        (fake_task("AutoMapping", is_expert=True, tp_size=1), {}, "expert tensor parallelism"),
        (fake_task("ColumnParallelMapping"), {"tied": True}, None),
        (fake_task("ColumnParallelMapping"), {"whole": "adapters are merged"}, "adapters"),
        (
            fake_task("GatedMLPMapping", shape=(3, 6), hf_param={"gate": "g", "up": "u"}),
            {},
            "layout not projected",
        ),
    ],
)
def test_tasks_that_are_not_a_proven_row_move_are_residual(
    task: Any, ctx: dict[str, Any], reason: str | None
) -> None:
    if reason is None:  # tied: the embedding's name decides
        task.global_param_name = "embedding.word_embeddings.weight"
        reason = "tied embeddings"
    kind, got, rowmap = mp._classify(task, _ctx(**ctx))
    assert kind is None
    assert rowmap is None
    assert got is not None
    assert reason in got


def test_qkv_with_an_output_gate_stays_residual_even_when_projected() -> None:
    ctx = _ctx(project_qkv=True)
    task = fake_task("QKVMapping", shape=(8, 6), hf_param={"q": "q", "k": "k", "v": "v"})
    assert mp._classify(task, ctx)[0] == "qkv"
    ctx.config.attention_output_gate = True
    assert mp._classify(task, ctx)[1] == "fused Q/K/V with an output gate"


def test_a_one_dimensional_row_bias_is_owned_like_a_replicated_tensor() -> None:
    task = fake_task("AutoMapping", shape=(6,), detected="row")
    kind, reason, rowmap = mp._classify(task, _ctx())
    assert (kind, reason) == ("replicated", None)
    assert rowmap is not None
    assert rowmap.dests[0].shape == (6,)


def test_the_plan_is_merged_across_ranks() -> None:
    task = SimpleNamespace(global_param_name="decoder.w")
    seen = [{0: ("column", None, 96)}, {0: ("column", None, 96)}, {}]
    assert mp._merge(0, task, seen) == mp.TaskPlan(0, "decoder.w", "column", None, 96)
    seen[2] = {0: (None, "permuted dimensions", 96)}
    assert mp._merge(0, task, seen).reason == "permuted dimensions"
    seen[2] = {0: ("row", None, 96)}
    assert mp._merge(0, task, seen).reason == "ranks disagree on the layout (['column', 'row'])"
    assert mp._merge(0, task, [{}, {}]).reason == "held by no rank"
    # a reason a change flag may not skip wins over one it may (it sorts first otherwise)
    seen = [{0: (None, "fused Q/K/V (project_qkv off)", 96)}, {0: (None, "not classified", 96)}]
    assert mp._merge(0, task, seen).reason == "not classified"
    assert not mp._merge(0, task, seen).param_only
    assert mp._merge(3, None, seen).reason == "no mapping for this parameter"


def test_tied_embeddings_are_read_from_the_config_then_the_unwrapped_model() -> None:
    inner = SimpleNamespace(share_embeddings_and_output_weights=True)
    wrapped = [SimpleNamespace(module=SimpleNamespace(module=inner))]
    assert mp._tied(SimpleNamespace(share_embeddings_and_output_weights=None), wrapped)
    assert not mp._tied(SimpleNamespace(share_embeddings_and_output_weights=False), wrapped)
    assert not mp._tied(SimpleNamespace(), [SimpleNamespace()])


def test_the_coverage_line() -> None:
    cov = mp.Coverage({"column": 600, "row": 150}, {"fused Q/K/V (project_qkv off)": 250})
    assert cov.fraction == 0.75
    assert cov.line() == (
        "projected 75.0% of 1000 canonical bytes (column 60.0%, row 15.0%); "
        "residual: fused Q/K/V (project_qkv off) 25.0%"
    )


@pytest.mark.parametrize(
    ("task", "ctx", "flagged"),
    [
        (fake_task("QKVMapping"), {}, True),  # split into q, k, v: its parameter alone
        (fake_task("AutoMapping", permute_dims=(1, 0)), {}, True),
        (fake_task("AutoMapping", is_expert=True, ep_size=2), {}, True),  # gathered over EP
        (fake_task("QKVMapping", dtype=torch.int8), {}, False),  # scales live elsewhere
        (fake_task("RMSNorm2ZeroCenteredRMSNormMapping"), {}, False),  # unknown arithmetic
        (fake_task("QKVMapping"), {"whole": "MyBridge changes converted weights"}, False),
    ],
)
def test_change_flags_may_skip_only_tasks_whose_outputs_follow_their_parameter(
    task: Any, ctx: dict[str, Any], flagged: bool
) -> None:
    _, reason, _ = mp._classify(task, _ctx(**ctx))
    assert mp.TaskPlan(0, "decoder.w", None, reason, 48).param_only is flagged
    assert not mp.TaskPlan(0, "decoder.w", "column", None, 48).param_only
