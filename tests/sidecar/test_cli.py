"""A refused start-up of a sidecar is one line on stderr and exit status 2, never a traceback:
`kuberefit receiver serve` / `kuberefit producer serve` as real processes (settings from
$KUBEREFIT_CONFIG, as injected), and the `python -m` entry points in process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from refit_sidecar.producer import __main__ as producer_main
from refit_sidecar.producer import main as producer_process
from refit_sidecar.receiver import __main__ as receiver_main
from refit_sidecar.receiver import node as receiver_process

KUBEREFIT = Path(sys.executable).parent / "kuberefit"


def cases(tmp_path: Path) -> list[tuple[str, str, str]]:
    """(service, $KUBEREFIT_CONFIG, what the error line must name)."""
    missing = str(tmp_path / "missing-token")
    inbox = {"inbox": str(tmp_path / "inbox")}
    return [
        ("receiver", json.dumps({"node": "n", "host": "0.0.0.0"}), "without a token"),
        ("receiver", json.dumps({"node": "n", "token_file": missing}), missing),
        ("receiver", '{"node": "n", "port": ', "$KUBEREFIT_CONFIG: not valid JSON at line 1"),
        # libyaml reports an unclosed flow sequence where the input ends
        ("receiver", "node: n\nport: [", "$KUBEREFIT_CONFIG: not valid YAML at line 3"),
        ("receiver", "node: n\nnode_name: x", "node_name: Extra inputs are not permitted"),
        ("producer", json.dumps({"host": "0.0.0.0", "staging": inbox}), "without a token"),
        ("producer", json.dumps({"token_file": missing, "staging": inbox}), missing),
        ("producer", json.dumps({"port": "http", "staging": inbox}), "ProducerProcessConfig: port"),
    ]


def test_refused_start_up_is_one_line_and_exit_2(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBEREFIT_")}
    procs = [
        (
            service,
            must_name,
            subprocess.Popen(
                [str(KUBEREFIT), service, "serve"],
                env=env | {"KUBEREFIT_CONFIG": config},
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
        for service, config, must_name in cases(tmp_path)
    ]  # all at once: each process fails within a couple of seconds
    for service, must_name, proc in procs:
        _, err = proc.communicate(timeout=120)
        assert "Traceback" not in err, err
        lines = [line for line in err.splitlines() if line.strip()]
        assert proc.returncode == 2, (service, err)
        assert len(lines) == 1, err
        assert lines[-1].startswith(f"kuberefit {service} serve: error: "), lines
        assert must_name in lines[-1], lines


def test_debug_env_keeps_the_traceback(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBEREFIT_")}
    config = json.dumps({"node": "n", "host": "0.0.0.0"})
    proc = subprocess.run(
        [str(KUBEREFIT), "receiver", "serve"],
        env=env | {"KUBEREFIT_CONFIG": config, "KUBEREFIT_DEBUG": "1"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr
    assert "without a token" in proc.stderr


@pytest.mark.parametrize(
    ("main", "prog", "config", "must_name"),
    [
        (receiver_main.main, "receiver", {"node": "n", "host": "0.0.0.0"}, "without a token"),
        (producer_main.main, "producer", {"host": "::", "staging": {"inbox": "x"}}, "'::'"),
        (receiver_main.main, "receiver", {"node": "n", "queue_groups": 0}, "queue_groups"),
        (
            producer_main.main,
            "producer",
            {"token_file": "tok", "staging": {"inbox": "x"}},
            "config-dir/tok: No such file",  # relative to the settings file
        ),
    ],
)
def test_python_m_entry_points(
    main: object,
    prog: str,
    config: dict[str, object],
    must_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for key in ("KUBEREFIT_TOKEN", "KUBEREFIT_TOKEN_FILE", "KUBEREFIT_DEBUG"):
        monkeypatch.delenv(key, raising=False)
    for module in (receiver_process, producer_process):
        # structlog would keep printing to this test's captured (then closed) stderr
        monkeypatch.setattr(module, "configure_logging", lambda **_: None)
    path = tmp_path / "config-dir" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    assert callable(main)
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(path)])
    assert exit_.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"python -m refit_sidecar.{prog} serve: error: ")
    assert must_name in lines[0]


def test_an_address_in_use_names_the_setting(tmp_path: Path) -> None:
    """The HTTP port and the relay endpoint are both checked; the line says which to change."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBEREFIT_")}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        relay = {"bind": f"tcp://127.0.0.1:{port}"}
        expected = {
            "http": (
                {"node": "n", "port": port},
                f"cannot listen on 127.0.0.1:{port} (setting `host/port`): address already in use",
            ),
            "relay": (
                {"node": "n", "port": 0, "relay": relay},
                f"cannot listen on tcp://127.0.0.1:{port} (setting `relay.bind`): address "
                "already in use",
            ),
        }
        procs = {
            what: subprocess.Popen(
                [str(KUBEREFIT), "receiver", "serve"],
                env=env | {"KUBEREFIT_CONFIG": json.dumps(config)},
                cwd=tmp_path,
                stderr=subprocess.PIPE,
                text=True,
            )
            for what, (config, _) in expected.items()
        }
        try:
            for what, proc in procs.items():
                _, err = proc.communicate(timeout=120)
                assert proc.returncode == 2, err
                last = err.strip().splitlines()[-1]  # after the warnings (no token, no vLLM)
                assert last == f"kuberefit receiver serve: error: {expected[what][1]}"
                assert "Traceback" not in err
        finally:  # a receiver that did start after all must not outlive the test
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
