"""`kuberefit coordinator` (refit_operator.coordinator_service) as a user meets it: misspelt
settings are refused, and a receiver that refuses the coordinator's token stops it at once with
one line that names the node, instead of being waited for as an absent node (issue 19)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from pydantic import ValidationError
from safetensors.torch import save_file

from refit_operator.coordinator_service import CoordinatorServiceConfig
from tests.harness.operator_env import REPO, wait_for
from tests.harness.procs import free_port
from tests.harness.receivers import start_cluster
from tests.sidecar.receiver.models import canonical

BASE = {
    "policy": "p",
    "store_path": "/tmp/never-opened.sqlite",
    "producers": ["http://127.0.0.1:1"],
    "nodes": [{"name": "n0", "url": "http://127.0.0.1:2"}],
    "checkpoint_template": "/ckpt/v{version}",
}


@pytest.mark.parametrize(
    ("coordinator", "field"),
    [
        ({"snyc": False}, "snyc"),
        ({"max_attempt": 10}, "max_attempt"),
        ({"check_samples": -5}, "check_samples"),
    ],
)
def test_misspelt_or_invalid_coordinator_settings_are_refused(
    coordinator: dict[str, object], field: str
) -> None:
    with pytest.raises(ValidationError, match=field):
        CoordinatorServiceConfig.model_validate({**BASE, "coordinator": coordinator})


def test_a_receiver_refusing_the_token_stops_the_coordinator_with_one_line(
    tmp_path: Path,
) -> None:
    recording = {
        "kind": "factory",
        "factory": "tests.sidecar.receiver.models:recording_applier",
        "options": {"log_path": str(tmp_path / "applied.jsonl")},
    }
    cluster = start_cluster(tmp_path, 1, applier=lambda _i, _log: recording)
    try:
        (tmp_path / "v0").mkdir()
        save_file(canonical(0), str(tmp_path / "v0" / "model.safetensors"))
        node = cluster.nodes[0]
        config = {
            **BASE,
            "store_path": str(tmp_path / "store.sqlite"),
            "producers": [f"http://127.0.0.1:{free_port()}"],
            "nodes": [{"name": node.name, "url": node.http, "relay_endpoint": node.relay}],
            "checkpoint_template": str(tmp_path / "v{version}"),
            "token": "not-the-receivers-token",
        }
        path = tmp_path / "coordinator.json"
        path.write_text(json.dumps(config))
        out = subprocess.run(
            [str(REPO / ".venv/bin/kuberefit"), "coordinator", "serve", "--config", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=REPO,
        )
    finally:
        cluster.stop_all()
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert node.name in lines[0]
    assert "HTTP 401" in lines[0]
    assert "token" in lines[0]


def test_sigterm_stops_the_coordinator_with_exit_0_and_a_down_producer_is_not_a_flood(
    tmp_path: Path,
) -> None:
    """SIGTERM is a normal stop (exit 0, as the sidecars), safe at any point; a producer that
    stays down is logged once per window with a count, not once per poll."""
    (tmp_path / "v0").mkdir()
    save_file(canonical(0), str(tmp_path / "v0" / "model.safetensors"))
    config = {
        **BASE,
        "store_path": "store.sqlite",  # relative to the settings file
        "producers": [f"http://127.0.0.1:{free_port()}"],
        "nodes": [],
        "checkpoint_template": "v{version}",
        "poll_s": 0.05,
    }
    path = tmp_path / "coordinator.yaml"
    path.write_text(json.dumps(config))
    log = tmp_path / "coordinator.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBEREFIT_")}
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [str(REPO / ".venv/bin/kuberefit"), "coordinator", "serve", "--config", str(path)],
            stderr=sink,
            env=env | {"KUBEREFIT_LOG_FORMAT": "json"},
            cwd=REPO,
        )
        try:
            wait_for("the settings line", lambda: "coordinator.settings" in log.read_text())
            time.sleep(3)  # ~60 polls of a producer that refuses connections
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            proc.kill()
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    events = [line["event"] for line in lines]
    assert events[-1] == "coordinator.stopped", events
    assert (tmp_path / "store.sqlite").is_file()
    settings = next(line["settings"] for line in lines if line["event"] == "coordinator.settings")
    assert settings["store_path"] == str(tmp_path / "store.sqlite")
    assert len(events) < 15, events  # one line per event and window, not one per poll
