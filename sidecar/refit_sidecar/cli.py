"""The data plane's commands: the rollout and trainer sidecars (joined into `kuberefit` by
`refit_protocol.kit.cli`; heavy dependencies are imported inside each command)."""

from __future__ import annotations

from pathlib import Path

import click

from refit_protocol.kit.cli import (
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


@commands.group("vllm-bundle")
def vllm_bundle() -> None:
    """The code that runs inside the user's vLLM process, copied into its pod at start."""


@vllm_bundle.command("install")
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
def vllm_bundle_install(dest: Path) -> None:
    """Copy the vLLM bundle into DEST (what the injected init container runs).

    DEST then goes first on the vLLM container's PYTHONPATH; the bundle needs nothing beyond
    what vLLM itself requires. An earlier copy in DEST is replaced; the manifest
    (kuberefit-bundle.json) is written last. Exit codes: 0 installed, 1 the bundle cannot be
    built or written (the message says why)."""
    from refit_sidecar.vllm.bundle import BundleError, install

    try:
        manifest = install(dest)
    except (BundleError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    size = sum((dest / f).stat().st_size for f in manifest.files)
    click.echo(
        f"kuberefit {manifest.version}: vLLM bundle of {len(manifest.files)} files "
        f"({size / 1024:.0f} KiB) in {dest}"
    )


@vllm_bundle.command("list")
def vllm_bundle_list() -> None:
    """List the bundle's modules and the packages outside the standard library each imports.

    Exit codes: 0 listed, 1 a module imports what vLLM does not bring (the message names it)."""
    from refit_sidecar.vllm.bundle import BundleError, build

    try:
        modules = build()
    except BundleError as exc:
        raise click.ClickException(str(exc)) from exc
    for module in modules:
        click.echo(f"{module.name}\t{','.join(sorted(module.third_party)) or '-'}")
