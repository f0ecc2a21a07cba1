"""A stand-in trainer as its own process, publishing each version to its trainer sidecar.

`python -m refit_tools.local.trainer_node --config FILE` is the trainer container of the local
mode with separate processes: `SyntheticTrainer` (real BF16 rounding of FP32 master updates)
takes one step per version, writes that checkpoint (joining receivers and the dense reference
read it) and publishes it through `Publisher` to the producer sidecar
(`python -m refit_sidecar.producer`), exactly as a Megatron or FSDP trainer would. The first
export initializes the sidecar's baseline (no dense sync). Each version is exported once: retries,
coordinator failovers and takeovers work from what the sidecar staged. Every export is appended to
`exports.jsonl`, so tests can check exactly that.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import structlog
import torch
from pydantic import BaseModel, ConfigDict, Field

from refit_protocol.kit.logs import configure_logging
from refit_sidecar.trainer.errors import SidecarUnreachableError
from refit_sidecar.trainer.publisher import Publisher, PublisherConfig
from refit_sidecar.trainer.state_dict import StateDictSource
from refit_sidecar.trainer.synthetic import SyntheticTrainer

log = structlog.get_logger("kuberefit.trainer_node")


class TrainerNodeConfig(BaseModel):
    """A local stand-in trainer (one rank, one sidecar)."""

    model_config = ConfigDict(extra="forbid")

    publisher: PublisherConfig | None = Field(
        None,
        description="How to reach the trainer sidecar. None: what injection put in this "
        "container's environment (PublisherConfig.from_pod).",
    )
    checkpoints: Path = Field(
        description="Checkpoint root: v0/ is the initial model; v1/, v2/ ... are written here."
    )
    workdir: Path = Field(description="exports.jsonl goes here.")
    steps: int = Field(ge=1, description="Publish versions 1..steps, then exit.")
    seed: int = Field(0, description="Trainer seed.")
    relative_step: float = Field(1e-4, gt=0, description="Relative update size per step.")
    wait: bool = Field(True, description="Sync RL: each publish returns once committed.")
    release_dir: Path | None = Field(
        None,
        description="Lockstep: step to version N only once a file named N exists here (lets a "
        "supervisor check every committed version before the next one starts).",
    )


def run(config: TrainerNodeConfig) -> None:
    from safetensors.torch import load_file

    config.workdir.mkdir(parents=True, exist_ok=True)
    v0 = config.checkpoints / "v0"
    state = dict(sorted(load_file(str(next(iter(sorted(v0.glob("*.safetensors")))))).items()))
    publisher = Publisher(config.publisher or PublisherConfig.from_pod())
    _wait_for_sidecar(publisher)
    first = publisher.initialize(StateDictSource(state))
    log.info("trainer_node.initialized", fingerprint=first.fingerprint, chunks=first.chunks_sent)
    trainer = SyntheticTrainer(state, relative_step=config.relative_step, seed=config.seed)
    for version in range(1, config.steps + 1):
        while config.release_dir is not None and not (config.release_dir / str(version)).exists():
            time.sleep(0.05)
        new = dict(sorted(trainer.step().items()))
        _save(config.checkpoints, version, new)
        with (config.workdir / "exports.jsonl").open("a") as fh:
            fh.write(json.dumps({"version": version, "time": time.time()}) + "\n")
        result = publisher.publish(version, StateDictSource(new), wait=config.wait)
        log.info(
            "trainer_node.published",
            version=version,
            committed=result.committed,
            staged_s=round(result.staged_s, 3),
            wall_s=round(result.wall_s, 3),
        )


def _wait_for_sidecar(publisher: Publisher, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            publisher.status()
            return
        except SidecarUnreachableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _save(root: Path, version: int, tensors: dict[str, torch.Tensor]) -> None:
    """Write checkpoint `version` atomically (a reader never sees a partial directory)."""
    from safetensors.torch import save_file

    final = root / f"v{version}"
    tmp = root / f".v{version}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copy(root / "v0" / "config.json", tmp / "config.json")
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp / "model.safetensors"))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m refit_tools.local.trainer_node")
    parser.add_argument("--config", required=True, type=Path, help="TrainerNodeConfig JSON")
    args = parser.parse_args(argv)
    configure_logging()
    run(TrainerNodeConfig.model_validate_json(args.config.read_text()))


if __name__ == "__main__":
    main()
