"""`kuberefit plan` through click: help for every input, clear errors (exit 2) for bad ones, the
JSON and table outputs, the plot, the size sources and --calibrate."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from refit_tools.plan import calibration as cal
from refit_tools.plan import sizing
from refit_tools.plan.command import plan
from refit_tools.plan.units import parse_change_rate, parse_rate, parse_size

REPO = Path(__file__).resolve().parents[3]
BASE = ["--model-bytes", "1TB", "--cross-link", "10Gbit/s", "--producers", "8", "--nodes", "8"]
KINDS = {"input", "measured", "assumed", "projected"}


def run(*args: str) -> Result:
    return CliRunner().invoke(plan, list(args), catch_exceptions=False)


def test_help_explains_every_input() -> None:
    result = run("--help")
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for param in plan.params:
        for opt in param.opts:
            assert opt in text, opt
        assert getattr(param, "help", None), f"{param.name} has no help"
    for word in ("measured", "projected", "Exit codes", "60GB", "3%", "100Mbit"):
        assert word in text, word


@pytest.mark.parametrize(
    ("args", "option", "says"),
    [
        (["--cross-link", "-10Gbit"], "--cross-link", "positive"),
        (["--cross-link", "0Gbit/s"], "--cross-link", "positive"),
        (["--cross-link", "10"], "--cross-link", "unit"),
        (["--intra-link", "fast"], "--intra-link", "not a link rate"),
        (["--intra-link", "-1Gbit"], "--intra-link", "positive"),
        (["--change-rate", "150%"], "--change-rate", "over 100%"),
        (["--change-rate", "3"], "--change-rate", "over 100%"),
        (["--change-rate", "0"], "--change-rate", "above 0"),
        (["--change-rate", "-3%"], "--change-rate", "above 0"),
        (["--change-rate", "lots"], "--change-rate", "not a change rate"),
        (["--transport", "carrier-pigeon"], "--transport", "relay"),
        (["--model-bytes", "-5GB"], "--model-bytes", "size"),
        (["--model-bytes", "0"], "--model-bytes", "positive"),
        (["--producers", "0"], "--producers", "1"),
        (["--nodes", "-1"], "--nodes", "1"),
        (["--bucket-size", "big"], "--bucket-size", "size"),
        (["--apply-rate", "-5GB/s"], "--apply-rate", "positive"),
    ],
)
def test_bad_input_is_refused_by_name(args: list[str], option: str, says: str) -> None:
    result = run(*BASE, *args)
    assert result.exit_code == 2, result.output
    assert option in result.output, result.output
    assert says in result.output, result.output


def test_missing_or_doubled_inputs_are_usage_errors(tmp_path: Path) -> None:
    missing = run("--cross-link", "10Gbit")
    assert missing.exit_code == 2
    assert "--model-bytes" in missing.output
    no_link = run("--model-bytes", "1TB")
    assert no_link.exit_code == 2
    assert "--cross-link" in no_link.output
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 10**9}, "weight_map": {}}))
    both = run(*BASE, "--safetensors-index", str(index))
    assert both.exit_code == 2
    assert "once" in both.output
    bad_index = tmp_path / "bad.json"
    bad_index.write_text(json.dumps({"weight_map": {}}))
    refused = run("--safetensors-index", str(bad_index), "--cross-link", "1Gbit")
    assert refused.exit_code == 2
    assert "--safetensors-index" in refused.output
    assert "total_size" in refused.output


def test_s3_without_an_s3_calibration_is_refused_clearly() -> None:
    result = run(*BASE, "--transport", "s3")
    assert result.exit_code == 2
    assert "--transport" in result.output
    assert "s3 is not calibrated" in result.output
    assert "kuberefit bench transport" in result.output


def test_json_has_the_breakdown_and_the_bounding_stage() -> None:
    result = run(*BASE, "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    parts = out["breakdown"]
    for key in ("construction_s", "cross_cluster_s", "fan_out_s", "apply_s"):
        assert parts[key] >= 0
    assert out["latency_s"] == pytest.approx(
        parts["startup_s"] + parts["stream_s"] + parts["drain_s"] + parts["finalization_s"]
    )
    stages = {"construction": parts["construction_s"], "cross-cluster": parts["cross_cluster_s"]}
    stages |= {"fan-out": parts["fan_out_s"], "apply": parts["apply_s"]}
    assert out["bound"] == max(stages, key=stages.__getitem__)
    assert out["kind"] == "projected"
    assert out["speedup"] == pytest.approx(out["full_reference_s"] / out["latency_s"])
    assert out["link_limit"] == pytest.approx(1e12 / out["v_payload_bytes"])
    assert {f["kind"] for f in out["figures"]} <= KINDS
    assert {f["section"] for f in out["figures"]} == {"inputs", "calibration", "projection"}
    measured = [f for f in out["figures"] if f["kind"] == "measured"]
    assert measured
    assert all(f["note"] for f in measured)
    assert out["calibration"]["sources"]


def _rows(output: str) -> dict[str, str]:
    """The kind column of each table row, by figure name (what precedes two spaces)."""
    out = {}
    for line in output.splitlines():
        if line.startswith("  "):
            kind = re.search(r"  (input|measured|assumed|projected)(  |$)", line)
            assert kind, line
            out[line.strip().split("  ")[0]] = kind.group(1)
    return out


def test_table_marks_every_figure(tmp_path: Path) -> None:
    result = run(*BASE, "--apply-rate", "50GB/s")
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith("  ")]
    assert len(rows) > 25
    for line in rows:
        assert any(f"  {kind}" in line for kind in KINDS), line
    assert "refit latency" in result.output
    assert "bounds the stream" in result.output
    kinds = _rows(result.output)
    # The override is an input, the drain's last apply included.
    assert kinds["apply / node"] == kinds["drain / node"] == "input"
    assert "--apply-rate" in result.output
    assert kinds["construction / producer"] == "measured"
    assert kinds["intra-cluster link"] == "assumed"  # the default, not given
    for name in ("refit latency", "stream", "drain", "stage: apply"):
        assert kinds[name] == "projected", name
    shipped = cal.load()
    assert shipped.relay_hop is not None  # bench/results has a 1-node transport result
    assert kinds["relay hop"] == "measured"
    # Without a transport result the relay hop is an assumption, and says so.
    bare = tmp_path / "no-transport.json"
    cal.write(shipped.model_copy(update={"relay_hop": None, "relay_hop_payload_s": None}), bare)
    without = run(*BASE, "--calibration", str(bare))
    assert without.exit_code == 0, without.output
    assert "assumed: no transport bench result" in without.output
    assert _rows(without.output)["relay hop"] == "assumed"


def test_plot_is_an_svg(tmp_path: Path) -> None:
    path = tmp_path / "plan.svg"
    result = run(*BASE, "--plot", str(path))
    assert result.exit_code == 0, result.output
    root = ET.fromstring(path.read_text())
    assert root.tag.endswith("svg")
    lines = [e for e in root.iter() if e.tag.endswith("polyline")]
    assert len(lines) == 4  # latency, reference, speedup, link limit


def test_hf_config_is_an_estimate(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "vocab_size": 128256,
                "tie_word_embeddings": False,
                "torch_dtype": "bfloat16",
            }
        )
    )
    result = run("--hf-config", str(config), "--cross-link", "1Gbit", "--json")
    assert result.exit_code == 0, result.output
    figures = {f["name"]: f for f in json.loads(result.output)["figures"]}
    size = figures["model size H"]
    assert size["value"] == pytest.approx(2 * 8.03e9, rel=0.01)  # Llama-3-8B: 8.03B parameters
    assert "estimated" in size["note"]
    # The embedding (first in export order) and the head (last) bound the first and last
    # payloads' regions.
    estimate = sizing.from_hf_config(config)
    assert estimate.first_tensor_bytes == estimate.last_tensor_bytes == 2 * 128256 * 4096


def test_safetensors_index_is_exact(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 247_200_000_000}, "weight_map": {}}))
    result = run("--safetensors-index", str(index), "--cross-link", "5Gbit/s", "--json")
    assert result.exit_code == 0, result.output
    figures = {f["name"]: f for f in json.loads(result.output)["figures"]}
    assert figures["model size H"]["value"] == 247_200_000_000


def test_calibrate_writes_a_fresh_calibration(tmp_path: Path) -> None:
    target = tmp_path / "cal.json"
    results = REPO / "bench" / "results"
    result = run("--calibrate", "--results-dir", str(results), "--calibration", str(target))
    assert result.exit_code == 0, result.output
    assert "V_payload / H" in result.output
    fresh = cal.load(target)
    assert fresh.v_over_h == cal.load().v_over_h
    projected = run(*BASE, "--calibration", str(target), "--json")
    assert json.loads(projected.output)["calibration"]["file"] == str(target)
    broken = tmp_path / "broken.json"
    broken.write_text("{}")
    failed = run(*BASE, "--calibration", str(broken))
    assert failed.exit_code == 1
    assert "not a plan calibration" in failed.output


def test_units() -> None:
    assert parse_rate("100Mbit") == pytest.approx(12.5e6)
    assert parse_rate("10Gbit/s") == pytest.approx(1.25e9)
    assert parse_rate("400Gbps") == pytest.approx(50e9)
    assert parse_rate("1.25GB/s") == pytest.approx(1.25e9)
    assert parse_rate("1GiB/s") == 2**30
    assert parse_size("1.5TiB") == 3 * 2**39
    assert parse_size("60GB") == 60 * 10**9
    assert parse_change_rate("3%") == pytest.approx(0.03)
    assert parse_change_rate("0.03") == pytest.approx(0.03)
    assert parse_change_rate("100%") == 1.0
    for bad in ("100", "-5Gbit", "0Mbit", "fast", "5 furlongs/s"):
        with pytest.raises(ValueError, match="link rate"):
            parse_rate(bad)
    for bad in ("101%", "1.5", "0", "x"):
        with pytest.raises(ValueError, match="change rate"):
            parse_change_rate(bad)
