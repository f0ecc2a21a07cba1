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
import importlib
import json
import os
import re
import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any, NoReturn, TypeVar, cast

import click
from pydantic import BaseModel, ValidationError

from refit_protocol import __version__
from refit_protocol.errors import ConfigurationError
from refit_protocol.kit.config_files import (
    MAX_CONFIG_BYTES,
    MAX_CONFIG_DEPTH,
    example_yaml,
    load_config,
)
from refit_protocol.kit.logs import FORMATS, LEVELS
from refit_protocol.pod_contract import CONFIG_ENV, LOG_FORMAT_ENV, LOG_LEVEL_ENV
from refit_protocol.sizes import format_byte_size

ENTRY_POINT_GROUP = "kuberefit.commands"
F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

#: Set to 1 to get the Python traceback of a refused start-up instead of one line.
DEBUG_ENV = "KUBEREFIT_DEBUG"
#: Exit status of a refused start-up (bad settings, token, file or address), as for bad usage.
STARTUP_ERROR_EXIT = 2
#: The help text that says so, for every service command.
STARTUP_ERROR_HELP = (
    "A refused start-up (invalid settings, missing token or token file, address in use) "
    f"prints one line '<command>: error: <reason>' and exits {STARTUP_ERROR_EXIT}; --debug "
    f"(or ${DEBUG_ENV}=1) prints the Python traceback."
)
#: Exit codes of a sidecar service.
SERVICE_EXIT_HELP = (
    "Exit codes: 0 stopped by SIGTERM or SIGINT; 1 an unexpected error (traceback); "
    f"{STARTUP_ERROR_EXIT} refused start-up."
)
#: The bounds every settings file is read within (config_files.py has all of them).
CONFIG_BOUNDS_HELP = (
    f"at most {format_byte_size(MAX_CONFIG_BYTES)}, nested at most {MAX_CONFIG_DEPTH} levels"
)
#: How every --config file is read.
CONFIG_FORMAT_HELP = (
    f"YAML or JSON ({CONFIG_BOUNDS_HELP}); sizes take units (256MiB); relative paths are "
    "relative to the file."
)
#: Exit codes of `<component> config`.
CONFIG_EXIT_HELP = (
    f"Exit codes: 0 shown or valid; {STARTUP_ERROR_EXIT} invalid (one line names the setting)."
)
_BIND_ERRNOS = frozenset({errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES})


def config_file_option(help_text: str) -> Callable[[F], F]:
    """`--config FILE` (required, must exist), passed to the command as `config_path`."""
    return click.option(
        "--config",
        "config_path",
        required=True,
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        help=f"{help_text} {CONFIG_FORMAT_HELP}",
    )


def sidecar_config_option(help_text: str) -> Callable[[F], F]:
    """`--config FILE` (optional: an injected sidecar gets its settings in $KUBEREFIT_CONFIG),
    passed to the command as `config_path`; read it with `load_service_config`."""
    return click.option(
        "--config",
        "config_path",
        default=None,
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        help=f"{help_text} {CONFIG_FORMAT_HELP} Default: the settings in ${CONFIG_ENV} "
        "(set by injection).",
    )


def load_service_config(model: type[M], config_path: Path | None) -> M:
    """The settings: the `--config` file, else the text in $KUBEREFIT_CONFIG."""
    if config_path is not None:
        return load_config(model, path=config_path)
    text = os.environ.get(CONFIG_ENV, "").strip()
    if not text:
        raise click.UsageError(f"give --config FILE or set ${CONFIG_ENV} to the settings")
    return load_config(model, text=text, source=f"${CONFIG_ENV}")


def import_model(ref: str) -> type[BaseModel]:
    """The settings model at 'module:Class' (imported only when a command needs it)."""
    module, _, name = ref.partition(":")
    model = getattr(importlib.import_module(module), name)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise TypeError(f"{ref} is not a pydantic model")
    return model


def config_command(model_ref: str) -> click.Command:
    """`<component> config --example | --schema | --check FILE` for the model at `model_ref`."""
    name = model_ref.rpartition(":")[2]

    @click.command("config", epilog=CONFIG_EXIT_HELP)
    @click.option(
        "--example", is_flag=True, help="Print a commented YAML example with every default."
    )
    @click.option("--schema", is_flag=True, help="Print the settings' JSON schema.")
    @click.option(
        "--check",
        "check",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        default=None,
        help=f"Validate FILE (YAML or JSON, {CONFIG_BOUNDS_HELP}) without starting anything.",
    )
    @service_command
    def config(example: bool, schema: bool, check: Path | None) -> None:
        if sum((example, schema, check is not None)) != 1:
            raise click.UsageError("give exactly one of --example, --schema, --check FILE")
        model = import_model(model_ref)
        if example:
            click.echo(example_yaml(model), nl=False)
        elif schema:
            click.echo(json.dumps(model.model_json_schema(), indent=2))
        else:
            assert check is not None
            load_config(model, path=check)
            click.echo(f"{check}: valid {model.__name__}")

    config.help = f"Show or check this component's settings ({name})."
    return config


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
        where = ".".join(_shortened(str(p)) for p in first["loc"])  # a key may be huge
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


def _shortened(text: str, limit: int = 60) -> str:
    """`text`, cut to `limit` characters (with "...") so that one line stays readable."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes")


def fail_startup(prog: str, message: str) -> NoReturn:
    """Print `<prog>: error: <message>` on stderr and exit with `STARTUP_ERROR_EXIT`."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(STARTUP_ERROR_EXIT)


class _Phase:
    started = False


def mark_started() -> None:
    """A service says it is up (listening): from now on only a ConfigurationError is one line
    and exit 2; any other error keeps its traceback and exits 1, as the help says."""
    _Phase.started = True


def run_service(prog: str, fn: Callable[[], T]) -> T:
    """Run a service's entry point; a configuration error during start-up (or a
    ConfigurationError at any time) becomes one line on stderr and exit status 2
    (`startup_error_message`), with the traceback only with --debug / ${DEBUG_ENV}=1."""
    _Phase.started = False
    try:
        return fn()
    except (ValueError, OSError) as exc:
        late = _Phase.started and not isinstance(exc, ConfigurationError)
        message = None if late else startup_error_message(exc)
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


def _set_env(name: str, value: str) -> Callable[[click.Context, click.Parameter, Any], None]:
    def callback(_: click.Context, __: click.Parameter, given: Any) -> None:
        if given:
            os.environ[name] = value if value else str(given).lower()

    return callback


def common_options() -> list[click.Option]:
    """--log-level, --log-format and --debug: every command has them. They set the variables
    the processes read (so child processes inherit them) before the command runs."""
    return [
        click.Option(
            ["--log-level"],
            type=click.Choice(LEVELS, case_sensitive=False),
            expose_value=False,
            is_eager=True,
            callback=_set_env(LOG_LEVEL_ENV, ""),
            help=f"Log level (debug also logs every HTTP request). Default: ${LOG_LEVEL_ENV}, "
            "else info.",
        ),
        click.Option(
            ["--log-format"],
            type=click.Choice(FORMATS, case_sensitive=False),
            expose_value=False,
            is_eager=True,
            callback=_set_env(LOG_FORMAT_ENV, ""),
            help=f"json (one object per line) or console. Default: ${LOG_FORMAT_ENV}, else json "
            "in a pod or when stderr is not a terminal.",
        ),
        click.Option(
            ["--debug"],
            is_flag=True,
            expose_value=False,
            is_eager=True,
            callback=_set_env(DEBUG_ENV, "1"),
            help=f"Print the Python traceback of a refused start-up (or set ${DEBUG_ENV}=1).",
        ),
    ]


def add_common_options(command: click.Command) -> click.Command:
    """Give `command` and every command below it the `common_options` (once)."""
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            add_common_options(sub)
        return command
    present = {name for p in command.params for name in p.opts}
    command.params.extend(o for o in common_options() if not set(o.opts) & present)
    return command


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
            main.add_command(add_common_options(command), name)
    return main


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    build()(args=argv)


if __name__ == "__main__":
    main()
