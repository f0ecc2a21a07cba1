"""`kuberefit plan` through click: help for every input, clear errors (exit 2) for bad ones, the
JSON and table outputs, the plot, the size sources and --calibrate."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

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
        (["--transport", "carrier-pigeon"], "--transport", "zmq"),
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


def test_s3_without_an_s3_calibration_is_refused_clearly(tmp_path: Path) -> None:
    without = tmp_path / "no-s3.json"
    cal.write(cal.load().model_copy(update={"s3_upload": None, "s3_download": None}), without)
    result = run(*BASE, "--transport", "s3", "--calibration", str(without))
    assert result.exit_code == 2
    assert "--transport" in result.output
    assert "s3 is not calibrated" in result.output
    assert "kuberefit bench transport" in result.output


def test_the_shipped_calibration_projects_s3_from_a_measured_bench() -> None:
    shipped = cal.load()
    assert shipped.s3_upload is not None
    assert shipped.s3_download is not None
    assert shipped.s3_upload.kind == shipped.s3_download.kind == "measured"
    assert shipped.s3_upload.sources[0].startswith("transport-")
    result = run(*BASE, "--transport", "s3")
    assert result.exit_code == 0, result.output
    assert "s3 is not calibrated" not in result.output


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
    assert failed.exit_code == 2
    assert "--calibration" in failed.output
    assert "not a plan calibration" in failed.output


def _shipped_json() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(cal.SHIPPED.read_text())
    return data


def _bad_calibration(tmp_path: Path, case: str) -> Path:
    """A --calibration file that is not a usable calibration, of the kind `case` names."""
    path = tmp_path / f"{case}.json"
    if case == "bench result":
        return REPO / "bench" / "results" / "refit-latest.json"
    if case == "missing":
        return path
    if case == "not JSON":
        path.write_text("format: 2\n")
    elif case == "not text":
        path.write_bytes(b"\xff\xfe\x00\xd8garbage")
    elif case == "array":
        path.write_text("[1, 2]")
    elif case == "empty object":
        path.write_text("{}")
    elif case == "old format":
        path.write_text(json.dumps(_shipped_json() | {"format": 1}))
    elif case == "wrong shape":
        data = _shipped_json()
        data["link_overhead"]["value"] = "fast"
        del data["apply"]["rates"]
        path.write_text(json.dumps(data))
    else:
        raise AssertionError(case)
    return path


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("missing", "no such file"),
        ("not JSON", "not JSON (Expecting value at line 1 column 1)"),
        ("not text", "not JSON"),
        ("bench result", "it is a `kuberefit bench refit` result"),
        ("array", "a JSON array, not an object"),
        ("empty object", "no format field"),
        ("old format", "format 1, and this KubeRefit reads format 2"),
        ("wrong shape", "link_overhead.value: input should be a valid number"),
    ],
)
def test_a_bad_calibration_file_is_a_one_line_usage_error(
    tmp_path: Path, case: str, says: str
) -> None:
    """Whatever is wrong with --calibration FILE, the error names the option and the reason on
    one line (exit 2), with no traceback and no pydantic dump."""
    path = _bad_calibration(tmp_path, case)
    result = run(*BASE, "--calibration", str(path))
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    assert errors[0].startswith(f"Error: Invalid value for '--calibration': {path}: ")
    assert says in errors[0], result.output
    assert len(result.output.strip().splitlines()) <= 4, result.output  # usage, hint, error
    for noise in ("Traceback", "validation error", "errors.pydantic.dev", "input_value"):
        assert noise not in result.output, result.output


def test_an_unreadable_calibration_file_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "locked.json"
    path.write_text(cal.SHIPPED.read_text())
    real = Path.open

    def open_(self: Path, *args: Any, **kwargs: Any) -> Any:
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_)
    result = run(*BASE, "--calibration", str(path))
    assert result.exit_code == 2, result.output
    assert f"'--calibration': {path}: cannot read it: Permission denied" in result.output


def test_calibrate_that_cannot_write_names_the_path(tmp_path: Path) -> None:
    """--calibrate fits, then cannot write its output: one line naming the path (exit 1)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    target = blocker / "cal.json"
    results = REPO / "bench" / "results"
    result = run("--calibrate", "--results-dir", str(results), "--calibration", str(target))
    assert result.exit_code == 1, result.output
    assert result.output.strip() == (
        f"Error: cannot write the calibration to {target}: {blocker} is not a directory"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.parametrize(
    ("total", "says"),
    [
        ("NaN", "total_size is nan"),
        ("1e400", "total_size is inf"),
        ("-5", "total_size is -5"),
        ("0", "total_size is 0"),
        ("1.5", "total_size is 1.5"),
        ("1" + "0" * 400, "total_size is a 401-digit number"),
    ],
)
def test_an_impossible_safetensors_total_size_is_refused(
    tmp_path: Path, total: str, says: str
) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"metadata": {"total_size": ' + total + '}, "weight_map": {}}')
    result = run("--safetensors-index", str(index), "--cross-link", "1Gbit")
    assert result.exit_code == 2, result.output
    assert "'--safetensors-index'" in result.output
    assert says in result.output
    assert "not a positive, finite whole number of bytes" in result.output


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--cross-link", "1e400Gbit", "must be finite"),
        ("--intra-link", "1e400Gbit/s", "must be finite"),
        ("--apply-rate", "1e400GB/s", "must be finite"),
        ("--relay-hop-rate", "1e999B/s", "must be finite"),
        ("--relay-hop-rate", "0GB/s", "positive"),
        ("--model-bytes", "9" * 400, "longer than 32 characters"),
    ],
)
def test_non_finite_inputs_are_refused(option: str, value: str, says: str) -> None:
    result = run(*BASE, option, value)
    assert result.exit_code == 2, result.output
    assert f"'{option}'" in result.output
    assert says in result.output


def _figures(*args: str) -> dict[str, dict[str, Any]]:
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    return {f["name"]: f for f in json.loads(result.output)["figures"]}


def _config(tmp_path: Path, dtype: str) -> Path:
    path = tmp_path / f"{dtype}.json"
    path.write_text(
        json.dumps(
            {
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "vocab_size": 128256,
                "torch_dtype": dtype,
            }
        )
    )
    return path


def test_the_element_width_follows_the_dtype(tmp_path: Path) -> None:
    """--hf-config's dtype sets the bytes per element (the changed elements per byte of H);
    --model-bytes and --safetensors-index take BF16 and say so, unless --dtype-bytes."""
    link = ("--cross-link", "10Gbit/s")
    fp32 = _figures("--hf-config", str(_config(tmp_path, "float32")), *link)
    bf16 = _figures("--hf-config", str(_config(tmp_path, "bfloat16")), *link)
    assert fp32["element width"]["value"] == 4
    assert fp32["element width"]["kind"] == "input"
    assert "float32" in fp32["element width"]["note"]
    assert bf16["element width"]["value"] == 2
    # Half the changed elements per byte of H: faster per byte where a changed element costs.
    assert fp32["apply / node"]["value"] > bf16["apply / node"]["value"]
    assert fp32["drain / node"]["value"] > bf16["drain / node"]["value"]
    given = _figures("--model-bytes", "32GB", *link)
    assert given["element width"]["value"] == 2
    assert given["element width"]["kind"] == "assumed"
    assert "BF16" in given["element width"]["note"]
    assert given["apply / node"]["value"] == bf16["apply / node"]["value"]
    wide = _figures("--model-bytes", "32GB", "--dtype-bytes", "4", *link)
    assert wide["element width"]["kind"] == "input"
    assert wide["apply / node"]["value"] == fp32["apply / node"]["value"]
    clash = run("--hf-config", str(_config(tmp_path, "float32")), *link, "--dtype-bytes", "2")
    assert clash.exit_code == 2, clash.output
    assert "'--dtype-bytes'" in clash.output
    assert "float32" in clash.output
    text = "".join(run("--help").output.split())
    assert "BF16(2bytes)unless--dtype-bytes" in text


HOP_NOTE = (
    "note: fan-out and the full-checkpoint reference are bounded by the relay hop measured on "
    "the 2-CPU bench machine (0.758 GB/s MAC-only), not by --intra-link; give --relay-hop-rate "
    "for your hosts"
)


def test_a_relay_hop_that_bounds_fan_out_is_said(tmp_path: Path) -> None:
    """At 100 Gbit/s inside the cluster the bench VM's loopback relay hop (~0.59 GB/s), not the
    link, bounds fan-out and the full-checkpoint reference: a note says so, and
    --relay-hop-rate replaces it (an input)."""
    result = run(*BASE)
    assert result.exit_code == 0, result.output
    assert HOP_NOTE in result.output.splitlines()
    measured = _figures(*BASE)
    assert measured["relay hop"]["kind"] == "measured"
    assert "--relay-hop-rate" in measured["relay hop"]["note"]
    assert measured["relay hop, MAC-only"]["value"] > measured["relay hop"]["value"]
    # Encrypted links inside the cluster: the encrypted hop bounds the fan-out, more slowly.
    encrypted = run(*BASE, "--intra-cluster", "encrypted")
    hop = f"{cal.load().relay_hop.value / 1e9:.3g} GB/s"  # type: ignore[union-attr]
    assert HOP_NOTE.replace("0.758 GB/s MAC-only", hop) in encrypted.output.splitlines()
    slower = _figures(*BASE, "--intra-cluster", "encrypted")
    assert "relay hop, MAC-only" not in slower
    assert slower["stage: fan-out"]["value"] > measured["stage: fan-out"]["value"]
    given = run(*BASE, "--relay-hop-rate", "20GB/s")
    assert given.exit_code == 0, given.output
    assert "relay hop measured" not in given.output
    assert _rows(given.output)["relay hop"] == "input"
    faster = _figures(*BASE, "--relay-hop-rate", "20GB/s")
    assert faster["relay hop"]["value"] == 20e9
    assert faster["stage: fan-out"]["value"] < measured["stage: fan-out"]["value"] / 10
    assert (
        faster["full-checkpoint transfer"]["value"] < measured["full-checkpoint transfer"]["value"]
    )
    # A slower intra-cluster link than the hop bounds fan-out itself: no note.
    slow = run(*BASE, "--intra-link", "1Gbit/s")
    assert "relay hop measured" not in slow.output
    # One node, one producer: no fan-out, but the relay root's receive of the flow bounds the
    # reference ahead of a fast cross-cluster link.
    one = run("--model-bytes", "1TB", "--cross-link", "100Gbit/s")
    notes = [line for line in one.output.splitlines() if "relay hop measured" in line]
    assert len(notes) == 1, one.output
    assert notes[0].startswith(
        "note: the cross-cluster stage (a relay root's receive) and the "
        "full-checkpoint reference are bounded"
    )
    assert "not by --cross-link" in notes[0]
    text = "".join(run("--help").output.split())  # click wraps lines at hyphens too
    assert "--relay-hop-rateTHROUGHPUT" in text
    assert "boundsfan-outandthefull-checkpointreferenceaheadofafast--intra-link" in text


def test_relay_hop_rate_is_for_the_relay_tree(tmp_path: Path) -> None:
    with_s3 = tmp_path / "s3.json"
    shipped = cal.load()
    s3 = cal.Scalar(value=1e9, unit="B/s", how="test")
    cal.write(shipped.model_copy(update={"s3_upload": s3, "s3_download": s3}), with_s3)
    ok = run(*BASE, "--calibration", str(with_s3), "--transport", "s3")
    assert ok.exit_code == 0, ok.output
    result = run(
        *BASE, "--calibration", str(with_s3), "--transport", "s3", "--relay-hop-rate", "5GB/s"
    )
    assert result.exit_code == 2, result.output
    assert "'--relay-hop-rate'" in result.output
    assert "give it with --transport zmq" in result.output


def test_fitted_figures_say_they_are_fitted() -> None:
    """Intercepts and residual fits keep the kind `measured` but say how they were fitted (runs
    and residual), and V_payload / H says it is the bench's synthetic changes."""
    figures = _figures(*BASE)
    shipped = cal.load()
    for name, costs in (
        ("fixed start-up", shipped.construction),
        ("drain, fixed", shipped.drain),
        ("finalization, fixed", shipped.finalization),
        ("finalization per GB of H", shipped.finalization),
        ("apply / node", shipped.apply),
        ("apply / payload", shipped.apply),
        ("drain / node", shipped.drain),
    ):
        assert figures[name]["kind"] == "measured", name
        want = (
            f"fitted (least squares over {len(costs.sources)} quiet runs, "
            f"rms {costs.rms_error:.0%}): "
        )
        assert figures[name]["note"].startswith(want), (name, figures[name]["note"])
    for name in ("per-payload send cost", "cross-cluster stream, fixed"):
        assert figures[name]["note"].startswith("fitted (least squares over "), name
    v = figures["V_payload / H"]["note"]
    assert "synthetic uniform changes (relative amplitude 1e-2)" in v
    assert "real models' changes may compress differently" in v


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
    for bad in ("100", "-5Gbit", "0Mbit", "fast", "5 furlongs/s", "1e400Gbit", "1e-400Gbit"):
        with pytest.raises(ValueError, match="link rate"):
            parse_rate(bad)
    with pytest.raises(ValueError, match="finite"):
        parse_rate("1e400Gbit")
    with pytest.raises(ValueError, match="longer than 32 characters"):
        parse_size("1" + "0" * 400)
    for bad in ("101%", "1.5", "0", "x"):
        with pytest.raises(ValueError, match="change rate"):
            parse_change_rate(bad)


def test_json_figures_carry_values_in_the_unit_they_name() -> None:
    """A link is given in bits per second and its JSON figure says bit/s: the value is bits per
    second, not bytes; a chunk or bucket is a byte count and says B."""
    figures = _figures(*BASE, "--intra-link", "25Gbit/s", "--chunk-size", "64MiB")
    cross, intra = figures["cross-cluster link"], figures["intra-cluster link"]
    assert (cross["unit"], cross["value"]) == ("bit/s", 10e9)
    assert (intra["unit"], intra["value"]) == ("bit/s", 25e9)
    chunk = figures["export chunk"]
    assert (chunk["unit"], chunk["value"]) == ("B", 64 << 20)
    assert figures["bucket"]["unit"] == "B"
    assert figures["split"]["unit"] == "B"
    assert figures["split"]["value"] == max(
        figures["export chunk"]["value"], figures["bucket"]["value"]
    )
    table = run(*BASE, "--intra-link", "25Gbit/s", "--chunk-size", "64MiB").output
    assert re.search(r"cross-cluster link\s+10 Gbit/s", table)
    assert re.search(r"export chunk\s+64MiB", table)


def test_the_transport_is_named_as_a_policy_names_it_and_relay_still_works() -> None:
    """`--transport zmq` as in a RefitPolicy's spec.transport; `relay`, the plan's former name
    for it, gives the same projection and is reported as zmq."""
    zmq, relay = (
        json.loads(run(*BASE, "--transport", t, "--json").output) for t in ("zmq", "relay")
    )
    assert zmq == relay
    (shown,) = [f["value"] for f in zmq["figures"] if f["name"] == "transport"]
    assert shown == "zmq"
