"""The trainer client in a user's trainer image: `.venv-trainer` holds only the image's torch and
`pip install kuberefit[trainer]` (the Makefile's trainer-venv). The publisher and the projecting
source import there without what the sidecars need, and the client's own import cost is
reported (torch loaded first, as a trainer has it)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
TRAINER_PYTHON = REPO / ".venv-trainer" / "bin" / "python"
#: Never in a trainer image for KubeRefit's sake.
SIDECAR_ONLY = ("vllm", "zmq", "numba", "zstandard", "boto3", "kopf", "refit_operator")


def test_the_trainer_client_imports_without_the_sidecars_dependencies() -> None:
    if not TRAINER_PYTHON.exists():
        pytest.fail(f"{TRAINER_PYTHON} missing: `make trainer-venv` builds the trainer stand-in")
    script = (
        "import sys, torch\n"
        "import refit_sidecar.trainer as t\n"
        "from refit_sidecar.trainer import Publisher, PublisherConfig, StateDictSource\n"
        "from refit_sidecar.trainer.projected import ProjectedSource\n"
        "print(t.__file__)\n"
        "print(sorted({m.split('.')[0] for m in sys.modules}))\n"
    )
    done = subprocess.run(
        [str(TRAINER_PYTHON), "-X", "importtime", "-c", script],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
        cwd="/",
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    where, loaded = done.stdout.splitlines()[-2:]
    assert "site-packages" in where  # installed into the image, not this checkout
    modules = set(json.loads(loaded.replace("'", '"')))
    assert not modules & set(SIDECAR_ONLY), sorted(modules & set(SIDECAR_ONLY))
    (row,) = [
        r for r in done.stderr.splitlines() if r.split("|")[-1].rstrip() == " refit_sidecar.trainer"
    ]
    cumulative_ms = int(row.split("|")[1]) / 1000
    print(f"import refit_sidecar.trainer after torch: {cumulative_ms:.0f} ms")
    assert cumulative_ms > 0
