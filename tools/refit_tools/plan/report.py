"""What `kuberefit plan` prints: a table, a JSON object and an SVG plot, every figure marked
with its kind: `input` (given), `measured` (from bench results, with its source), `assumed`
(not measured: the note says what was taken instead) or `projected` (computed by the model)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from refit_protocol.sizes import format_byte_size
from refit_tools.bench.plot import _rect, _text
from refit_tools.plan.calibration import Calibration, Costs, bench_machine
from refit_tools.plan.model import Breakdown
from refit_tools.plan.projection import Plan
from refit_tools.plan.units import format_bytes, format_rate, format_seconds

FigureKind = Literal["input", "measured", "assumed", "projected"]


@dataclass(frozen=True)
class Figure:
    """One row of the report; in the JSON, `value` is in `unit` (bit/s, B, B/s, s, x, %)."""

    section: str
    name: str
    value: float | str
    unit: str
    kind: FigureKind
    note: str = ""

    def shown(self) -> str:
        v = self.value
        if isinstance(v, str):
            return v
        if self.unit == "B":  # an input set in binary units (64MiB) is shown as it was set
            binary = self.kind == "input" and v > 0 and v % (1 << 20) == 0
            return format_byte_size(int(v)) if binary else format_bytes(v)
        if self.unit == "bit/s":
            return format_rate(v / 8)
        if self.unit == "B/s":
            return f"{v / 1e9:.3g} GB/s"
        if self.unit == "s":
            return format_seconds(v)
        if self.unit == "x":
            return f"{v:.3g}x" if v < 10 else f"{v:.1f}x"
        if self.unit == "%":
            return f"{v:.3g}%"
        return f"{v:.4g} {self.unit}".strip()


@dataclass(frozen=True)
class Context:
    """Where the inputs and the calibration came from."""

    calibration: Calibration
    calibration_path: str
    size_how: str
    size_exact: bool
    overridden: frozenset[str] = frozenset()
    sizes_how: str = ""
    #: Inputs the user did not give (their defaults are assumptions, and said so).
    defaulted: frozenset[str] = frozenset()
    #: Where the bytes per element come from (--dtype-bytes, the config's dtype, the default).
    element_how: str = ""


def machine(cal: Calibration) -> str:
    """The bench machine the calibration's timings came from, in words."""
    return bench_machine(cal)


def figures(p: Plan, ctx: Context) -> list[Figure]:
    d, k, b, cal = p.deployment, p.constants, p.breakdown, ctx.calibration
    out = [
        Figure("inputs", "model size H", d.model_bytes, "B", "input", ctx.size_how),
        Figure("inputs", "change rate", 100 * d.change_rate, "%", "input"),
        Figure("inputs", "producers", d.producers, "", "input", "split H (chunk ownership)"),
        Figure("inputs", "rollout nodes", d.nodes, "", "input"),
        Figure("inputs", "transport", d.transport, "", "input"),
        *(
            [
                Figure(
                    "inputs",
                    "links inside the rollout cluster",
                    d.intra_cluster,
                    "",
                    "input",
                    "--intra-cluster; from the trainers: encrypted",
                )
            ]
            if d.transport == "zmq"
            else []
        ),
        Figure(
            "inputs",
            "cross-cluster link",
            8 * d.cross_bytes_s if d.cross_bytes_s else "unlimited",
            "bit/s",
            "input",
            "shared by all producers' flows",
        ),
        Figure(
            "inputs",
            "intra-cluster link",
            8 * d.intra_bytes_s if d.intra_bytes_s else "unlimited",
            "bit/s",
            "assumed" if "intra_link" in ctx.defaulted else "input",
            "each rollout node's link"
            + (" (the default: give --intra-link)" if "intra_link" in ctx.defaulted else ""),
        ),
        Figure(
            "inputs",
            "element width",
            d.element_bytes,
            "B",
            "assumed" if "dtype_bytes" in ctx.defaulted else "input",
            ctx.element_how,
        ),
        Figure("inputs", "export chunk", d.chunk_bytes, "B", "input", ctx.sizes_how),
        Figure("inputs", "bucket", d.bucket_bytes, "B", "input", "bytes of H per payload"),
        *(
            [
                Figure(
                    "inputs",
                    "split",
                    d.split_bytes,
                    "B",
                    "input",
                    "a larger tensor travels in parts of about this size (the producer's auto)",
                )
            ]
            if d.split_bytes is not None
            else []
        ),
    ]
    rate = d.change_rate

    def fitted(runs: int, costs: Costs | None = None) -> str:
        """How a least-squares figure was found, with its fit's residual when recorded."""
        rms = f", rms {costs.rms_error:.0%}" if costs is not None else ""
        return f"fitted (least squares over {runs} quiet run{'s' if runs != 1 else ''}{rms})"

    def fit_of(costs: Costs) -> str:
        return fitted(len(costs.sources), costs)

    def measured(
        name: str,
        value: float | str,
        unit: str,
        how: str,
        extrapolated: bool = False,
        kind: FigureKind = "measured",
    ) -> None:
        """A calibrated figure: measured (or assumed, when the calibration says so), projected
        when it is carried beyond the measured change rates."""
        shown: FigureKind = "projected" if extrapolated and kind == "measured" else kind
        out.append(Figure("calibration", name, value, unit, shown, how))

    v_out = cal.v_over_h.at(rate)[1]
    measured(
        "V_payload / H",
        100 * k.v_over_h,
        "%",
        f"{cal.v_over_h.coefficient:.3g} x rate^{cal.v_over_h.exponent:.3f}, fitted to "
        f"{len(cal.v_over_h.points)} bench refit points"
        + (" (extrapolated beyond the measured rates)" if v_out else "")
        + "; from the bench's synthetic uniform changes (relative amplitude 1e-2): real models' "
        "changes may compress differently",
        v_out,
    )
    measured("link overhead", k.link_overhead, "x", "TCP/IP + Ethernet bytes per payload byte")
    for name, value, scalar in (
        ("per-payload send cost", k.payload_overhead_s, cal.payload_overhead_s),
        ("cross-cluster stream, fixed", k.stream_fixed_s, cal.stream_fixed_s),
    ):
        how = scalar.how
        if scalar.kind == "measured":
            how = f"{fitted(len(scalar.sources))}: {how}"
        measured(name, value, "s", how, kind=scalar.kind)
    if "construction" in ctx.overridden:
        out.append(
            Figure(
                "calibration",
                "construction / producer",
                k.construction_bytes_s,
                "B/s",
                "input",
                "--construction-rate",
            )
        )
    elif cal.construction_isolated is not None:
        measured(
            "construction / producer",
            k.construction_bytes_s,
            "B/s",
            "codec bench, one producer alone",
            cal.construction_isolated.at(rate)[1],
        )
    else:
        measured(
            "construction / producer",
            k.construction_bytes_s,
            "B/s",
            f"{fit_of(cal.construction)}: bench refit producer alone before its first send "
            "(start-up), per byte of H and per changed element",
            cal.construction.extrapolated(rate),
        )
    one_core = f"one core of the {machine(cal)} per node"
    if "apply" in ctx.overridden:
        out.append(
            Figure("calibration", "apply / node", k.apply_bytes_s, "B/s", "input", "--apply-rate")
        )
    else:
        measured(
            "apply / node",
            k.apply_bytes_s,
            "B/s",
            (
                f"{fit_of(cal.apply)}: the CPU-bound bench refit rates' span + drain less the "
                f"other stages, per byte of H and per changed element: CPU apply, {one_core}"
                if cal.apply.kind == "measured"
                else "assumed: " + cal.apply.how
            ),
            cal.apply.extrapolated(rate),
            cal.apply.kind,
        )
    measured(
        "apply / payload",
        k.apply_payload_s,
        "s",
        f"{fit_of(cal.apply)}: per payload each node applies (the apply fit)"
        if cal.apply.kind == "measured"
        else "assumed: no CPU-bound bench refit run",
        kind=cal.apply.kind,
    )
    if d.transport == "zmq":
        if "relay_hop" in ctx.overridden:
            assert k.hop_bytes_s is not None
            out.append(
                Figure(
                    "calibration", "relay hop", k.hop_bytes_s, "B/s", "input", "--relay-hop-rate"
                )
            )
        elif cal.relay_hop is not None:
            measured(
                "relay hop",
                cal.relay_hop.value,
                "B/s",
                f"{cal.relay_hop.how}, on the {machine(cal)}: give --relay-hop-rate for yours",
            )
            if d.intra_cluster == "mac" and cal.relay_hop_mac is not None:
                measured(
                    "relay hop, MAC-only",
                    cal.relay_hop_mac.value,
                    "B/s",
                    f"{cal.relay_hop_mac.how}: the relay-to-relay links (--intra-cluster mac)",
                )
        else:
            measured(
                "relay hop", "unlimited", "", "assumed: no transport bench result", kind="assumed"
            )
        if cal.relay_hop_payload_s is not None:
            measured("relay hop / payload", cal.relay_hop_payload_s.value, "s", "transport bench")
        else:
            measured(
                "relay hop / payload",
                0.0,
                "s",
                "assumed: no transport bench result",
                kind="assumed",
            )
    else:
        for name, fig in (("S3 upload", cal.s3_upload), ("S3 download", cal.s3_download)):
            if fig is not None:
                measured(name, fig.value, "B/s", fig.how)
    measured(
        "fixed start-up",
        k.startup_fixed_s,
        "s",
        f"{fit_of(cal.construction)}: the intercept of bench refit start-up = fixed + the "
        "first payload's construction",
    )
    if "apply" in ctx.overridden:
        out.append(
            Figure(
                "calibration",
                "drain / node",
                k.drain_bytes_s or k.apply_bytes_s,
                "B/s",
                "input",
                "--apply-rate (the last payload's apply)",
            )
        )
    else:
        measured(
            "drain / node",
            k.drain_bytes_s or k.apply_bytes_s,
            "B/s",
            f"{fit_of(cal.drain)}: bench refit drains after the last send, the last payload's "
            f"region at this rate (its apply and flush, {one_core})",
            cal.drain.extrapolated(rate),
            cal.drain.kind,
        )
    measured(
        "drain, fixed",
        k.drain_fixed_s,
        "s",
        f"{fit_of(cal.drain)}: the drain fit's intercept, flush barriers (bench refit drains)",
    )
    measured(
        "finalization, fixed",
        k.finalization_fixed_s,
        "s",
        f"{fit_of(cal.finalization)}: the finalization fit's intercept, commit (bench refit)",
    )
    measured(
        "finalization per GB of H",
        k.finalization_s_per_byte * 1e9,
        "s",
        f"{fit_of(cal.finalization)}: commit + the rest of the baseline update per GB of a "
        "producer's share (bench refit)",
    )

    def projected(name: str, value: float | str, unit: str, note: str = "") -> None:
        out.append(Figure("projection", name, value, unit, "projected", note))

    projected("V_payload (wire bytes)", b.v_payload_bytes, "B", "unique payloads, preambles in")
    projected("bytes crossing the link", b.cross_bytes, "B", "V_cross with link overhead")
    projected("payloads", b.payloads, "", f"relay tree depth {b.tree_depth}")
    for stage, secs in b.stages.items():
        projected(f"stage: {stage}", secs, "s", "bounds the stream" if stage == b.bound else "")
    projected("start-up", b.startup_s, "s", "fixed + first payload's construction")
    projected("stream", b.stream_s, "s", f"bounded by {b.bound}")
    projected("drain", b.drain_s, "s", "flush barriers + the last payload's relay hops and apply")
    projected("finalization", b.finalization_s, "s", "commit + waiting for baseline writes")
    projected("refit latency", b.latency_s, "s", "start-up + stream + drain + finalization")
    projected(
        "full-checkpoint transfer",
        b.reference_s,
        "s",
        f"transport-only: {format_bytes(b.reference_cross_bytes)} over the same links",
    )
    projected("speedup", b.speedup, "x", "full-checkpoint transfer / refit latency")
    projected("link limit H / V_payload", b.link_limit, "x", "speedup if both were link-bound")
    return out


def as_json(p: Plan, ctx: Context) -> dict[str, Any]:
    b, cal = p.breakdown, ctx.calibration
    return {
        "kind": "projected",
        "latency_s": b.latency_s,
        "bound": b.bound,
        "breakdown": {
            "construction_s": b.stages["construction"],
            "cross_cluster_s": b.stages["cross-cluster"],
            "fan_out_s": b.stages["fan-out"],
            "apply_s": b.stages["apply"],
            **({"shared_cpu_s": b.stages["shared CPU"]} if "shared CPU" in b.stages else {}),
            **({"upload_s": b.stages["upload"]} if "upload" in b.stages else {}),
            "startup_s": b.startup_s,
            "stream_s": b.stream_s,
            "drain_s": b.drain_s,
            "finalization_s": b.finalization_s,
        },
        "v_payload_bytes": b.v_payload_bytes,
        "cross_bytes": b.cross_bytes,
        "payloads": b.payloads,
        "tree_depth": b.tree_depth,
        "full_reference_s": b.reference_s,
        "full_reference_bytes": b.reference_cross_bytes,
        "speedup": b.speedup,
        "link_limit": b.link_limit,
        "figures": [asdict(f) for f in figures(p, ctx)],
        "notes": p.notes,
        "calibration": {
            "file": ctx.calibration_path,
            "created": cal.created,
            "sources": [s.model_dump() for s in cal.sources if s.used],
        },
    }


def table(p: Plan, ctx: Context) -> str:
    cal = ctx.calibration
    used = [s for s in cal.sources if s.used]
    lines = [
        f"kuberefit plan ({ctx.calibration_path}, fitted {cal.created} from {len(used)} bench "
        f"results; measured figures are the {machine(cal)}'s)",
        "",
    ]
    rows = figures(p, ctx)
    width = max(len(f.name) for f in rows)
    vwidth = max(len(f.shown()) for f in rows)
    section = ""
    for f in rows:
        if f.section != section:
            section = f.section
            lines.append(f"{section}:")
        lines.append(f"  {f.name:<{width}}  {f.shown():>{vwidth}}  {f.kind:<9}  {f.note}".rstrip())
    b = p.breakdown
    lines += [
        "",
        f"Projected: {format_seconds(b.latency_s)} per refit, "
        + (
            f"{b.speedup:.1f}x faster than moving the full checkpoint"
            if b.speedup >= 1
            else f"slower than moving the full checkpoint (speedup {b.speedup:.2f}x)"
        )
        + f" ({format_seconds(b.reference_s)}); the {b.bound} stage bounds it.",
    ]
    lines += [f"note: {n}" for n in p.notes]
    if b.bound in ("apply", "construction") and b.bound not in ctx.overridden:
        lines.append(
            f"note: the {b.bound} throughput is the {machine(cal)}'s (CPU"
            + (", one core per node" if b.bound == "apply" else "")
            + f"); for other hardware give --{b.bound}-rate"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------- plot
def _log_x(value: float, lo: float, hi: float, x0: float, width: float) -> float:
    return x0 + width * (math.log10(value) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))


def plot_rates(cross_bytes_s: float, points: int = 25) -> list[float]:
    """Cross-cluster rates from 1/100 to 100x the given one (at least 1 Mbit/s), log-spaced."""
    lo = max(cross_bytes_s / 100, 1e6 / 8)
    hi = max(cross_bytes_s * 100, lo * 10)
    step = (math.log10(hi) - math.log10(lo)) / (points - 1)
    return [10 ** (math.log10(lo) + i * step) for i in range(points)]


def svg(p: Plan, rates: list[float], sweep: list[Breakdown]) -> str:
    """Latency and speedup vs the cross-cluster link rate, all projected, the given rate marked."""
    w, h, x0, pw, top, ph = 860, 600, 80, 700, 60, 190
    d = p.deployment
    lo, hi = rates[0], rates[-1]
    lat = [b.latency_s for b in sweep]
    ref = [b.reference_s for b in sweep]
    spd = [b.speedup for b in sweep]
    lim = sweep[0].link_limit
    ymin = max(min(lat) / 2, 1e-3)
    ymax = max(ref) * 2
    smax = max(*spd, lim) * 1.15

    def ly(v: float) -> float:
        span = math.log10(ymax) - math.log10(ymin)
        return top + ph * (1 - (math.log10(v) - math.log10(ymin)) / span)

    def sy(v: float) -> float:
        return top + ph + 70 + ph * (1 - v / smax)

    def xs(v: float) -> float:
        return _log_x(v, lo, hi, x0, pw)

    def line(vals: list[float], y: Any, color: str, dash: str = "") -> str:
        pts = " ".join(f"{xs(r):.1f},{y(v):.1f}" for r, v in zip(rates, vals, strict=True))
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        return f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"{extra}/>'

    title = (
        f"kuberefit plan (projected): H = {format_bytes(d.model_bytes)}, change rate "
        f"{d.change_rate:.3g}, {d.producers} producers, {d.nodes} nodes, {d.transport}"
    )
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        'font-family="sans-serif">',
        _rect(0, 0, w, h, "white"),
        _text(10, 22, title, 13, font_weight="bold"),
        _text(x0, top - 8, "refit latency and full-checkpoint transfer, s (log)", 12),
        _text(x0, top + ph + 62, "speedup over the full-checkpoint transfer", 12),
    ]
    for y0 in (top, top + ph + 70):
        out.append(
            f'<rect x="{x0}" y="{y0}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>'
        )
    decade = math.floor(math.log10(ymin))
    while 10**decade <= ymax:
        if 10**decade >= ymin:
            y = ly(10**decade)
            out += [
                f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + pw}" y2="{y:.1f}" stroke="#eee"/>',
                _text(x0 - 6, y + 4, format_seconds(10**decade), 10, "end"),
            ]
        decade += 1
    for frac in (0.0, 0.5, 1.0):
        v = smax * frac
        out.append(_text(x0 - 6, sy(v) + 4, f"{v:.0f}x", 10, "end"))
    rate_decade = math.floor(math.log10(lo * 8))
    while 10**rate_decade <= hi * 8:
        r = 10**rate_decade / 8
        if r >= lo:
            x = xs(r)
            out += [
                f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + 2 * ph + 70}" '
                f'stroke="#eee"/>',
                _text(x, top + 2 * ph + 86, format_rate(r), 10, "middle"),
            ]
        rate_decade += 1
    out += [
        line(lat, ly, "#4878d0"),
        line(ref, ly, "#ee854a"),
        line(spd, sy, "#6acc64"),
        line([lim] * len(rates), sy, "#555", "4 3"),
    ]
    if d.cross_bytes_s:
        x = xs(d.cross_bytes_s)
        out += [
            f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + 2 * ph + 70}" stroke="#c00" '
            'stroke-dasharray="2 2"/>',
            _text(x + 4, top + 12, f"given: {format_rate(d.cross_bytes_s)}", 10, fill="#c00"),
        ]
    axis = top + 2 * ph + 104
    out.append(_text(x0 + pw / 2, axis, "cross-cluster link rate (log)", 12, "middle"))
    legend = (
        ("#4878d0", "refit latency"),
        ("#ee854a", "full-checkpoint transfer"),
        ("#6acc64", "speedup"),
        ("#555", "link limit H / V_payload"),
    )
    for j, (color, label) in enumerate(legend):
        lx = x0 + j * 175
        out += [_rect(lx, h - 24, 12, 12, color), _text(lx + 16, h - 14, label, 11)]
    out.append("</svg>")
    return "\n".join(out) + "\n"
