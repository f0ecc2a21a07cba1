"""Runtime quirks of vLLM that KubeRefit works around inside each worker process, one module
each, applied from one list (`WORKER_QUIRKS`) when vLLM imports the worker extension (before
the model is loaded).

A quirk module has a `NAME`, a docstring saying which vLLM behaviour it answers and why,
`applies() -> bool` (this process needs it) and `apply()`. A new quirk is a new module here and
one entry in `WORKER_QUIRKS`; the modules are imported statically, so the vLLM bundle
(`vllm/bundle.py`) ships them.
"""

from __future__ import annotations

from types import ModuleType

from refit_sidecar.vllm.quirks import amx_permission, cpu_unpacked_layout

WORKER_QUIRKS: tuple[ModuleType, ...] = (cpu_unpacked_layout, amx_permission)


def apply_worker_quirks(quirks: tuple[ModuleType, ...] = WORKER_QUIRKS) -> list[str]:
    """Apply every quirk this process needs; the names of those applied."""
    applied = []
    for quirk in quirks:
        if quirk.applies():
            quirk.apply()
            applied.append(str(quirk.NAME))
    return applied
