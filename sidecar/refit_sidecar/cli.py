"""The data plane's commands: the rollout and trainer sidecars (joined into `kuberefit` by
`refit_protocol.cli`; heavy dependencies are imported inside each command)."""

from __future__ import annotations

from pathlib import Path

import click

from refit_protocol.cli import (
    STARTUP_ERROR_HELP,
    read_sidecar_config,
    service_command,
    sidecar_config_option,
)


@click.group()
def commands() -> None:
    """Data plane: the sidecars."""


@commands.group()
def receiver() -> None:
    """The rollout node's receiver service."""


@receiver.command("serve", epilog=STARTUP_ERROR_HELP)
@sidecar_config_option("ReceiverConfig as JSON (see docs/transports.md).")
@service_command
def receiver_serve(config_path: Path | None) -> None:
    """Run one receiver node (HTTP control plane, relay-tree node, S3 downloads) until SIGTERM."""
    from refit_sidecar.receiver.__main__ import serve_json

    serve_json(read_sidecar_config(config_path))


@commands.group()
def producer() -> None:
    """The trainer pod's producer sidecar."""


@producer.command("serve", epilog=STARTUP_ERROR_HELP)
@sidecar_config_option("ProducerProcessConfig as JSON (see docs/trainer.md).")
@service_command
def producer_serve(config_path: Path | None) -> None:
    """Run one trainer sidecar (baseline, candidate inbox, producer pipeline) until SIGTERM."""
    from refit_sidecar.producer.main import serve_json

    serve_json(read_sidecar_config(config_path))
