"""Trainers that finish (issue 32): a trainer sidecar that is a regular container exits after its
trainer, so a Job's pod completes. Real processes: `kuberefit producer serve` and trainer
processes that open a real `Publisher`, killed or ending on their own."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from refit_protocol.pod_contract import CONFIG_ENV
from refit_protocol.producer_api import ProducerStatus
from refit_sidecar.producer.trainer_exit import pending, wait_for_trainer_exit
from refit_sidecar.trainer.liveness import TrainerPresence, TrainerState, trainer_state
from refit_tools.local.procs import free_port

KUBEREFIT = Path(sys.executable).parent / "kuberefit"
TOKEN = "trainer-exit-token"

TRAINER = """
import sys, time
from refit_sidecar.trainer.publisher import Publisher, PublisherConfig
publisher = Publisher(PublisherConfig(url=sys.argv[1], inbox=sys.argv[2], token=sys.argv[3]))
print("running", flush=True)
time.sleep(float(sys.argv[4]))
if sys.argv[5] == "close":
    publisher.close()
"""


def test_the_trainer_state_follows_the_lock_and_the_done_marker(tmp_path: Path) -> None:
    assert trainer_state(tmp_path) is TrainerState.ABSENT  # not started yet
    presence, rank1 = TrainerPresence(tmp_path), TrainerPresence(tmp_path)
    presence.announce()
    rank1.announce()  # a second rank shares the lock
    assert trainer_state(tmp_path) is TrainerState.RUNNING
    assert trainer_state(tmp_path) is TrainerState.RUNNING  # a probe never keeps the lock
    presence.done()
    assert trainer_state(tmp_path) is TrainerState.RUNNING  # rank 1 still runs
    rank1.done()
    assert trainer_state(tmp_path) is TrainerState.DONE
    again = TrainerPresence(tmp_path)  # a restarted trainer clears the marker of the last run
    again.announce()
    assert trainer_state(tmp_path) is TrainerState.RUNNING
    os.close(again._fd or -1)  # a crash: the kernel releases the lock, no marker is written
    assert trainer_state(tmp_path) is TrainerState.GONE
    assert [p.name for p in tmp_path.iterdir()] == ["trainer.alive"]  # nothing left aside


def test_a_trainer_without_an_inbox_still_starts(tmp_path: Path) -> None:
    TrainerPresence(tmp_path / "missing").announce()  # logged, never raised


def test_the_sidecar_waits_for_what_was_published_then_for_no_longer_than_its_grace(
    tmp_path: Path,
) -> None:
    """After the trainer is gone, a staged candidate above the committed version holds the
    exit until its transition commits, or until the grace ends."""
    presence = TrainerPresence(tmp_path)
    presence.announce()
    statuses = iter(
        [
            ProducerStatus(
                producer=0, committed_version=3, committed_baseline="b", candidate_version=4
            ),
            ProducerStatus(
                producer=0, committed_version=4, committed_baseline="b", candidate_version=4
            ),
        ]
    )
    seen: list[ProducerStatus] = []

    def status() -> ProducerStatus:
        seen.append(next(statuses))
        return seen[-1]

    async def scenario(grace_s: float) -> str:
        task = asyncio.create_task(
            wait_for_trainer_exit(tmp_path, "when_gone", status, grace_s=grace_s, poll_s=0.02)
        )
        await asyncio.sleep(0.1)
        assert not task.done()  # the trainer runs
        presence.done()
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(scenario(30.0)) == "trainer exited; nothing pending"
    assert [pending(s) for s in seen] == [True, False]
    stuck = ProducerStatus(
        producer=0, committed_version=3, committed_baseline="b", pending_attempt="a-4"
    )
    presence.announce()
    statuses = iter([stuck] * 1000)  # a transition that never commits
    assert asyncio.run(scenario(0.1)) == "trainer exited; grace ended with a version pending"


class Sidecar:
    """`kuberefit producer serve` as injection configures it for a Job's pod."""

    def __init__(self, root: Path, mode: str) -> None:
        self.inbox = root / "inbox"
        self.inbox.mkdir(parents=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        settings = {
            "port": self.port,
            "token": TOKEN,
            "exit_with_trainer": mode,
            "exit_grace_s": 30,
            "baseline": {"directory": str(root / "baseline")},
            "staging": {"inbox": str(self.inbox), "candidate_dir": str(root / "candidates")},
        }
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBEREFIT_")}
        self.log = root / "sidecar.log"
        self.proc = subprocess.Popen(
            [str(KUBEREFIT), "producer", "serve"],
            env=env | {CONFIG_ENV: json.dumps(settings), "KUBEREFIT_LOG_FORMAT": "json"},
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("w"),
        )

    def trainer(self, run_s: float, end: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", TRAINER, self.url, str(self.inbox), TOKEN, str(run_s), end],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "running"
        return proc

    def exit_code(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def events(self) -> list[str]:
        out = []
        for line in self.log.read_text().splitlines():
            try:
                out.append(str(json.loads(line).get("event")))
            except ValueError:
                continue
        return out


@pytest.fixture
def sidecars() -> Iterator[list[Sidecar]]:
    made: list[Sidecar] = []
    yield made
    for s in made:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


def test_a_jobs_sidecar_exits_0_once_its_trainer_is_gone(
    tmp_path: Path, sidecars: list[Sidecar]
) -> None:
    """restartPolicy Never: however the trainer ends (here it is SIGKILLed), the sidecar
    exits 0 within a poll or two, so the Job's pod completes with the trainer's verdict."""
    sidecar = Sidecar(tmp_path / "never", "when_gone")
    sidecars.append(sidecar)
    trainer = sidecar.trainer(60, "exit")
    assert sidecar.exit_code(2) is None  # serving while the trainer runs
    assert "producer.trainer_seen" in sidecar.events()
    started = time.monotonic()
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    assert sidecar.exit_code(30) == 0, sidecar.log.read_text()[-2000:]
    assert time.monotonic() - started < 15
    assert "producer.exiting" in sidecar.events()


def test_under_on_failure_only_a_trainer_that_closed_its_publisher_ends_the_sidecar(
    tmp_path: Path, sidecars: list[Sidecar]
) -> None:
    """restartPolicy OnFailure: a crashed trainer is restarted and needs its sidecar, so a
    killed trainer does not end it; one that closes its publisher does."""
    sidecar = Sidecar(tmp_path / "on-failure", "when_done")
    sidecars.append(sidecar)
    crashed = sidecar.trainer(60, "exit")
    crashed.send_signal(signal.SIGKILL)
    crashed.wait()
    assert sidecar.exit_code(4) is None  # the kubelet would restart the trainer
    finished = sidecar.trainer(0.5, "close")
    assert finished.wait(timeout=60) == 0
    assert sidecar.exit_code(30) == 0, sidecar.log.read_text()[-2000:]
