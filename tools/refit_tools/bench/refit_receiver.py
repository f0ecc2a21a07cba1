"""The rollout side of `kuberefit bench refit`: an in-process applier on canonical tensors.

Each receiver node process loads `bench_applier` by name (`applier.kind = "factory"`). It holds
the synthetic checkpoint in a serving layout (q/k/v and gate/up fused at row offsets, one generic
`load_weights`, as `kuberefit bench apply` uses), loaded densely at start, and applies payloads
through the real `InProcessApplier` (ApplyContext, storage-write hook). When the request gate
reopens — after the commit and the baseline update, so outside the timed window — it writes a
BLAKE2b digest of every canonical tensor's stored bits to a file the driver compares with the
trainer's target bits. That is the bench's post-apply verification.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog
import torch

from refit_sidecar.fingerprint import named_tensors_digest
from refit_sidecar.receiver.appliers.inprocess import InProcessApplier
from refit_tools.bench.apply import SyntheticServingModel
from refit_tools.bench.refit_workload import Workload

log = structlog.get_logger("kuberefit.bench.refit")


class BenchApplier(InProcessApplier):
    """`InProcessApplier` that digests its canonical tensors whenever the gate reopens."""

    def __init__(self, workload: Workload, digest_path: Path) -> None:
        self.layout = workload.layout()
        model = SyntheticServingModel(self.layout, empty=True)
        model.load_weights(workload.tensors())  # version 0, dense
        super().__init__(model)
        self.serving = model
        self.digest_path = digest_path
        self.reopens = 0

    def canonical(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each canonical tensor as a view of the serving parameter that holds it."""
        for name, shape in self.layout:
            key, offset = self.serving.slots[name]
            yield name, self.serving.params[key].detach().narrow(0, offset, shape[0])

    def gate(self, closed: bool) -> None:
        super().gate(closed)
        if not closed:
            self.reopens += 1
            t0 = time.perf_counter()
            digest = named_tensors_digest(self.canonical())
            tmp = self.digest_path.with_suffix(".tmp")
            tmp.write_text(
                json.dumps(
                    {"reopens": self.reopens, "digest": digest, "seconds": time.perf_counter() - t0}
                )
            )
            os.replace(tmp, self.digest_path)
            log.info("bench.digest", reopens=self.reopens, digest=digest)


def bench_applier(digest_path: str, workload: dict[str, Any]) -> BenchApplier:
    """Factory named in the receiver's config (`refit_tools.bench.refit_receiver:...`)."""
    return BenchApplier(Workload.model_validate(workload), Path(digest_path))


def read_digest(path: Path) -> tuple[int, str]:
    """(gate reopens so far, digest at the last one); (0, "") before the first."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return 0, ""
    return int(data["reopens"]), str(data["digest"])
