"""The switch between compiled kernels and their numpy formulations."""

from __future__ import annotations

import pytest

from refit_sidecar import compiled


def test_numba_is_used_by_default() -> None:
    """numba is a declared sidecar dependency; a silent fallback would hide a 2x slowdown."""
    assert compiled.enabled()


def test_the_numpy_formulations_can_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compiled.KERNELS_ENV, "numpy")
    assert not compiled.enabled()
