"""The in-process applier: a torch module living in the receiver's own process (local mode,
benches and tests), written through `ApplyContext` (❻)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from refit_protocol.receiver_api import RankPrewarm
from refit_sidecar.apply import ApplyContext, NativeModel, prewarm
from refit_sidecar.apply.audit import audit
from refit_sidecar.apply.checkpoint import checkpoint_files, checkpoint_tensors, feed_checkpoint
from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.codec.wire import DecodedPayload
from refit_sidecar.receiver.appliers.base import ApplyReport, StagedPayload


class InProcessApplier:
    """Applies through `ApplyContext` on a torch module living in this process."""

    def __init__(self, model: NativeModel, device: torch.device | str = "cpu") -> None:
        self.model = model
        self.device = torch.device(device)
        self.ctx: ApplyContext | None = None
        self.gate_closed = False

    def prewarm(self, metas: Mapping[str, TensorMeta]) -> list[RankPrewarm]:
        ctx = ApplyContext(self.model, dict(metas), device=self.device)
        report = prewarm(ctx)
        self.ctx = ctx
        return [
            RankPrewarm(
                rank=0,
                skipped=sorted(report.skipped),
                xor_incompatible=dict(report.xor_incompatible),
                unsupported=dict(report.unsupported),
                scratch_bytes=report.scratch_bytes,
            )
        ]

    def stage(self, decoded: DecodedPayload) -> StagedPayload:
        return StagedPayload(decoded.header, decoded.raw_size, items=decoded.items)

    def apply(self, batch: Sequence[StagedPayload], check_samples: int) -> ApplyReport:
        if self.ctx is None:
            raise RuntimeError("apply before prewarm")
        t0 = time.perf_counter()
        report = ApplyReport()
        for staged in batch:
            assert staged.items is not None
            stats = self.ctx.apply(staged.items, check_samples=check_samples)
            report.payloads += 1
            report.items += stats.items
            report.values += stats.values
            report.checks += stats.checks
        report.seconds = time.perf_counter() - t0
        return report

    def discard(self, staged: StagedPayload) -> None:
        staged.items = None

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def gate(self, closed: bool) -> None:
        self.gate_closed = closed  # nothing serves from this module: the flag is the gate

    def restore(self, source: str) -> set[str]:
        names = feed_checkpoint(self.model, checkpoint_files(source))
        self.ctx = None  # prewarm again: the loader may have replaced storages
        return names

    def audit(self, source: str) -> list[dict[str, Any]]:
        """One rank's audit against the checkpoint directory `source` (nothing is written)."""
        if self.ctx is None:
            raise RuntimeError("audit before prewarm")
        report = audit(self.ctx, checkpoint_tensors(checkpoint_files(source), self.ctx.metas))
        return [report.to_json() | {"rank": 0}]

    def close(self) -> None:
        self.ctx = None
