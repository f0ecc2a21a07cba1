"""Run real Megatron Bridge (gloo, CPU) in .venv-megatron, one process per rank (the launcher
lives in `refit_tools.megatron_cpu`, shared with `kuberefit bench construct`)."""

from __future__ import annotations

from pathlib import Path

from refit_tools.megatron_cpu import megatron_python, run_ranks

EXPORT_SCRIPT = Path(__file__).with_name("megatron_export.py")

__all__ = ["megatron_python", "run_export", "run_ranks"]


def run_export(hf_dir: Path, out: Path, *, tp: int = 1, pp: int = 1, timeout: float = 600) -> Path:
    """Export `hf_dir` through Megatron Bridge with TP×PP gloo ranks; returns `out`."""
    out.mkdir(parents=True, exist_ok=True)
    run_ranks(
        EXPORT_SCRIPT,
        [f"--hf-dir={hf_dir}", f"--out={out}", f"--tp={tp}", f"--pp={pp}"],
        world=tp * pp,
        logs=out,
        timeout=timeout,
    )
    return out
