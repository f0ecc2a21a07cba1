"""Prewarm: learn, per rank and without writing any weight, how the native loader treats each
canonical tensor — skipped here, XOR-compatible, or overwrite-only (paper A.2 "Native skips").

The loader is run once per canonical name on a scratch view under the hook in DISCOVER mode:
copies into model storage are recorded and classified but not performed. The union of
XOR-incompatible names across ranks goes back to the producers, which then encode those names
as overwrites. The result holds names only: no offsets, routes or layout rules.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from refit_sidecar.apply.context import ApplyContext
from refit_sidecar.apply.errors import ApplyError
from refit_sidecar.apply.hook import Mode


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
    """Classify every canonical tensor for this rank; updates `ctx.skip_names`."""
    report = PrewarmReport(scratch_bytes=ctx.scratch.numel())
    for name in sorted(names if names is not None else ctx.metas):
        meta = ctx.metas[name]
        view = ctx.scratch_view(meta)
        view.zero_()  # values are irrelevant: DISCOVER mode performs no model write
        ctx.hook.begin_item(name, Mode.DISCOVER)
        try:
            with ctx.hook:
                loaded = ctx.model.load_weights([(name, view)])
            trace = ctx.hook.end_item()
            ctx._match_loaded(name, set(loaded or ()), trace)
        except (ApplyError, KeyError, ValueError, RuntimeError, AssertionError) as exc:
            ctx.hook.end_item()
            report.unsupported[name] = f"{type(exc).__name__}: {exc}"
            continue
        if not loaded and not trace.copies:
            report.skipped.add(name)
            continue
        blockers = [c.reason for c in trace.copies if not c.xor_compatible]
        if blockers:
            report.xor_incompatible[name] = blockers[0]
    ctx.skip_names = frozenset(report.skipped)
    return report
