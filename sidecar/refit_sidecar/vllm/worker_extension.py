"""Methods vLLM mixes into every worker (`--worker-extension-cls`), reached by `collective_rpc`.

Arguments and results must be plain data: tensors cannot travel through collective_rpc.
"""

from __future__ import annotations

from typing import Any

from refit_sidecar.fingerprint import module_fingerprint
from refit_sidecar.vllm import cpu_layout

# vLLM imports this module in each worker before the model is loaded: the place to apply
# the (opt-in) CPU layout switch.
cpu_layout.apply_if_enabled()

EXTENSION_QUALNAME = "refit_sidecar.vllm.worker_extension.RefitWorkerExtension"


class RefitWorkerExtension:
    """Runs inside each vLLM worker process; `self` is the vLLM worker."""

    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def refit_fingerprint(self) -> str:
        """BLAKE2b-128 of every parameter and buffer bit held by this rank."""
        return module_fingerprint(self.model_runner.get_model())

    def refit_dense_reload(self, checkpoint_dir: str) -> None:
        """Dense in-place reload of a whole HF checkpoint through vLLM's own loader."""
        self.model_runner.reload_weights(weights_path=checkpoint_dir)
