"""One worker extension class from the user's and ours, for a vLLM that already has one.

vLLM takes a single `--worker-extension-cls`. RL frameworks that drive vLLM (verl, OpenRLHF)
set their own; injection then names this module's `ComposedWorkerExtension` instead and passes
theirs in `$KUBEREFIT_USER_WORKER_EXTENSION`. The class is built when vLLM imports this module
(in the API server and in every worker, which inherit the container's environment): the user's
class first, so their methods win any name they share with vLLM's worker, then ours, whose
methods all start with `refit_`. A user class that defines a `refit_` method is refused.
"""

from __future__ import annotations

import importlib
import os

from refit_protocol.pod_contract import USER_WORKER_EXTENSION_ENV
from refit_sidecar.vllm.worker_extension import RefitWorkerExtension


class CompositionError(TypeError):
    """The user's worker extension cannot be composed with ours (the message says why)."""


def compose(qualname: str) -> type:
    """The class `qualname` names, with RefitWorkerExtension's methods added."""
    if not qualname:
        return RefitWorkerExtension
    module, _, name = qualname.rpartition(".")
    try:
        theirs = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise CompositionError(
            f"${USER_WORKER_EXTENSION_ENV}={qualname}: cannot import it ({exc})"
        ) from exc
    if not isinstance(theirs, type):
        raise CompositionError(f"${USER_WORKER_EXTENSION_ENV}={qualname} is not a class")
    ours = {m for m in vars(RefitWorkerExtension) if m.startswith(("refit_", "_refit_"))}
    clash = sorted(m for m in ours if hasattr(theirs, m))
    if clash:
        raise CompositionError(f"{qualname} already defines {', '.join(clash)}")
    return type("ComposedWorkerExtension", (theirs, RefitWorkerExtension), {"__module__": __name__})


ComposedWorkerExtension = compose(os.environ.get(USER_WORKER_EXTENSION_ENV, ""))
