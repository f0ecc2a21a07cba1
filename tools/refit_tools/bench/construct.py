"""`kuberefit bench construct`: delta-record construction per owner, the export path against
direct projection (paper §4, Table 5), on real Megatron Bridge ranks (gloo, CPU).

A Qwen3-shaped random checkpoint (the `bench refit --engine vllm` workload) is loaded by TP×PP
ranks in .venv-megatron, twice: once per path, so each path's peak memory is its own. Each rank
runs `construct_rank.py`; this driver writes the checkpoint, launches the ranks and reports, per
change rate, the slowest rank's construction time and the largest per-rank memory peak of each
path, their ratios, and the affine coverage by bytes. Both paths must find the same changed
elements (count, and a digest of names, positions and new bits), or the run fails.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from refit_tools.bench.refit_engines import write_version
from refit_tools.bench.refit_workload import MIB, Workload
from refit_tools.megatron_cpu import megatron_python, run_ranks

RANK_SCRIPT = Path(__file__).with_name("construct_rank.py")


class ConstructBenchError(RuntimeError):
    """The two paths disagree on what changed: a measurement of nothing."""


PATHS = ("export", "project")


def write_checkpoint(
    directory: Path, checkpoint_bytes: int, *, layers_multiple: int = 1, seed: int = 0
) -> Workload:
    """config.json and model.safetensors of a Qwen3-shaped random BF16 model of at least
    `checkpoint_bytes`, with a number of layers that `layers_multiple` (PP) divides."""
    workload = Workload(checkpoint_bytes=checkpoint_bytes, seed=seed, family="qwen3")
    while workload.hf_config()["num_hidden_layers"] % layers_multiple:
        workload = Workload(checkpoint_bytes=workload.nbytes + 1, seed=seed, family="qwen3")
    write_version(workload, list(workload.tensors()), directory)
    return workload


def run_construct_bench(
    *,
    checkpoint_bytes: int = 256 * MIB,
    tp: int = 2,
    pp: int = 2,
    rates: tuple[float, ...] = (0.01, 0.03, 0.05),
    workdir: Path | None = None,
    timeout_s: float = 1800,
    say: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Run both paths and return the report (see the module docstring)."""
    megatron_python()  # refuse before writing a checkpoint
    with tempfile.TemporaryDirectory(prefix="kuberefit-construct-", dir=workdir) as tmp:
        root = Path(tmp)
        say(f"writing a Qwen3-shaped checkpoint of at least {checkpoint_bytes / MIB:.0f} MiB")
        workload = write_checkpoint(root / "model", checkpoint_bytes, layers_multiple=pp)
        per_path: dict[str, list[dict[str, Any]]] = {}
        for path in PATHS:
            say(f"{path} path: {tp * pp} ranks (TP={tp}, PP={pp}), rates {list(rates)}")
            started = time.monotonic()
            out = root / path
            run_ranks(
                RANK_SCRIPT,
                [
                    f"--hf-dir={root / 'model'}",
                    f"--out={out}",
                    f"--tp={tp}",
                    f"--pp={pp}",
                    f"--path={path}",
                    f"--rates={','.join(str(r) for r in rates)}",
                ],
                world=tp * pp,
                logs=out,
                timeout=timeout_s,
            )
            per_path[path] = [
                json.loads((out / f"rank{r}.json").read_text()) for r in range(tp * pp)
            ]
            say(f"{path} path done in {time.monotonic() - started:.0f} s")
    return _report(workload, tp, pp, rates, per_path)


def _report(
    workload: Workload,
    tp: int,
    pp: int,
    rates: tuple[float, ...],
    per_path: dict[str, list[dict[str, Any]]],
) -> dict[str, Any]:
    rows = []
    for k, rate in enumerate(rates):
        row: dict[str, Any] = {"rate": rate}
        digests: dict[str, int] = {}
        for path, ranks in per_path.items():
            figures = [r["rates"][k] for r in ranks]
            row[f"{path}_s"] = max(f["construct_s"] for f in figures)
            row[f"{path}_peak_mib"] = max(f["peak_extra_bytes"] for f in figures) / MIB
            row[f"{path}_changed"] = sum(f["changed"] for f in figures)
            digests[path] = sum(f["digest"] for f in figures) % (1 << 64)
        if row["export_changed"] != row["project_changed"] or len(set(digests.values())) != 1:
            raise ConstructBenchError(
                f"at {rate:.0%} the export path found {row['export_changed']} changed elements "
                f"and projection {row['project_changed']}, digests {digests}: the paths disagree "
                "on what changed"
            )
        row["speedup"] = row["export_s"] / row["project_s"]
        row["peak_ratio"] = row["project_peak_mib"] / max(row["export_peak_mib"], 1e-9)
        rows.append(row)
    project = per_path["project"][0]
    return {
        "checkpoint_bytes": workload.nbytes,
        "layout": {"tp": tp, "pp": pp},
        "coverage": project["coverage"],
        "affine_fraction": project["coverage_fraction"],
        "plan_s": max(r["plan_s"] for r in per_path["project"]),
        "rates": rows,
        "definitions": {
            "*_s": "construction time of the slowest rank (from a barrier to its last record; "
            "the check digest is computed in a second, untimed pass)",
            "*_peak_mib": "largest per-rank resident memory above what the rank held before",
            "speedup": "export_s / project_s",
            "peak_ratio": "project_peak_mib / export_peak_mib",
        },
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"checkpoint {report['checkpoint_bytes'] / MIB:.0f} MiB, TP={report['layout']['tp']} "
        f"PP={report['layout']['pp']}; {report['coverage']}",
        f"projection plan (once per session): {report['plan_s']:.2f} s",
        "rate   export s  project s  speedup   export peak MiB  project peak MiB  changed",
    ]
    for r in report["rates"]:
        lines.append(
            f"{r['rate']:>4.0%}  {r['export_s']:>8.2f}  {r['project_s']:>9.2f}  "
            f"{r['speedup']:>6.2f}x   {r['export_peak_mib']:>15.1f}  "
            f"{r['project_peak_mib']:>16.1f}  {r['export_changed']}"
        )
    return "\n".join(lines)
