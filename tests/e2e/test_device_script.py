"""e2e/device/apply_gpu.py, the prepared device check of the apply path, on this machine: its CPU
dry run is bit-exact and reports throughput (also with only what the device machine has: no
vLLM, ZeroMQ, pydantic, structlog, zstandard, blake3 or numba), its bit check fails on a
corrupted tensor, `--device cuda` is refused without CUDA (and runs where CUDA is), and the
wall-clock guard stops it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "e2e" / "device" / "apply_gpu.py"
#: Modules the device machine lacks (docs: .library device KINDS), blocked in the "device-like"
#: run; vllm and zmq must never be needed by the script at all.
ABSENT_ON_DEVICE = ("vllm", "zmq", "pydantic", "structlog", "zstandard", "blake3", "numba")
BLOCKING_BOOT = textwrap.dedent(
    """
    import importlib.abc, runpy, sys
    BLOCKED = set(sys.argv[1].split(","))
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
            return None
    sys.meta_path.insert(0, Block())
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
    """
)


def run_script(*args: str, blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(SCRIPT), *args]
    if blocked:
        cmd = [sys.executable, "-c", BLOCKING_BOOT, ",".join(blocked), str(SCRIPT), *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("apply_gpu_under_test", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def assert_sane_report(report: dict[str, Any], rates: tuple[float, ...]) -> None:
    assert report["completed"] is True
    assert report["bit_exact"] is True, report.get("failures")
    assert report["failures"] == []
    assert report["model"]["fp32_tensors"] > 0
    assert report["prewarm"]["xor_incompatible"] == {}
    cases = report["cases"]
    # every (rate, op) once, plus the two cases with every element checked after apply
    timed = [(c["rate"], c["op"]) for c in cases if c["check_samples"] == 0]
    assert timed == [(r, op) for r in rates for op in ("xor", "overwrite")]
    assert [(c["op"], c["check_samples"]) for c in cases[len(timed) :]] == [
        ("xor", -1),
        ("overwrite", -1),
    ]
    for c in cases:
        assert (c["bit_exact"], c["error"], c["mismatches"]) == (True, "", []), c
        assert c["items"] > 0
        assert c["values"] > 0
        assert c["values_per_s"] > 0
        assert c["canonical_gbps"] > 0
        assert c["canonical_bytes"] > 0
    assert all(c["checks"] > 0 for c in cases if c["check_samples"] == -1)
    neg = report["negative_control"]
    assert neg["ok"] is True
    assert neg["audit_found"] == [[neg["flipped_tensor"], 1]]
    assert neg["final_audit_ok"] is True


@pytest.mark.parametrize("env", ["installed", "device-like"])
def test_cpu_dry_run_is_bit_exact_and_reports_throughput(env: str, tmp_path: Path) -> None:
    blocked = ABSENT_ON_DEVICE if env == "device-like" else ()
    args = ["--device", "cpu", "--size-mib", "2", "--repeats", "2", "--rates", "0.01,0.05"]
    proc = run_script(*args, "--json", "--out", str(tmp_path), blocked=blocked)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)  # stdout holds the one JSON object, the table is on stderr
    assert json.loads((tmp_path / "apply_gpu.json").read_text()) == report
    assert_sane_report(report, (0.01, 0.05))
    assert "bit-exact: True" in proc.stderr
    serving = ("refit_sidecar.vllm", "refit_sidecar.transport")  # vLLM and ZeroMQ live there
    assert not [m for m in report["repo_modules"] if m.startswith(serving)]
    if blocked:
        assert set(report["stand_ins"]) == {"structlog", "pydantic", "refit_sidecar.codec.__init__"}
    else:
        assert report["stand_ins"] == []


def test_bit_check_counts_differing_bits_never_float_equality() -> None:
    mod = load_script()
    a = torch.randn(64, 8).to(torch.bfloat16)
    assert mod.count_differing(a, a.clone()) == 0
    b = a.clone()
    mod.int_view(b)[5, 3] ^= 1  # one low mantissa bit
    assert mod.count_differing(b, a) == 1
    zeros = torch.zeros(4, dtype=torch.bfloat16)
    assert mod.count_differing(zeros, -zeros) == 4  # -0.0 == 0.0 as floats, not as bits
    nan = torch.full((4,), float("nan"), dtype=torch.float32)
    assert mod.count_differing(nan, nan.clone()) == 0  # NaN != NaN as floats, same bits
    other_nan = nan.clone()
    mod.int_view(other_nan)[2] ^= 1  # another NaN payload
    assert mod.count_differing(other_nan, nan) == 1


def test_bit_check_names_the_corrupted_tensor_in_a_fused_parameter() -> None:
    mod = load_script()
    _, layout = mod.build_layout(1 << 20)
    state = mod.initial_state(layout, torch.device("cpu"), torch.Generator().manual_seed(0))
    got = mod.dense_reference(layout, state, torch.device("cpu"))
    want = mod.dense_reference(layout, state, torch.device("cpu"))
    assert mod.compare_bits(got, want) == []
    name = "model.layers.1.self_attn.v_proj.weight"  # the last part of a fused q/k/v
    view = mod.int_view(got.canonical_view(name))
    view[0, :3] ^= 0x40
    found = mod.compare_bits(got, want)
    assert [(m.tensor, m.parameter, m.count) for m in found] == [
        (name, "params.model__layers__1__self_attn__qkv_proj", 3)
    ]
    with pytest.raises(mod.BitMismatchError, match=rf"{name} .*: 3 of {view.numel()}") as err:
        mod.require_exact("rate 0.01 xor", found)
    assert err.value.mismatches == found
    mod.require_exact("clean", mod.compare_bits(want, want))  # no mismatch: no error


def test_device_cuda_is_refused_without_cuda_and_runs_with_it() -> None:
    if torch.cuda.is_available():  # a GPU host: the real path runs, small
        proc = run_script("--device", "cuda", "--size-mib", "16", "--repeats", "1", "--json")
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = json.loads(proc.stdout)
        assert report["info"]["device"] == "cuda"
        assert_sane_report(report, (0.01, 0.05))
        assert all(c["median_device_s"] > 0 for c in report["cases"])
        return
    proc = run_script("--device", "cuda")
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "CUDA is not available" in lines[0]
    assert "--device cpu" in lines[0]


def test_wall_clock_guard_stops_the_run(tmp_path: Path) -> None:
    proc = run_script("--device", "cpu", "--time-limit", "0.05", "--out", str(tmp_path))
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "stopped by the wall-clock guard after 0.05 s" in proc.stderr
    partial = json.loads((tmp_path / "apply_gpu.json").read_text())
    assert partial["completed"] is False
    assert partial["bit_exact"] is False
    assert partial["stopped_by"] == "time limit"


def test_help_names_every_option() -> None:
    proc = run_script("--help")
    assert proc.returncode == 0
    for option in ("--device", "--size-mib", "--rates", "--json", "--out", "--time-limit"):
        assert option in proc.stdout
