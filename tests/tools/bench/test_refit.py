"""`kuberefit bench refit` end to end on a tiny checkpoint: real namespaces and tbf link, real
producer and receiver processes, the real coordinator. Checks the JSON contract, that the numbers
are consistent and bit-exact, and that nothing is left behind (also after Ctrl-C)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from refit_sidecar.fingerprint import named_tensors_digest
from refit_tools.bench.refit import median_payload_s, union_seconds
from refit_tools.bench.refit_workload import Workload
from refit_tools.bench.synthetic import perturb

CLI = [sys.executable, "-m", "refit_protocol.kit.cli", "bench", "refit"]
ROW_KEYS = {
    "latency_s",
    "v_payload_bytes",
    "full_reference_s",
    "speedup",
    "transport_share",
    "finalization_s",
}


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def _ours(stderr: str) -> set[str]:
    """The namespaces this run created (named in its first progress line)."""
    for line in stderr.splitlines():
        if "between namespaces" in line:
            words = line.split("between namespaces ", 1)[1].split()
            return {words[0], words[2].rstrip(";")}
    raise AssertionError(f"no namespace line in:\n{stderr}")


def _processes_using(path: Path) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(path) in text:
            found.append(text)
    return found


def test_union_counts_overlaps_once_and_clips() -> None:
    spans = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (-1.0, 0.5), (9.0, 12.0)]
    assert union_seconds(spans, 0.0, 10.0) == pytest.approx(3.0 + 1.0 + 1.0)
    assert union_seconds([], 0.0, 1.0) == 0.0


def test_the_median_payload_takes_its_share_of_the_span() -> None:
    # 1 + 1 + 2 + 4 = 8 bytes over 4 s: the median payload (1.5 bytes) takes 0.75 s
    sizes = [1, 4, 1, 2]
    intervals = [(0.0, 1.0, size, True) for size in sizes]
    assert median_payload_s(intervals, 4.0) == pytest.approx(0.75)
    assert median_payload_s([], 4.0) is None


def test_tiny_refit_bench_reports_consistent_bit_exact_numbers(tmp_path: Path) -> None:
    work, results = tmp_path / "work", tmp_path / "results"
    proc = subprocess.run(
        [
            *CLI,
            "--checkpoint-mib",
            "8",
            "--nodes",
            "2",
            "--link-mbit",
            "100,0",
            "--json",
            "--workdir",
            str(work),
            "--results-dir",
            str(results),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    both = json.loads(proc.stdout.strip().splitlines()[-1])
    out, unshaped = both["runs"]

    h = out["checkpoint_bytes"]
    assert out["link_mbit"] == 100.0
    assert h >= 8 << 20
    assert set(out["rates"]) == {"0.01", "0.03", "0.05"}
    volumes = []
    for key, row in out["rates"].items():
        assert set(row) >= ROW_KEYS, key
        assert all(row[k] > 0 for k in ROW_KEYS), row
        assert row["bit_exact"] is True
        assert row["speedup"] == pytest.approx(row["full_reference_s"] / row["latency_s"])
        assert 0 < row["transport_share"] <= 1
        assert row["finalization_s"] < row["latency_s"]
        assert row["v_payload_bytes"] < h * float(key)  # compressed changes, not the checkpoint
        assert row["changed_fraction"] == pytest.approx(float(key), rel=0.05)
        assert row["link_limit"] == pytest.approx(h / row["v_payload_bytes"])
        assert row["speedup_over_limit"] == pytest.approx(row["speedup"] / row["link_limit"])
        for r in row["runs"]:
            assert r["median_payload_s"] <= r["transport_span_s"]
            assert r["drain_over_payload"] == pytest.approx(r["drain_s"] / r["median_payload_s"])
        volumes.append(row["v_payload_bytes"])
    assert volumes == sorted(volumes)
    ref = out["full_reference"]
    assert ref["wire_bytes"] >= h  # the reference really moves H bytes ...
    assert ref["seconds"] >= 0.9 * h * 8 / 100e6  # ... over the 100 Mbit/s link
    assert len({row["full_reference_s"] for row in out["rates"].values()}) == 1

    # The second run had the veth unshaped: no tbf, so no nominal time and no busy share, and
    # the same bytes crossed it faster than the 100 Mbit/s link allows.
    assert unshaped["link_mbit"] == 0
    assert unshaped["full_reference"]["nominal_s"] is None
    assert unshaped["full_reference"]["link_bytes"] >= h  # the veth's own counter
    assert unshaped["full_reference"]["seconds"] < ref["seconds"]
    for row in unshaped["rates"].values():
        assert row["bit_exact"] is True
        assert row["link_busy_share"] is None
        assert row["link_bytes"] > 0

    latest = json.loads((results / "refit-latest.json").read_text())
    assert latest["rates"].keys() == unshaped["rates"].keys()
    svg = ET.parse(results / "refit-latest.svg").getroot()
    assert svg.tag.endswith("svg")
    assert len(list(results.glob("refit-2*.json"))) == 2
    (links_json,) = results.glob("refit-links-*.json")
    assert both["files"] == [str(links_json), str(links_json.with_suffix(".svg"))]
    links = ET.parse(links_json.with_suffix(".svg")).getroot()
    labels = {t.text for t in links.iter() if t.tag.endswith("text")}
    assert {"100 Mbit/s", "unshaped", "1%", "3%", "5%"} <= labels

    assert not (_ours(proc.stderr) & _namespaces()), "namespaces left behind"
    assert not _processes_using(work), "processes left behind"
    for run in work.iterdir():  # each run's directory: logs and configs, no baseline left
        assert (run / "producer.log").exists()
        assert not [p for p in run.iterdir() if p.is_dir()], "baseline files left behind"
        # Independently of the bench's own verdict: every node's bits after the last transition
        # are those of a dense computation of the same versions made here.
        nodes = sorted(run.glob("bench*.digest.json"))
        assert len(nodes) == 2
        expected = final_digest(out)
        assert {json.loads(n.read_text())["digest"] for n in nodes} == {expected}
    assert len(list(work.iterdir())) == 2


def final_digest(result: dict[str, object]) -> str:
    """The canonical digest of the last version of a run, recomputed densely from the
    workload's seed and the bench's change injections (warm-up seeds 10000 + i at the first
    rate, then seed 1 + 100k + r for the r-th repeat of the k-th rate), not read from any
    process."""
    settings = result["settings"]
    assert isinstance(settings, dict)
    family = "qwen3" if settings.get("engine") == "vllm" else "decoder"
    work = Workload(
        checkpoint_bytes=settings["checkpoint_bytes"], seed=settings["seed"], family=family
    )
    tensors = list(work.tensors())
    steps = [(settings["rates"][0], 10_000 + i) for i in range(settings["warmup"])]
    steps += [
        (rate, 1 + 100 * k + r)
        for k, rate in enumerate(settings["rates"])
        for r in range(settings["repeats"])
    ]
    for rate, seed in steps:
        tensors, _ = perturb(tensors, rate, seed=seed)
    return named_tensors_digest(tensors)


def test_ctrl_c_cleans_up(tmp_path: Path) -> None:
    work = tmp_path / "work"
    # --results-dir: never bench/results of the checkout (the plan's calibration reads it)
    results = ["--results-dir", str(tmp_path / "results")]
    proc = subprocess.Popen(
        [*CLI, "--checkpoint-mib", "8", "--nodes", "2", "--workdir", str(work), *results],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # interrupt once the processes run
        line = proc.stderr.readline()
        lines.append(line)
        if "full-checkpoint reference" in line or not line:
            break
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=90)
    stderr = "".join(lines) + rest
    assert proc.returncode != 0
    assert not (_ours(stderr) & _namespaces()), "namespaces left behind"
    assert not _processes_using(work), "processes left behind"


def test_clear_error_without_iproute2(tmp_path: Path) -> None:
    env = dict(os.environ, PATH=str(tmp_path))  # neither ip nor tc on PATH
    proc = subprocess.run(
        [*CLI, "--quick", "--results-dir", str(tmp_path / "results")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    assert "iproute2" in proc.stderr, proc.stderr


def test_a_link_cut_mid_stream_completes_or_retries_in_place(tmp_path: Path) -> None:
    """The link between the clusters goes down for 10 s in the middle of a transition's stream
    (`ip link set … down`): the transition completes, or retries in place, with no step by
    anyone, and every node holds the target's bits after (the bench compares every bit of
    every node after every transition and fails otherwise)."""
    proc = subprocess.run(
        [
            *CLI,
            *("--checkpoint-mib", "8", "--nodes", "2", "--link-mbit", "8"),
            *("--rates", "0.05", "--repeats", "1", "--warmup", "0", "--cut-link-s", "10"),
            *("--json", "--results-dir", str(tmp_path / "results")),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "the link goes down for 10 s mid-stream" in proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    (row,) = result["rates"]["0.05"]["runs"]
    assert row["bit_exact"] is True
    assert row["link_cut_s"] == 10
    # The cut fell inside the stream (before the last payload reached the root relay), so the
    # transition could only end once the link was back.
    assert row["link_cut_at_s"] < row["startup_s"] + row["transport_span_s"], row
    assert row["latency_s"] > 10, row
    print(
        f"link cut: {row['attempts']} attempt(s) {row['modes']}, latency {row['latency_s']:.1f} s"
    )
