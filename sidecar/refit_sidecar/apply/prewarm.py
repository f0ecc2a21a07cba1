"""Prewarm: learn, per rank and without writing any weight, how the native loader treats each
canonical tensor — skipped here, XOR-compatible, or overwrite-only (paper A.2 "Native skips").

The loader is run once per canonical name on a scratch view under the hook in DISCOVER mode:
copies into model storage are recorded and classified but not performed. The union of
XOR-incompatible names across ranks goes back to the producers, which then encode those names
as overwrites. The result holds names only: no offsets, routes or layout rules.

Scratch is sized from the tensors the loader actually takes, never from the largest tensor
declared. Which canonical names a model has is only learned by running its loader (runtime
names differ), so a declared tensor larger than the model's largest storage is first probed
with a zero-stride view of the right shape that costs no memory: when the loader does not know
the name (KeyError, AttributeError) or skips it, it is classified from the probe and no scratch
is reserved for it. Any other probe outcome is inconclusive and the name is discovered on real
scratch. After discovery, scratch is cut to the largest tensor the loader took. Declared sizes
are bounded by `refit_protocol.limits` beforehand; scratch that still cannot be allocated
raises `ScratchAllocationError` (the receiver answers 400 and keeps its state).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from refit_sidecar.apply.context import ApplyContext
from refit_sidecar.apply.errors import ApplyError
from refit_sidecar.apply.hook import Mode
from refit_sidecar.codec.records import TensorMeta

#: What a loader raises for a tensor it cannot take: recorded as unsupported (fail closed).
_LOADER_ERRORS = (
    ApplyError,
    LookupError,
    AttributeError,
    TypeError,
    ValueError,
    RuntimeError,
    AssertionError,
)
#: What a loader raises for a name it does not know (a dict or attribute lookup).
_UNKNOWN_NAME = (KeyError, AttributeError)


@dataclass
class PrewarmReport:
    skipped: set[str] = field(default_factory=set)
    xor_incompatible: dict[str, str] = field(default_factory=dict)  # name -> reason
    unsupported: dict[str, str] = field(default_factory=dict)  # name -> error (fail closed)
    scratch_bytes: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "skipped": sorted(self.skipped),
            "xor_incompatible": dict(sorted(self.xor_incompatible.items())),
            "unsupported": dict(sorted(self.unsupported.items())),
            "scratch_bytes": self.scratch_bytes,
        }


def prewarm(ctx: ApplyContext, names: Iterable[str] | None = None) -> PrewarmReport:
    """Classify every canonical tensor for this rank; updates `ctx.skip_names` and sizes
    `ctx.scratch` to the largest tensor the loader takes."""
    report = PrewarmReport()
    bound = ctx.largest_storage_bytes()
    todo = [
        name
        for name in sorted(names if names is not None else ctx.metas)
        if ctx.metas[name].nbytes <= bound or not _settled_by_probe(ctx, name, report)
    ]
    ctx.reserve(max((ctx.metas[n].nbytes for n in todo), default=0), name=_largest(ctx, todo))
    for name in todo:
        meta = ctx.metas[name]
        view = ctx.scratch_view(meta)
        view.zero_()  # values are irrelevant: DISCOVER mode performs no model write
        ctx.hook.begin_item(name, Mode.DISCOVER)
        try:
            with ctx.hook:
                loaded = ctx.model.load_weights([(name, view)])
            trace = ctx.hook.end_item()
            ctx.match_loaded(name, set(loaded or ()), trace)
        except _LOADER_ERRORS as exc:
            ctx.hook.end_item()
            report.unsupported[name] = f"{type(exc).__name__}: {exc}"
            continue
        if not loaded and not trace.copies:
            report.skipped.add(name)
            continue
        blockers = [c.reason for c in trace.copies if not c.xor_compatible]
        if blockers:
            report.xor_incompatible[name] = blockers[0]
    taken = [n for n in todo if n not in report.skipped and n not in report.unsupported]
    ctx.reserve(max((ctx.metas[n].nbytes for n in taken), default=0), shrink=True)
    report.scratch_bytes = ctx.scratch.numel()
    ctx.skip_names = frozenset(report.skipped)
    return report


def _largest(ctx: ApplyContext, names: list[str]) -> str:
    return max(names, key=lambda n: ctx.metas[n].nbytes, default="scratch")


def _probe_view(ctx: ApplyContext, meta: TensorMeta) -> torch.Tensor:
    """A view of `meta`'s shape and dtype over one scratch element (stride 0): no memory."""
    ctx.reserve(8)
    one = ctx.scratch[: torch.empty((), dtype=meta.dtype).element_size()].view(meta.dtype)
    one.zero_()
    return one.reshape((1,) * len(meta.shape)).expand(meta.shape)


def _settled_by_probe(ctx: ApplyContext, name: str, report: PrewarmReport) -> bool:
    """Probe a name larger than any model storage: True when the loader does not know it
    (KeyError, AttributeError) or skipped it, which is recorded in `report`; False when it
    must be discovered on real scratch."""
    probe = _probe_view(ctx, ctx.metas[name])
    ctx.hook.begin_item(name, Mode.DISCOVER)
    try:
        with ctx.hook:
            loaded = ctx.model.load_weights([(name, probe)])
    except _UNKNOWN_NAME as exc:
        report.unsupported[name] = f"{type(exc).__name__}: {exc}"
        return True
    except _LOADER_ERRORS:
        return False  # e.g. the loader needs a contiguous tensor: no conclusion
    finally:
        trace = ctx.hook.end_item()
    if not loaded and not trace.copies:
        report.skipped.add(name)
        return True
    return False
