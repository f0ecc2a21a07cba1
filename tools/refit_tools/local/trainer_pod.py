"""A local trainer pod: the trainer sidecar (`python -m refit_sidecar.producer`) and a stand-in
trainer (`python -m refit_tools.local.trainer_node`) publishing every version through it.

Both are real processes, as in a pod. The trainer writes checkpoint `vN` under `checkpoints`
before it publishes N (joining receivers and dense references read it) and, with a release
directory, steps to version N only once a file named N exists there (lockstep for supervisors
that check every committed version). Its exports are logged in `root/trainer/exports.jsonl`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from refit_tools.local.procs import ManagedProcess, http_ok


@dataclass
class LocalTrainerPod:
    """One producer and its trainer; `checkpoints/v0` must hold the initial model."""

    name: str
    root: Path
    port: int
    token_file: Path
    checkpoints: Path
    steps: int
    seed: int = 0
    release_dir: Path | None = None
    producer: ManagedProcess | None = None
    trainer: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch_producer(self) -> ManagedProcess:
        """Start the trainer sidecar without waiting (see `wait_producer`)."""
        config = {
            "port": self.port,
            "token_file": str(self.token_file),
            "baseline": {"directory": str(self.root / "baseline"), "export_chunk_bytes": 256 << 10},
            "staging": {
                "inbox": str(self.root / "inbox"),
                "candidate_dir": str(self.root / "candidates"),
                "reference_checkpoint": str(self.checkpoints / "v0"),
            },
            "transport": {"root": "", "stop_timeout_s": 10},
        }
        path = self.root / "producer.json"
        path.write_text(json.dumps(config))
        self.producer = ManagedProcess(
            f"{self.name}-producer",
            [sys.executable, "-m", "refit_sidecar.producer", "--config", str(path)],
            self.root / "producer.log",
        ).launch()
        return self.producer

    def wait_producer(self, timeout: float = 120) -> None:
        assert self.producer is not None, "launch_producer first"
        self.producer.wait_ready(lambda: http_ok(self.url + "/healthz"), timeout=timeout)

    def start_trainer(self) -> ManagedProcess:
        """Start the stand-in trainer (it first initializes the sidecar's baseline)."""
        config = {
            "publisher": {
                "url": self.url,
                "inbox": str(self.root / "inbox"),
                "token_file": str(self.token_file),
            },
            "checkpoints": str(self.checkpoints),
            "workdir": str(self.root / "trainer"),
            "steps": self.steps,
            "seed": self.seed,
            "release_dir": str(self.release_dir) if self.release_dir else None,
        }
        path = self.root / "trainer.json"
        path.write_text(json.dumps(config))
        self.trainer = ManagedProcess(
            f"{self.name}-trainer",
            [sys.executable, "-m", "refit_tools.local.trainer_node", "--config", str(path)],
            self.root / "trainer.log",
        ).launch()
        return self.trainer

    def release(self, version: int) -> None:
        """Let the trainer step to `version` (lockstep mode)."""
        assert self.release_dir is not None, "no release directory: the trainer runs freely"
        (self.release_dir / str(version)).touch()

    def stop(self) -> None:
        for proc in (self.trainer, self.producer):
            if proc is not None:
                proc.stop()
