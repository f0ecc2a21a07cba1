"""Pluggable appliers: what actually writes a validated payload into the serving weights.

The receiver core owns validation, dedup, order and backpressure; an applier only prewarms,
turns a validated payload into what it applies (`stage`), applies a group of staged payloads
in the order given, and synchronizes the device. Two implementations: `InProcessApplier`
(a torch module in this process: tests and the local mode) and `VllmHttpApplier`
(`vllm_applier.py`, the vLLM server's /collective_rpc in pods).
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from refit_protocol.receiver_api import RankPrewarm
from refit_sidecar.apply import ApplyContext, NativeModel, prewarm
from refit_sidecar.apply.checkpoint import checkpoint_files, feed_checkpoint
from refit_sidecar.codec.records import Item, TensorMeta
from refit_sidecar.codec.wire import DecodedPayload, PayloadHeader


@dataclass
class StagedPayload:
    """A validated payload ready to apply: decoded items (in process) or a file (vLLM)."""

    header: PayloadHeader
    nbytes: int  # host bytes held for it (decoded or staged), for accounting
    items: list[Item] | None = None
    path: Path | None = None


@dataclass
class ApplyReport:
    payloads: int = 0
    items: int = 0
    values: int = 0
    checks: int = 0
    seconds: float = 0.0
    per_rank: list[dict[str, Any]] = field(default_factory=list)


class Applier(Protocol):
    """How a node writes weights. Calls come from one apply thread, never concurrently."""

    def prewarm(self, metas: Mapping[str, TensorMeta]) -> list[RankPrewarm]:
        """Reserve scratch and classify every canonical name, per rank."""
        ...

    def stage(self, body: bytes | memoryview, decoded: DecodedPayload) -> StagedPayload:
        """Hold a validated payload until its turn (may be called from staging threads)."""
        ...

    def apply(self, batch: Sequence[StagedPayload], check_samples: int) -> ApplyReport:
        """Apply the payloads in the given (declared) order; raise to fail the attempt."""
        ...

    def discard(self, staged: StagedPayload) -> None:
        """Drop a staged payload that will not be applied (obsolete/stopped attempt)."""
        ...

    def sync(self) -> None:
        """Block until every write is visible on the device (flush's completion ACK)."""
        ...

    def gate(self, closed: bool) -> None:
        """Close (hold new requests, wait for in-flight ones) or reopen the request gate."""
        ...

    def restore(self, source: str) -> set[str]:
        """Dense load of every tensor of a safetensors checkpoint directory (joining node);
        returns the canonical names loaded (on every rank)."""
        ...

    def close(self) -> None: ...


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

    def stage(self, body: bytes | memoryview, decoded: DecodedPayload) -> StagedPayload:
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

    def close(self) -> None:
        self.ctx = None


def load_object(spec: str) -> Any:
    """Import 'package.module:attribute' (trusted configuration, never received data)."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"factory must look like 'package.module:callable', got {spec!r}")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
