"""`kuberefit bench construct` on a small Qwen3-shaped model, TP=2 (two real Megatron ranks):
both paths run to the end and find the same changes (the bench fails otherwise), and the report
and its result file carry every documented figure."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from refit_protocol.kit.cli import build
from refit_tools.bench.construct import write_checkpoint
from refit_tools.bench.construct_rank import fold


def test_the_checkpoint_has_layers_pp_divides(tmp_path: Path) -> None:
    workload = write_checkpoint(tmp_path / "m", 8 << 20, layers_multiple=4)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["num_hidden_layers"] % 4 == 0
    assert config["num_hidden_layers"] == workload.hf_config()["num_hidden_layers"]
    assert (tmp_path / "m" / "model.safetensors").stat().st_size > workload.nbytes


def test_bench_construct_compares_both_paths(tmp_path: Path) -> None:
    args = ["bench", "construct", "--quick", "--checkpoint-mib=8", "--tp=2", "--pp=1"]
    args += [f"--results-dir={tmp_path / 'results'}", f"--workdir={tmp_path}", "--json"]
    result = CliRunner().invoke(build(), args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["layout"] == {"tp": 2, "pp": 1}
    assert 0.5 < report["affine_fraction"] < 1, report["coverage"]
    assert "residual: fused Q/K/V (project_qkv off)" in report["coverage"]
    (row,) = report["rates"]
    assert row["rate"] == pytest.approx(0.03)
    assert row["export_changed"] == row["project_changed"] > 0
    for key in ("export_s", "project_s", "export_peak_mib", "project_peak_mib", "speedup"):
        assert row[key] > 0, key
    (written,) = report["files"]
    assert json.loads(Path(written).read_text())["rates"] == report["rates"]


def test_bad_rates_are_refused() -> None:
    result = CliRunner().invoke(build(), ["bench", "construct", "--rates=3,x"])
    assert result.exit_code == 2
    assert "not a list of numbers" in result.output
    result = CliRunner().invoke(build(), ["bench", "construct", "--rates=0"])
    assert result.exit_code == 2
    assert "(0, 100)" in result.output


def test_a_missing_megatron_environment_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBEREFIT_MEGATRON_PYTHON", "/nonexistent/python")
    result = CliRunner().invoke(build(), ["bench", "construct", "--checkpoint-mib=8"])
    assert result.exit_code == 1
    assert "Megatron environment not found at /nonexistent/python" in result.output
    assert "make megatron-venv" in result.output


def test_the_digest_adds_up_over_parts_and_sees_every_element() -> None:
    where = np.array([3, 7, 8, 100], np.int64)
    bits = np.array([1, -2, 3, 4], np.int16)
    whole = fold("w", where, bits)
    assert (fold("w", where[:2], bits[:2]) + fold("w", where[2:], bits[2:])) % (1 << 64) == whole
    assert fold("w", where[::-1], bits[::-1]) == whole
    assert fold("v", where, bits) != whole
    assert fold("w", where + np.array([0, 0, 0, 1]), bits) != whole
    assert fold("w", where, bits ^ np.array([0, 0, 1, 0], np.int16)) != whole
