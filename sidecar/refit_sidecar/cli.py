"""The data plane's commands: the rollout and trainer sidecars (joined into `kuberefit` by
`refit_protocol.cli`; heavy dependencies are imported inside each command)."""

from __future__ import annotations

from pathlib import Path

import click

from refit_protocol.cli import (
    SERVICE_EXIT_HELP,
    STARTUP_ERROR_HELP,
    config_command,
    load_service_config,
    service_command,
    sidecar_config_option,
)

RECEIVER_CONFIG = "refit_sidecar.receiver.config:ReceiverConfig"
PRODUCER_CONFIG = "refit_sidecar.producer.main:ProducerProcessConfig"


@click.group()
def commands() -> None:
    """Data plane: the sidecars."""


@commands.group()
def receiver() -> None:
    """The rollout node's receiver sidecar: serve, or show/check its settings."""


@receiver.command("serve", epilog=f"{STARTUP_ERROR_HELP} {SERVICE_EXIT_HELP}")
@sidecar_config_option("ReceiverConfig (`kuberefit receiver config --example`).")
@service_command
def receiver_serve(config_path: Path | None) -> None:
    """Run one receiver node (HTTP control plane, relay-tree node, S3 downloads) until SIGTERM."""
    from refit_sidecar.receiver.config import ReceiverConfig
    from refit_sidecar.receiver.node import serve_forever

    serve_forever(load_service_config(ReceiverConfig, config_path))


receiver.add_command(config_command(RECEIVER_CONFIG))


@commands.group()
def producer() -> None:
    """The trainer pod's producer sidecar: serve, or show/check its settings."""


@producer.command("serve", epilog=f"{STARTUP_ERROR_HELP} {SERVICE_EXIT_HELP}")
@sidecar_config_option("ProducerProcessConfig (`kuberefit producer config --example`).")
@service_command
def producer_serve(config_path: Path | None) -> None:
    """Run one trainer sidecar (baseline, candidate inbox, producer pipeline) until SIGTERM."""
    from refit_sidecar.producer.main import ProducerProcessConfig, serve_forever

    serve_forever(load_service_config(ProducerProcessConfig, config_path))


producer.add_command(config_command(PRODUCER_CONFIG))
