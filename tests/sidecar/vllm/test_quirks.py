"""vLLM's runtime quirks have one home: every module under `refit_sidecar/vllm/quirks/` is in
the list the worker extension applies, and says what it answers and when it applies."""

from __future__ import annotations

import pkgutil

import pytest

from refit_sidecar.vllm import quirks
from refit_sidecar.vllm.quirks import WORKER_QUIRKS, apply_worker_quirks, cpu_unpacked_layout


def test_every_quirk_module_is_listed_and_complete() -> None:
    modules = {m.name for m in pkgutil.iter_modules(quirks.__path__)}
    listed = {q.__name__.rsplit(".", 1)[1] for q in WORKER_QUIRKS}
    assert modules == listed
    names = [q.NAME for q in WORKER_QUIRKS]
    assert len(set(names)) == len(names)
    for quirk in WORKER_QUIRKS:
        assert callable(quirk.applies)
        assert callable(quirk.apply)
        assert len((quirk.__doc__ or "").split()) > 20, f"{quirk.__name__} says why it exists"


def test_the_cpu_layout_switch_applies_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_unpacked_layout.ENV_SWITCH, raising=False)
    assert not cpu_unpacked_layout.applies()
    assert "cpu-unpacked-layout" not in apply_worker_quirks((cpu_unpacked_layout,))
    monkeypatch.setenv(cpu_unpacked_layout.ENV_SWITCH, "0")
    assert not cpu_unpacked_layout.applies()
    monkeypatch.setenv(cpu_unpacked_layout.ENV_SWITCH, "1")
    assert cpu_unpacked_layout.applies()
