"""`kuberefit bench codec` on a tiny workload: it runs, verifies itself and reports every key."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from refit_protocol.kit.cli import build
from refit_tools.bench.codec import format_report, run_codec_bench, table2
from refit_tools.bench.synthetic import (
    ModelShape,
    checkpoint_layout,
    count_changed,
    make_checkpoint,
    perturb,
)

TINY = ModelShape(hidden=64, ffn=160, kv=16, vocab=512)


def test_table2_xor_streams_are_smaller() -> None:
    result = table2(200_000)
    assert list(result) == ["1e-04", "1e-03", "1e-02"]
    for row in result.values():
        assert 0 < row["xor_bytes"] < row["overwrite_bytes"]
        assert row["ratio"] == row["overwrite_bytes"] / row["xor_bytes"]


def test_perturb_changes_exactly_what_it_reports() -> None:
    base = make_checkpoint(checkpoint_layout(TINY, 1 << 20), seed=0)
    new, changed = perturb(base, 0.03, seed=4)
    assert changed == count_changed(base, new)
    total = sum(t.numel() for _, t in base)
    assert 0.02 < changed / total < 0.04


def test_run_codec_bench_reports_the_documented_keys(tmp_path: Path) -> None:
    result = run_codec_bench(
        quick=True,
        checkpoint_bytes=1 << 20,
        workdir=tmp_path,
        say=lambda _msg: None,
        table2_n=50_000,
        shape=TINY,
    )
    json.dumps(result)
    assert set(result["table2"]) == {"1e-04", "1e-03", "1e-02"}
    assert set(result["checkpoint"]) == {"0.01", "0.03", "0.05"}
    for row in result["checkpoint"].values():
        for key in (
            "v_payload_over_H",
            "v_payload_over_changed_values",
            "encode_gbps_1t",
            "encode_gbps_2t",
            "encode_over_bare_compare",
            "scaling_2t_over_1t",
            "bare_scaling_2t_over_1t",
            "kernel_scaling_2t_over_1t",
        ):
            assert key in row
        assert 0 < row["v_payload_over_H"] < 1
    assert result["peak_rss_bytes"] > 0
    assert "Table 2" in format_report(result)
    assert list(tmp_path.iterdir()) == []  # the baseline files were removed


def test_cli_has_the_bench_codec_command() -> None:
    out = CliRunner().invoke(build(), ["bench", "codec", "--help"])
    assert out.exit_code == 0
    assert "--quick" in out.output
    assert "--json" in out.output
