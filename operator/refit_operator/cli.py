"""The control plane's commands (joined into `kuberefit` by `refit_protocol.cli`).

Heavy dependencies are imported inside each command, so `kuberefit --help` works in the
operator image, which has no torch, vllm or zmq.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from refit_protocol.cli import config_file_option


@click.group()
def commands() -> None:
    """Control plane: the coordinator (and the operator)."""


@commands.command()
@config_file_option(
    "JSON file with a CoordinatorServiceConfig (refit_operator.coordinator_service)."
)
def coordinator(config_path: Path) -> None:
    """Run one policy's coordinator as a process (local mode with separate processes).

    Transitions start when every producer has staged the next version. Safe to SIGKILL: a new
    coordinator takes over from the commit store. Exit codes: 0 done (until_version reached),
    3 aborted (operator intervention needed), 4 conflict (another coordinator took over).
    """
    import asyncio

    from refit_operator.coordinator_service import CoordinatorServiceConfig, serve
    from refit_protocol.logs import configure_logging

    configure_logging()
    config = CoordinatorServiceConfig.model_validate_json(config_path.read_text())
    sys.exit(asyncio.run(serve(config)))
