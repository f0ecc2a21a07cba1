"""Appliers (❻ as seen from the receiver): one strategy per module, chosen by configuration.

- `base`: the `Applier` interface, `StagedPayload` and `ApplyReport`;
- `inprocess`: a torch module in this process (local mode, benches, tests);
- `vllm_http`: a vLLM server in the same pod, through its worker extension;
- `vllm_host`: another host of a vLLM server spanning several hosts (stages; the leader applies);
- `payload_files`: where both stage a payload for vLLM workers (the same path on every host).

`make(config)` is the registry: `ApplierConfig.kind` names the strategy. Factories are named in
trusted configuration, never in requests.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from refit_sidecar.receiver.appliers.base import Applier, ApplyReport, StagedPayload
from refit_sidecar.receiver.config import ApplierConfig

__all__ = ["Applier", "ApplyReport", "StagedPayload", "load_object", "make"]


def load_object(spec: str) -> Any:
    """Import 'package.module:attribute' (trusted configuration, never received data)."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"factory must look like 'package.module:callable', got {spec!r}")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _factory_result(cfg: ApplierConfig) -> Any:
    if not cfg.factory:
        raise ValueError(f"applier kind {cfg.kind!r} needs a factory 'module:callable'")
    return load_object(cfg.factory)(**cfg.options)


def _vllm(cfg: ApplierConfig) -> Applier:
    from refit_sidecar.receiver.appliers.vllm_http import VllmHttpApplier

    return VllmHttpApplier(cfg)


def _vllm_host(cfg: ApplierConfig) -> Applier:
    from refit_sidecar.receiver.appliers.vllm_host import VllmHostApplier

    return VllmHostApplier(cfg)


def _inprocess(cfg: ApplierConfig) -> Applier:
    from refit_sidecar.receiver.appliers.inprocess import InProcessApplier

    return InProcessApplier(_factory_result(cfg), cfg.device)


def _factory(cfg: ApplierConfig) -> Applier:
    applier: Applier = _factory_result(cfg)
    return applier


#: ApplierConfig.kind -> how to build it.
REGISTRY: dict[str, Callable[[ApplierConfig], Applier]] = {
    "vllm": _vllm,
    "vllm_host": _vllm_host,
    "inprocess": _inprocess,
    "factory": _factory,
}


def make(cfg: ApplierConfig) -> Applier:
    """The configured applier."""
    return REGISTRY[cfg.kind](cfg)
