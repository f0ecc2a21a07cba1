"""Run real Megatron Bridge (gloo, CPU) in .venv-megatron, one process per rank."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.harness.procs import ComponentError, free_port, log_tail

REPO = Path(__file__).resolve().parents[2]
EXPORT_SCRIPT = Path(__file__).with_name("megatron_export.py")


def megatron_python() -> Path:
    """The interpreter of the Megatron environment (transformers<5; see the Makefile)."""
    override = os.environ.get("KUBEREFIT_MEGATRON_PYTHON")
    path = Path(override) if override else REPO / ".venv-megatron" / "bin" / "python"
    if not path.exists():
        raise ComponentError(f"Megatron environment not found at {path}: run `make megatron-venv`")
    return path


def run_ranks(
    script: Path,
    args: Sequence[str],
    *,
    world: int,
    logs: Path,
    timeout: float = 600,
    env: Mapping[str, str] | None = None,
) -> None:
    """Run `script` as `world` gloo ranks in .venv-megatron; fails with the log tail of the
    first rank that failed or timed out (`logs/rank<r>.log`). Every rank is killed at the end."""
    port = free_port()
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for rank in range(world):
            rank_env = dict(
                os.environ,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                OMP_NUM_THREADS="1",
                PYTHONPATH=str(REPO),
                **(env or {}),
            )
            log = logs / f"rank{rank}.log"
            with log.open("wb") as fh:
                proc = subprocess.Popen(
                    [str(megatron_python()), str(script), *args],
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=rank_env,
                    start_new_session=True,
                )
            procs.append((proc, log))
        deadline = time.monotonic() + timeout
        # Poll every rank: one that fails leaves the others blocked in a collective, so report
        # the failed rank's log at once instead of waiting for the others to time out.
        while True:
            codes = [proc.poll() for proc, _ in procs]
            failed = [(c, log) for c, (_, log) in zip(codes, procs, strict=True) if c]
            if failed:
                code, log = failed[0]
                raise ComponentError(f"{script.name} rank failed ({code}); {log}:\n{log_tail(log)}")
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                log = procs[codes.index(None)][1]
                raise ComponentError(f"{script.name} timed out; {log}:\n{log_tail(log)}")
            time.sleep(0.2)
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


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
