"""Run a real Megatron Bridge export (gloo, CPU) in .venv-megatron, one process per rank."""

from __future__ import annotations

import os
import subprocess
import time
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


def run_export(hf_dir: Path, out: Path, *, tp: int = 1, pp: int = 1, timeout: float = 600) -> Path:
    """Export `hf_dir` through Megatron Bridge with TP×PP gloo ranks; returns `out`."""
    world = tp * pp
    port = free_port()
    out.mkdir(parents=True, exist_ok=True)
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for rank in range(world):
            env = dict(
                os.environ,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                OMP_NUM_THREADS="1",
                PYTHONPATH=str(REPO),
            )
            log = out / f"rank{rank}.log"
            with log.open("wb") as fh:
                proc = subprocess.Popen(
                    [
                        str(megatron_python()),
                        str(EXPORT_SCRIPT),
                        f"--hf-dir={hf_dir}",
                        f"--out={out}",
                        f"--tp={tp}",
                        f"--pp={pp}",
                    ],
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                )
            procs.append((proc, log))
        deadline = time.monotonic() + timeout
        for proc, log in procs:
            remaining = max(deadline - time.monotonic(), 0.1)
            try:
                code = proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired as exc:
                raise ComponentError(f"Megatron export timed out; {log}:\n{log_tail(log)}") from exc
            if code != 0:
                raise ComponentError(
                    f"Megatron export rank failed ({code}); {log}:\n{log_tail(log)}"
                )
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out
