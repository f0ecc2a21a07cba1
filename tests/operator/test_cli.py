"""`kuberefit coordinator serve` and `kuberefit operator serve` refuse bad settings with one
line and exit status 2 (no traceback; $KUBEREFIT_DEBUG=1 keeps it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from refit_operator.cli import commands
from refit_protocol.kit import logs


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("KUBEREFIT_DEBUG", "KUBEREFIT_TOKEN", "KUBEREFIT_TOKEN_FILE"):
        monkeypatch.delenv(key, raising=False)
    # structlog would keep printing to CliRunner's stderr after the test closed it
    monkeypatch.setattr(logs, "configure_logging", lambda **_: None)


def one_line(args: list[str]) -> str:
    result = CliRunner().invoke(commands, args, prog_name="kuberefit")
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.output
    assert len(lines) == 1, lines
    return lines[0]


def test_coordinator_with_invalid_settings(tmp_path: Path) -> None:
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"until_version": "soon"}))
    line = one_line(["coordinator", "serve", "--config", str(config)])
    assert line.startswith("kuberefit coordinator serve: error: invalid CoordinatorServiceConfig: ")
    config.write_text("{not json")
    assert one_line(["coordinator", "serve", "--config", str(config)]) == (
        f"kuberefit coordinator serve: error: {config}: not valid JSON at line 1 column 2: "
        "Expecting property name enclosed in double quotes"
    )


def test_operator_with_a_missing_token_file(tmp_path: Path) -> None:
    missing = tmp_path / "token"
    line = one_line(
        ["operator", "serve", "--metrics-bind", "127.0.0.1:0", "--metrics-token-file", str(missing)]
    )
    assert (
        line == f"kuberefit operator serve: error: cannot read {missing}: No such file or directory"
    )


def test_operator_without_a_namespace_for_its_leases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cluster-wide, outside a pod ($POD_NAMESPACE unset): the Leases have no home."""
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    token = tmp_path / "token"
    token.write_text("t" * 32)
    line = one_line(
        ["operator", "serve", "--metrics-bind", "127.0.0.1:0", "--metrics-token-file", str(token)]
    )
    assert line == (
        "kuberefit operator serve: error: the operator keeps its Leases in its own namespace: "
        "set $POD_NAMESPACE (the chart does, from the downward API) or --lease-namespace"
    )
