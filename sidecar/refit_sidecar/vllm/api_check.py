"""The vLLM APIs the bundle relies on, checked where they are used, refused in one line.

The bundle runs in the user's vLLM, whichever version their image brings. A vLLM that lacks
one of these APIs keeps serving without refit: the control path answers every refit request
with 503 and the reason, `/kuberefit/v1/status` reports it (the receiver's `/readyz` is then
NotReady with that line), and the worker extension refuses to prewarm. Never a vLLM that
crashes at start, never a half-working refit.

- the engine client (`app.state.engine_client`): `collective_rpc`, `pause_generation`,
  `resume_generation`, `check_health` (the request gate and the worker calls);
- the worker: `model_runner.get_model()`, and the model's own `load_weights()` (❻ places
  every change through it).

`--middleware` and `--worker-extension-cls` are vLLM options: a vLLM without them refuses its
command line, which injection writes only for the launch styles it recognises.
"""

from __future__ import annotations

import importlib
from typing import Any

#: The engine client's methods the control path calls.
ENGINE_METHODS = ("collective_rpc", "pause_generation", "resume_generation", "check_health")
#: vLLM's abstract engine client, which every serving engine implements.
ENGINE_PROTOCOL = ("vllm.engine.protocol", "EngineClient")
#: The vLLM releases this bundle has run against (docs/scope.md).
TESTED_VERSIONS = ("0.32.0",)


def vllm_version() -> str:
    """The running vLLM's version ("unknown" when it does not say)."""
    try:
        return str(importlib.import_module("vllm").__version__)
    except Exception:
        return "unknown"


def _refusal(what: str) -> str:
    return (
        f"vLLM {vllm_version()} lacks {what}: refit disabled, vLLM serves on without it "
        f"(KubeRefit needs {', '.join(ENGINE_METHODS)} on the engine client and the model's "
        f"load_weights(); tested with vLLM {', '.join(TESTED_VERSIONS)})"
    )


def engine_problem(engine: Any) -> str | None:
    """One line naming the first engine-client method `engine` (an engine client or its
    class) lacks, else None."""
    kind = engine.__name__ if isinstance(engine, type) else type(engine).__name__
    for method in ENGINE_METHODS:
        if not callable(getattr(engine, method, None)):
            return _refusal(f"{kind}.{method}()")
    return None


def protocol_problem() -> str | None:
    """The same check against vLLM's `EngineClient` class, before any engine exists (at the
    middleware's construction); None when it has every method."""
    module, name = ENGINE_PROTOCOL
    try:
        cls = getattr(importlib.import_module(module), name)
    except Exception as exc:
        return _refusal(f"{module}.{name} ({type(exc).__name__}: {exc})")
    return engine_problem(cls)


def worker_problem(worker: Any) -> str | None:
    """One line naming what a vLLM worker lacks for in-place refit, else None."""
    get_model = getattr(getattr(worker, "model_runner", None), "get_model", None)
    if not callable(get_model):
        return _refusal("the worker's model_runner.get_model()")
    model = get_model()
    if not callable(getattr(model, "load_weights", None)):
        return _refusal(f"{type(model).__name__}.load_weights()")
    return None
