"""The audit: prove that a rank holds exactly what a dense load of a checkpoint would write,
with the rank's own native loader and no reference engine (issue 17, step 1).

For each canonical tensor of the checkpoint its bits go into scratch and the loader runs under
the storage-write hook in COMPARE mode: every final copy into model storage is compared, as
integer views, with the bits the destination holds, and nothing is written. Any other write into
model storage fails closed before it happens (`UnsupportedWriteError`), as in apply. The result
names every mismatching tensor with the count and the first positions and bit patterns, and the
names this rank's loader skips. Memory: one canonical tensor in scratch at a time, plus one
temporary of a destination view's size per intercepted copy.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import torch

from refit_sidecar.apply.context import ApplyContext
from refit_sidecar.apply.hook import Mode
from refit_sidecar.bits import int_view
from refit_sidecar.codec.records import TensorMeta


@dataclass
class TensorMismatch:
    """One destination view whose bits differ from a dense load of `name`."""

    name: str
    storages: tuple[str, ...]
    count: int
    positions: list[int]  # flat positions in the destination view (the first few)
    held_bits: list[int]
    expected_bits: list[int]


@dataclass
class AuditReport:
    """What one rank's audit found."""

    tensors: int = 0  # canonical tensors compared
    elements: int = 0  # destination elements compared
    copies: int = 0  # intercepted copies (none was performed)
    skipped: list[str] = field(default_factory=list)  # names this rank's loader skips
    mismatches: list[TensorMismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def mismatched_elements(self) -> int:
        return sum(m.count for m in self.mismatches)

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "ok": self.ok}


def audit(ctx: ApplyContext, tensors: Iterable[tuple[str, torch.Tensor]]) -> AuditReport:
    """Compare what `ctx`'s model holds with a dense load of `tensors` (name, canonical tensor),
    one tensor at a time, writing nothing into the model. Raises an `ApplyError` for a loader
    path the audit cannot follow (a non-copy write, a mismatched report), like apply."""
    report = AuditReport()
    for name, tensor in tensors:
        meta = ctx.known(TensorMeta(name, tuple(tensor.shape), tensor.dtype))
        if name in ctx.skip_names:
            report.skipped.append(name)
            continue
        view = ctx.scratch_view(meta)
        int_view(view).reshape(-1).copy_(int_view(tensor.contiguous()).reshape(-1))
        ctx.hook.begin_item(name, Mode.COMPARE)
        try:
            with ctx.hook:
                loaded = ctx.model.load_weights([(name, view)])
        finally:
            trace = ctx.hook.end_item()
            view.zero_()  # scratch is all-zero between items (what XOR expects)
        ctx.match_loaded(name, set(loaded or ()), trace)
        if not loaded and not trace.copies:
            report.skipped.append(name)
            continue
        report.tensors += 1
        report.copies += len(trace.copies)
        report.elements += trace.compared
        report.mismatches += [
            TensorMismatch(name, m.storages, m.count, m.positions, m.held_bits, m.expected_bits)
            for m in trace.mismatches
        ]
    return report
