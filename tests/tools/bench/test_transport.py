"""`kuberefit bench transport` and `kuberefit bench apply` as the Dockerfiles' entry point runs
them (real processes: receiver nodes in a relay tree on loopback): the options parse, the JSON
carries every figure docs/performance.md quotes, and a run that delivers nothing cannot pass."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

KUBEREFIT = Path(sys.executable).parent / "kuberefit"


def run(*args: str, env: dict[str, str] | None = None) -> Any:
    proc = subprocess.run(
        [str(KUBEREFIT), "bench", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_transport_quick_reports_the_relay_tree_figures(tmp_path: Path) -> None:
    """Both kinds of link by default, one result (and file) each."""
    (tmp_path / "tmp").mkdir()
    results = run(
        "transport",
        "--quick",
        "--payloads",
        "2",
        "--payload-mib",
        "2",
        "--small",
        "10",
        "--rounds",
        "2",
        "--results-dir",
        str(tmp_path),
        env=os.environ | {"TMPDIR": str(tmp_path / "tmp")},
    )
    assert not list((tmp_path / "tmp").iterdir()), "the bench left its work directory behind"
    assert isinstance(results, list)
    assert [r["links"] for r in results] == ["mac", "curve"]
    written = sorted(tmp_path.glob("transport-*.json"))
    assert sorted(f for r in results for f in r["files"]) == [str(p) for p in written]
    for out in results:
        assert (out["nodes"], out["payloads"], out["payload_mib"], out["small_payloads"]) == (
            2,
            2,
            2,
            10,
        )
        assert out["v_payload_bytes"] >= 2 * (2 << 20)  # both payloads, each at least its body
        delivery = out["delivery_s"]
        assert isinstance(delivery, float)
        assert delivery > 0
        rounds, bare_rounds = out["round_delivery_s"], out["round_bare_delivery_s"]
        assert out["rounds"] == len(rounds) == len(bare_rounds) == 2
        assert delivery == pytest.approx(statistics.median(rounds), rel=1e-12)
        assert out["bare_delivery_s"] == pytest.approx(statistics.median(bare_rounds), rel=1e-12)
        dropping = out["round_bare_dropping_delivery_s"]
        assert len(dropping) == 2
        assert out["bare_dropping_delivery_s"] == pytest.approx(statistics.median(dropping))
        assert out["hop_ratio_dropping"] == pytest.approx(
            out["bare_dropping_delivery_s"] / delivery, rel=1e-9
        )
        assert all(t > 0 for t in (*rounds, *bare_rounds))
        unique, delivered = out["unique_gb_s"], out["delivered_gb_s"]
        assert isinstance(unique, float)
        assert isinstance(delivered, float)
        assert delivered == pytest.approx(unique * 2, rel=1e-9)  # every node got every payload
        per_payload = out["per_payload_ms"]
        assert isinstance(per_payload, float)
        assert per_payload > 0
        # The bare forward of the same frames ran in the same run, and the ratio is its own.
        bare = out["bare_delivery_s"]
        assert isinstance(bare, float)
        assert bare > 0
        assert out["hop_ratio"] == pytest.approx(bare / delivery, rel=1e-9)
        assert out["tree_depth"] == 2
        (file,) = out["files"]
        assert json.loads(Path(file).read_text())["bare_unique_gb_s"] == out["bare_unique_gb_s"]
        # The encrypted run also measured the same payloads sealed with AES-GCM instead.
        aes = out.get("bare_aesgcm_delivery_s")
        if out["links"] == "curve":
            assert isinstance(aes, float)
            assert aes > 0
            assert out["aesgcm_over_curve"] == pytest.approx(bare / aes, rel=1e-9)
        else:
            assert aes is None


def test_apply_entry_point_takes_the_checkpoint_size() -> None:
    out = run("apply", "--checkpoint-mib", "16")
    size = out["checkpoint_bytes"]
    assert isinstance(size, int)
    assert size >= 16 << 20
    audit = out["audit"]
    assert isinstance(audit, dict)
    assert audit["elements"] * 2 == size  # the bench audited the whole model it applied to
