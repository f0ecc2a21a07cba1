"""What Dockerfile.operator copies: the control plane and the shared protocol, no sidecar/ or
tools/ source. The image itself is built by `make images` and run by tests/test_images.py
(no torch, vllm or pyzmq in it; every control-plane module imports; `kuberefit` lists the
control plane's commands)."""

from __future__ import annotations

from pathlib import Path

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


def test_dockerfile_copies_no_data_plane() -> None:
    assert sorted(_copied_paths()) == ["README.md", "operator", "protocol", "pyproject.toml"]
