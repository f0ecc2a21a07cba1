"""`run_service`: a configuration error is one line '<command>: error: <reason>' on stderr and
exit status 2; anything else keeps its traceback, and $KUBEREFIT_DEBUG=1 keeps it for all."""

from __future__ import annotations

import asyncio
import errno
import socket
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from pydantic import BaseModel, Field, SecretStr

from refit_protocol.errors import ConfigurationError
from refit_protocol.kit.auth import require_token_or_loopback, resolve_token
from refit_protocol.kit.cli import (
    DEBUG_ENV,
    STARTUP_ERROR_HELP,
    mark_started,
    run_service,
    service_command,
    startup_error_message,
)


class Settings(BaseModel):
    port: int = Field(ge=1)
    host: str = "127.0.0.1"


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEBUG_ENV, raising=False)


def refusal(fn: object, capsys: pytest.CaptureFixture[str]) -> str:
    assert callable(fn)
    with pytest.raises(SystemExit) as exit_:
        run_service("kuberefit thing serve", fn)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("kuberefit thing serve: error: ")
    assert "Traceback" not in err
    return err.strip()


def test_invalid_settings_name_the_first_bad_field(capsys: pytest.CaptureFixture[str]) -> None:
    line = refusal(lambda: Settings.model_validate_json('{"port": 0, "host": 5}'), capsys)
    assert "invalid Settings: port: Input should be greater than or equal to 1" in line
    assert "(and 1 more)" in line
    line = refusal(lambda: Settings.model_validate_json("{oops"), capsys)
    assert "invalid Settings: Invalid JSON" in line


def test_token_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = refusal(
        lambda: require_token_or_loopback("receiver n", ["0.0.0.0"], None, allow_insecure=False),
        capsys,
    )
    assert "refusing to listen on ['0.0.0.0'] without a token" in line
    empty = tmp_path / "token"
    empty.write_text("\n")
    assert f"token file {empty} is empty" in refusal(lambda: resolve_token(None, empty), capsys)
    missing = tmp_path / "nope"
    line = refusal(lambda: resolve_token(SecretStr(""), missing), capsys)
    assert line.endswith(f"cannot read {missing}: No such file or directory")


def test_address_in_use_names_host_and_port(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        async def serve() -> None:
            await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", port)

        line = refusal(lambda: asyncio.run(serve()), capsys)
    assert f"cannot listen on 127.0.0.1:{port}: address already in use" in line


def test_other_errors_keep_their_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def boom() -> None:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        run_service("x", boom)

    def refused() -> None:
        raise ConnectionRefusedError(errno.ECONNREFUSED, "refused")

    with pytest.raises(ConnectionRefusedError):
        run_service("x", refused)
    assert startup_error_message(KeyError("k")) is None
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(ValueError, match="without a token"):
        run_service(
            "x", lambda: require_token_or_loopback("p", ["10.0.0.1"], None, allow_insecure=False)
        )
    assert capsys.readouterr().err == ""
    assert run_service("x", lambda: 42) == 42


def test_service_command_is_named_after_the_command_path() -> None:
    @click.group()
    def top() -> None: ...

    @top.group()
    def thing() -> None: ...

    @thing.command("serve", epilog=STARTUP_ERROR_HELP)
    @click.option("--port", type=int, default=0)
    @service_command
    def serve(port: int) -> None:
        Settings(port=port)

    result = CliRunner().invoke(top, ["thing", "serve"], prog_name="kuberefit")
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "kuberefit thing serve: error: invalid Settings: port: Input should be greater than "
        "or equal to 1"
    ]
    assert "KUBEREFIT_DEBUG=1" in CliRunner().invoke(top, ["thing", "serve", "--help"]).output


def test_after_start_up_only_a_configuration_error_is_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Hours in, a full disk is a bug report (traceback, exit 1), not a refused start-up; a
    peer refusing the token stays a configuration error (one line, exit 2) at any time."""

    def late(exc: Exception) -> None:
        mark_started()
        raise exc

    with pytest.raises(OSError, match="No space left"):
        run_service("kuberefit thing serve", lambda: late(OSError(28, "No space left", "p")))
    line = refusal(lambda: late(ConfigurationError("node n refused the token")), capsys)
    assert line == "kuberefit thing serve: error: node n refused the token"
    # the next run starts over: an error before start-up is one line again
    assert "cannot read p" in refusal(lambda: _raise(OSError(2, "No such file", "p")), capsys)


def _raise(exc: Exception) -> None:
    raise exc
