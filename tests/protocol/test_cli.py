"""The `kuberefit` command joins each installed package's click group: every command of the
full install is there with its options unchanged, a package that is not installed contributes
nothing, and a broken package is an error rather than a silently missing command."""

from __future__ import annotations

import os
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from refit_protocol.kit import cli


def test_full_install_lists_every_package_command() -> None:
    main = cli.build()
    assert set(main.commands) == {
        "bench",
        "coordinator",
        "demo",
        "operator",
        "plan",
        "producer",
        "receiver",
        "verify",
        "vllm-bundle",
    }
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert "kuberefit" in result.output


def test_a_package_that_is_not_installed_contributes_nothing() -> None:
    ep = EntryPoint("ghost", "refit_ghost_package.cli:commands", cli.ENTRY_POINT_GROUP)
    assert cli._load(ep) is None


def test_a_broken_package_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The package is there but one of its own imports is missing: say so, do not hide it."""
    pkg = tmp_path / "refit_broken_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "cli.py").write_text("import refit_dependency_that_is_missing\n")
    (pkg / "notagroup.py").write_text("commands = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="refit_dependency_that_is_missing"):
        cli._load(EntryPoint("broken", "refit_broken_pkg.cli:commands", cli.ENTRY_POINT_GROUP))
    with pytest.raises(TypeError, match="not a click group"):
        cli._load(EntryPoint("odd", "refit_broken_pkg.notagroup:commands", cli.ENTRY_POINT_GROUP))
    sys.modules.pop("refit_broken_pkg", None)


def test_two_packages_may_not_contribute_the_same_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    @click.group()
    def one() -> None: ...

    @one.command("demo")
    def _demo() -> None: ...

    eps = [EntryPoint(n, f"x{n}:commands", cli.ENTRY_POINT_GROUP) for n in ("a", "b")]
    monkeypatch.setattr(cli, "entry_points", lambda group: eps)
    monkeypatch.setattr(cli, "_load", lambda ep: one)
    with pytest.raises(RuntimeError, match="'demo' is contributed twice"):
        cli.build()


def test_config_file_option_requires_an_existing_file(tmp_path: Path) -> None:
    @click.command()
    @cli.config_file_option("A config.")
    def show(config_path: Path) -> None:
        click.echo(config_path.name)

    missing = CliRunner().invoke(show, ["--config", str(tmp_path / "nope.json")])
    assert missing.exit_code == 2
    assert "does not exist" in missing.output
    (tmp_path / "c.json").write_text("{}")
    assert CliRunner().invoke(show, ["--config", str(tmp_path / "c.json")]).output == "c.json\n"


def leaf_commands() -> dict[str, click.Command]:
    found: dict[str, click.Command] = {}

    def walk(command: click.Command, path: str) -> None:
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                walk(sub, f"{path} {name}")
        else:
            found[path] = command

    walk(cli.build(), "kuberefit")
    return found


def test_one_grammar_help_on_every_option_and_exit_codes_in_help() -> None:
    leaves = leaf_commands()
    assert {
        "kuberefit receiver serve",
        "kuberefit producer serve",
        "kuberefit coordinator serve",
        "kuberefit operator serve",
        "kuberefit receiver config",
        "kuberefit producer config",
        "kuberefit coordinator config",
    } <= set(leaves)
    for path, command in leaves.items():
        options = [p for p in command.params if isinstance(p, click.Option)]
        assert {"--log-level", "--log-format", "--debug"} <= {o.opts[0] for o in options}, path
        for option in options:
            assert option.help, f"{path} {option.opts[0]} has no help"
        text = f"{command.help or ''} {command.epilog or ''}"
        assert "Exit codes:" in text, f"{path} does not say its exit codes"
    components = {path.split()[1] for path in leaves if path.endswith((" serve", " config"))}
    assert components == {"receiver", "producer", "coordinator", "operator"}
    bench = {path: leaves[path] for path in leaves if path.startswith("kuberefit bench ")}
    for path, command in bench.items():  # the same names for the same things
        names = {o.opts[0] for o in command.params if isinstance(o, click.Option)}
        assert {"--json", "--quick"} <= names, path
        assert not {"--size-mib", "--model-mib"} & names, path


def test_log_options_set_the_variables_children_inherit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key in ("KUBEREFIT_LOG_LEVEL", "KUBEREFIT_LOG_FORMAT"):
        monkeypatch.setenv(key, "")  # restored after the test, whatever the command sets
    result = CliRunner().invoke(
        cli.build(),
        ["receiver", "config", "--log-level", "DEBUG", "--log-format", "console", "--schema"],
    )
    assert result.exit_code == 0, result.output
    assert os.environ["KUBEREFIT_LOG_LEVEL"] == "debug"
    assert os.environ["KUBEREFIT_LOG_FORMAT"] == "console"
    result = CliRunner().invoke(cli.build(), ["receiver", "config", "--log-level", "loud"])
    assert result.exit_code == 2
    assert "'loud' is not one of" in result.output
