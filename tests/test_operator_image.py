"""The operator image's contents, built for real: exactly what Dockerfile.operator copies,
installed with its extras into a fresh virtual environment (no Docker engine here, so the venv
stands in for the image). That environment has no torch, vllm or pyzmq and no sidecar/ or
tools/ source, and `kuberefit` still runs and lists the control plane's commands."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile.operator"


def _copied_paths() -> list[str]:
    """Source paths of every COPY line (the build context is the repository root)."""
    paths = []
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY "):
            *sources, _dest = line.split()[1:]
            paths += sources
    return paths


@pytest.fixture(scope="module")
def operator_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("operator-image")
    context = root / "app"
    context.mkdir()
    for rel in _copied_paths():
        src = REPO / rel
        if src.is_dir():
            shutil.copytree(src, context / rel, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, context / rel)
    spec = re.search(r"pip install '([^']+)'", DOCKERFILE.read_text())
    assert spec is not None, "Dockerfile.operator installs no package spec"
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "pip"), "install", "--disable-pip-version-check", "-q"]
    done = subprocess.run([*pip, spec.group(1)], cwd=context, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return venv


def test_dockerfile_copies_no_data_plane() -> None:
    assert sorted(_copied_paths()) == ["README.md", "operator", "protocol", "pyproject.toml"]


def test_no_heavy_package_is_installed(operator_venv: Path) -> None:
    code = (
        "import importlib.util as u\n"
        "print(sorted(n for n in ('torch', 'vllm', 'zmq', 'refit_sidecar', 'refit_tools') "
        "if u.find_spec(n) is not None))\n"
    )
    out = _run(operator_venv, "python", "-c", code)
    assert out.strip() == "[]"


def test_every_control_plane_module_imports(operator_venv: Path) -> None:
    code = (
        "import importlib, pkgutil, refit_operator, refit_protocol\n"
        "n = 0\n"
        "for pkg in (refit_protocol, refit_operator):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name); n += 1\n"
        "print(n)\n"
    )
    assert int(_run(operator_venv, "python", "-c", code)) >= 10


def test_kuberefit_help_lists_the_control_plane(operator_venv: Path) -> None:
    out = _run(operator_venv, "kuberefit", "--help")
    commands = _commands(out)
    assert {"coordinator", "operator", "verify"} <= commands  # verify: the control plane's too
    assert not {"demo", "bench", "receiver", "producer"} & commands, out
    assert "Usage: kuberefit coordinator" in _run(operator_venv, "kuberefit", "coordinator", "-h")


def _commands(help_text: str) -> set[str]:
    listing = help_text.split("Commands:", 1)[1]
    return {line.split()[0] for line in listing.splitlines() if line.strip()}


def _run(venv: Path, exe: str, *args: str) -> str:
    done = subprocess.run(
        [str(venv / "bin" / exe), *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout
