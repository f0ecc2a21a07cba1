"""The harness uses the product's process supervisor (the local mode starts its parts with it),
plus what tests look for among a component's processes."""

import psutil

from refit_tools.local.procs import (
    ComponentError,
    ManagedProcess,
    free_port,
    free_ports,
    http_ok,
    log_tail,
)

__all__ = [
    "ComponentError",
    "ManagedProcess",
    "free_port",
    "free_ports",
    "http_ok",
    "log_tail",
    "vllm_worker",
]


def vllm_worker(server_pid: int) -> psutil.Process:
    """The worker process below a vLLM server (it holds the weights: a test stops it to hold an
    apply, or a request gate, on that node)."""
    procs = psutil.Process(server_pid).children(recursive=True)
    return next(c for c in procs if c.name() == "VLLM::Worker")
