"""The harness uses the product's process supervisor (the local mode starts its parts with it)."""

from refit_tools.local.procs import (
    ComponentError,
    ManagedProcess,
    free_port,
    free_ports,
    http_ok,
    log_tail,
)

__all__ = ["ComponentError", "ManagedProcess", "free_port", "free_ports", "http_ok", "log_tail"]
