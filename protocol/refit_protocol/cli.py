"""The `kuberefit` command: it only joins the click group each installed package contributes.

Packages register their group under the `kuberefit.commands` entry point (pyproject.toml):
the control plane (`refit_operator.cli`), the sidecars (`refit_sidecar.cli`) and the tools
(`refit_tools.cli`: demo and benches). An image that installs only some of them (the operator
image has no sidecar and no tools) lists only their commands. Every group imports its heavy
dependencies inside its commands, so `kuberefit --help` needs none of them.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any, NoReturn, TypeVar, cast

import click
from pydantic import ValidationError

from refit_protocol import __version__
from refit_protocol.pod_contract import CONFIG_ENV

ENTRY_POINT_GROUP = "kuberefit.commands"
F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

#: Set to 1 to get the Python traceback of a refused start-up instead of one line.
DEBUG_ENV = "KUBEREFIT_DEBUG"
#: Exit status of a refused start-up (bad settings, token, file or address), as for bad usage.
STARTUP_ERROR_EXIT = 2
#: The help text that says so, for every service command.
STARTUP_ERROR_HELP = (
    "A refused start-up (invalid settings, missing token or token file, address in use) "
    f"prints one line '<command>: error: <reason>' and exits {STARTUP_ERROR_EXIT}; set "
    f"${DEBUG_ENV}=1 for the Python traceback."
)
_BIND_ERRNOS = frozenset({errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES})


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


def startup_error_message(exc: BaseException) -> str | None:
    """One line saying why a service refused to start, or None for anything that is not a
    configuration error (a bug keeps its traceback).

    Configuration errors: invalid settings (pydantic: the first bad field), a refused setting
    (`ValueError`, e.g. `require_token_or_loopback`, `resolve_token`), a file that cannot be
    read (the path) and an address that cannot be bound (`EADDRINUSE`, ...: host and port).
    """
    if isinstance(exc, ValidationError):
        errors = exc.errors(include_url=False, include_input=False, include_context=False)
        if not errors:
            return _one_line(f"invalid {exc.title}")
        first = errors[0]
        where = ".".join(str(p) for p in first["loc"])
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return _one_line(
            f"invalid {exc.title}: {where + ': ' if where else ''}{first['msg']}{more}"
        )
    if isinstance(exc, OSError):
        if exc.filename is not None:
            return _one_line(f"cannot read {exc.filename}: {exc.strerror or exc}")
        if exc.errno in _BIND_ERRNOS:
            text = _one_line(str(exc))
            text = text.split("] ", 1)[1] if text.startswith("[Errno") else text
            # asyncio: "error while attempting to bind on address ('host', port): reason"
            bind = re.search(r"address \('([^']*)', (\d+)[^)]*\): (.*)$", text)
            if bind is not None:
                host, port, reason = bind.groups()
                host = f"[{host}]" if ":" in host else host
                return f"cannot listen on {host}:{port}: {reason}"
            return text
        return None
    if isinstance(exc, ValueError):
        return _one_line(str(exc) or type(exc).__name__)
    return None


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes")


def fail_startup(prog: str, message: str) -> NoReturn:
    """Print `<prog>: error: <message>` on stderr and exit with `STARTUP_ERROR_EXIT`."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(STARTUP_ERROR_EXIT)


def run_service(prog: str, fn: Callable[[], T]) -> T:
    """Run a service's entry point; a configuration error becomes one line on stderr and exit
    status 2 (`startup_error_message`), with the traceback only when ${DEBUG_ENV}=1."""
    try:
        return fn()
    except (ValueError, OSError) as exc:
        message = startup_error_message(exc)
        if message is None or _debug():
            raise
        fail_startup(prog, message)


def service_command(fn: F) -> F:
    """Decorate a click command's callback (below the click decorators) with `run_service`,
    named after the command's path (`kuberefit receiver serve`)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context(silent=True)
        prog = ctx.command_path if ctx is not None else Path(sys.argv[0]).name
        return run_service(prog, lambda: fn(*args, **kwargs))

    return cast(F, wrapper)


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
