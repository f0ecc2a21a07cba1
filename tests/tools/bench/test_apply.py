"""`kuberefit bench apply` on a small model: every figure the docs quote is reported, for both
ops, and the per-payload split of the vLLM path measures real work (the figures themselves are
the bench's business, not this test's)."""

from __future__ import annotations

from refit_tools.bench.apply import run_apply_bench


def test_apply_bench_reports_every_figure() -> None:
    out = run_apply_bench(size_bytes=16 << 20, rates=(0.02,), say=lambda _msg: None)
    assert out["tensors"] > 0
    assert out["checkpoint_bytes"] >= 16 << 20
    row = out["rates"]["0.02"]
    for op in ("xor", "overwrite"):
        assert row[op]["values"] > 0
        assert row[op]["values_per_s"] > 0
        assert 0 <= row[op]["reset_share"] <= 1
    node = row["node_cpu"]
    assert node["payloads"] >= 2
    assert node["mean_wire_bytes"] > 0
    for key in ("receiver_ms", "worker_read_ms", "worker_decode_ms", "worker_apply_wall_ms"):
        assert node[key] > 0, key
    assert node["worker_read_over_decode"] == node["worker_read_ms"] / node["worker_decode_ms"]
    audit = out["audit"]  # the audit of the model the bench holds passed (it raises otherwise)
    assert audit["tensors"] == out["tensors"]
    assert audit["elements"] * 2 == out["checkpoint_bytes"]  # every BF16 element compared
    assert audit["audit_s"] > 0
    assert audit["dense_load_s"] > 0
    assert audit["audit_peak_extra_bytes"] >= 0
