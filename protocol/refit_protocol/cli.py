"""The `kuberefit` command: it only joins the click group each installed package contributes.

Packages register their group under the `kuberefit.commands` entry point (pyproject.toml):
the control plane (`refit_operator.cli`), the sidecars (`refit_sidecar.cli`) and the tools
(`refit_tools.cli`: demo and benches). An image that installs only some of them (the operator
image has no sidecar and no tools) lists only their commands. Every group imports its heavy
dependencies inside its commands, so `kuberefit --help` needs none of them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any, TypeVar

import click

from refit_protocol import __version__
from refit_protocol.pod_contract import CONFIG_ENV

ENTRY_POINT_GROUP = "kuberefit.commands"
F = TypeVar("F", bound=Callable[..., Any])


def config_file_option(help_text: str) -> Callable[[F], F]:
    """`--config FILE` (required, must exist), passed to the command as `config_path`."""
    return click.option(
        "--config",
        "config_path",
        required=True,
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        help=help_text,
    )


def sidecar_config_option(help_text: str) -> Callable[[F], F]:
    """`--config FILE` (optional: an injected sidecar gets its settings in $KUBEREFIT_CONFIG),
    passed to the command as `config_path`; read it with `read_sidecar_config`."""
    return click.option(
        "--config",
        "config_path",
        default=None,
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        help=f"{help_text} Default: the JSON in ${CONFIG_ENV} (set by injection).",
    )


def read_sidecar_config(config_path: Path | None) -> str:
    """The JSON settings: the `--config` file, else $KUBEREFIT_CONFIG."""
    if config_path is not None:
        return config_path.read_text()
    text = os.environ.get(CONFIG_ENV, "").strip()
    if not text:
        raise click.UsageError(f"give --config FILE or set ${CONFIG_ENV} to the JSON settings")
    return text


def _load(ep: EntryPoint) -> click.Group | None:
    """The group behind `ep`, or None when its package is not installed in this image."""
    package = ep.value.split(":", 1)[0].split(".", 1)[0]
    try:
        group = ep.load()
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".", 1)[0] == package:
            return None
        raise
    if not isinstance(group, click.Group):
        raise TypeError(f"entry point {ep.name} = {ep.value} is not a click group")
    return group


def build() -> click.Group:
    """The top-level group with the commands of every installed package."""

    @click.group(context_settings={"help_option_names": ["-h", "--help"]})
    @click.version_option(__version__, prog_name="kuberefit")
    def main() -> None:
        """KubeRefit: bit-exact sparse refit of RL policy weights from trainers to vLLM."""

    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        group = _load(ep)
        if group is None:
            continue
        for name, command in group.commands.items():
            if name in main.commands:
                raise RuntimeError(f"command {name!r} is contributed twice (by {ep.name})")
            main.add_command(command, name)
    return main


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    build()(args=argv)


if __name__ == "__main__":
    main()
