"""The switch between compiled kernels and their numpy formulations."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from refit_sidecar import compiled


def test_numba_is_used_by_default() -> None:
    """numba is a declared sidecar dependency; a silent fallback would hide a 2x slowdown."""
    assert compiled.enabled()


def test_the_numpy_formulations_can_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compiled.KERNELS_ENV, "numpy")
    assert not compiled.enabled()


_FIRST_COMPARE = """
import numpy as np
from refit_sidecar import bitdiff, compiled
from refit_sidecar.codec import locations
old = np.zeros(4096, dtype=np.int16)
new = old.copy()
new[[7, 9, 100]] = 1
assert compiled.enabled()
d = bitdiff.diff_bits(old, new)
assert d.count == 3
locations.encode_positions(d.locations, 4096)
"""


def test_compiled_kernels_are_cached_across_processes(tmp_path: Path) -> None:
    """A second process loads every kernel from numba's disk cache: no new cache entry.

    (A kernel defined as a closure was keyed by its cell contents, which differ per process:
    every process recompiled it, ~0.7 s, and added a file to the cache.)"""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    env.pop(compiled.KERNELS_ENV, None)

    def entries() -> set[str]:
        return {p.name for p in tmp_path.rglob("*.nbc")}

    subprocess.run([sys.executable, "-c", _FIRST_COMPARE], env=env, check=True, timeout=120)
    first = entries()
    assert first, "no kernel was cached"
    subprocess.run([sys.executable, "-c", _FIRST_COMPARE], env=env, check=True, timeout=120)
    assert entries() == first
