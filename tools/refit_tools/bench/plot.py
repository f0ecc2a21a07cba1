"""A small hand-written SVG of a `kuberefit bench refit` result (no plotting dependency).

Left: each rate's refit latency, split into the transport lower bound (union of transport
intervals) and the rest, with finalization marked at the end. Right: speedup over the
full-checkpoint reference, with the 20x target and 25x goal as dashed lines.
"""

from __future__ import annotations

from typing import Any
from xml.sax.saxutils import escape

MIB = 1 << 20
_W, _ROW, _TOP = 840, 34, 58
_LEFT = (70, 400)  # x of the latency panel's axis start and its width
_RIGHT = (570, 220)


def _text(x: float, y: float, s: str, size: int = 12, anchor: str = "start", **kw: str) -> str:
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in kw.items())
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"{extra}>'
        f"{escape(s)}</text>"
    )


def _rect(x: float, y: float, w: float, h: float, fill: str, title: str = "") -> str:
    tip = f"<title>{escape(title)}</title>" if title else ""
    return (
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.0):.1f}" height="{h:.1f}" '
        f'fill="{fill}">{tip}</rect>'
    )


def link_label(link_mbit: float, delay_ms: float = 0.0, loss: float = 0.0) -> str:
    """How a result names its link (rate 0 is the unshaped veth), with its emulated round
    trip and loss (`bench/wan.py`) where set."""
    label = "the unshaped veth" if link_mbit == 0 else f"{link_mbit:g} Mbit/s (tbf)"
    if delay_ms:
        label += f" + {delay_ms:g} ms RTT"
    if loss:
        label += f" + {loss:.2%} loss"
    return label


def link_of(result: dict[str, Any]) -> tuple[float, float, float]:
    """A refit result's link: rate, round trip, loss (results older than the WAN emulation
    have neither)."""
    return result["link_mbit"], result.get("delay_ms", 0.0), result.get("loss", 0.0)


def refit_svg(result: dict[str, Any]) -> str:
    rates = list(result["rates"].items())
    height = _TOP + _ROW * len(rates) + 70
    ref = result["full_reference"]
    max_latency = max(r["latency_s"] for _, r in rates) * 1.15
    max_speedup = max(30.0, *(r["speedup"] * 1.15 for _, r in rates))
    x0, width = _LEFT
    sx0, swidth = _RIGHT
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{height}" '
        f'font-family="sans-serif">',
        _rect(0, 0, _W, height, "white"),
        _text(
            10,
            20,
            f"kuberefit bench refit: H = {result['checkpoint_bytes'] / MIB:.1f} MiB, "
            f"{result['nodes']} nodes, link {link_label(*link_of(result))}; full-checkpoint "
            f"reference {ref['seconds']:.1f} s",
            13,
            font_weight="bold",
        ),
        _text(x0, 44, "refit latency (timed window), s", 12),
        _text(sx0, 44, "speedup vs full-checkpoint reference", 12),
    ]
    for i, (key, r) in enumerate(rates):
        y = _TOP + i * _ROW
        scale = width / max_latency
        transport = r["transport_union_s"] * scale
        total = r["latency_s"] * scale
        final = r["finalization_s"] * scale
        out += [
            _text(x0 - 8, y + 16, f"{float(key):.0%}", 12, "end"),
            _rect(x0, y, transport, 22, "#4878d0", f"transport {r['transport_union_s']:.2f} s"),
            _rect(x0 + transport, y, total - transport, 22, "#c8c8c8", "other work"),
            _rect(x0 + total - final, y, final, 22, "#ee854a", "finalization"),
            _text(
                x0 + total + 5,
                y + 16,
                f"{r['latency_s']:.2f} s ({r['transport_share']:.0%} transport)",
                11,
            ),
        ]
        sscale = swidth / max_speedup
        out += [
            _rect(sx0, y, r["speedup"] * sscale, 22, "#6acc64", f"speedup {r['speedup']:.1f}x"),
            _text(sx0 + r["speedup"] * sscale + 5, y + 16, f"{r['speedup']:.1f}x", 11),
        ]
    bottom = _TOP + _ROW * len(rates)
    for mark, label, label_y in ((20, "20x target", bottom + 14), (25, "25x goal", bottom + 26)):
        x = sx0 + mark * swidth / max_speedup
        out += [
            f'<line x1="{x:.1f}" y1="{_TOP - 6}" x2="{x:.1f}" y2="{bottom}" stroke="#555" '
            f'stroke-dasharray="4 3"/>',
            _text(x, label_y, label, 10, "middle"),
        ]
    legend_y = bottom + 50
    for j, (color, label) in enumerate(
        (
            ("#4878d0", "transport lower bound"),
            ("#c8c8c8", "rest of the window"),
            ("#ee854a", "finalization (commit + baseline update)"),
        )
    ):
        lx = x0 + j * 190
        out += [_rect(lx, legend_y - 10, 12, 12, color), _text(lx + 16, legend_y, label, 11)]
    out.append("</svg>")
    return "\n".join(out) + "\n"


_COLORS = ("#4878d0", "#ee854a", "#6acc64", "#d65f5f", "#956cb4")


def _panel(
    x0: float,
    top: float,
    size: tuple[float, float],
    title: str,
    series: dict[str, list[float]],
    labels: list[str],
    fmt: str,
) -> list[str]:
    """One line chart: x = the links in run order, one polyline per change rate."""
    width, height = size
    peak = max(v for values in series.values() for v in values) * 1.15 or 1.0
    step = width / max(len(labels) - 1, 1)
    out = [
        _text(x0, top - 10, title, 12),
        f'<line x1="{x0}" y1="{top + height}" x2="{x0 + width}" y2="{top + height}" '
        f'stroke="#555"/>',
        f'<line x1="{x0}" y1="{top}" x2="{x0}" y2="{top + height}" stroke="#555"/>',
    ]
    for i, label in enumerate(labels):
        out.append(_text(x0 + i * step, top + height + 16, label, 10, "middle"))
    for j, (name, values) in enumerate(series.items()):
        color = _COLORS[j % len(_COLORS)]
        points = [(x0 + i * step, top + height - v * height / peak) for i, v in enumerate(values)]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for (x, y), v in zip(points, values, strict=True):
            out += [
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>',
                _text(x + 5, y - 5, format(v, fmt), 10),
            ]
        out += [
            _rect(x0 + j * 70, top + height + 30, 12, 12, color),
            _text(x0 + j * 70 + 16, top + height + 40, name, 11),
        ]
    return out


def links_svg(results: list[dict[str, Any]]) -> str:
    """Latency and speedup against the link, one line per change rate (`bench refit` with
    several `--link-mbit` values)."""
    labels = [f"{r['link_mbit']:g} Mbit/s" if r["link_mbit"] else "unshaped" for r in results]
    keys = list(results[0]["rates"])
    latency = {f"{float(k):.0%}": [r["rates"][k]["latency_s"] for r in results] for k in keys}
    speedup = {f"{float(k):.0%}": [r["rates"][k]["speedup"] for r in results] for k in keys}
    first = results[0]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="330" '
        f'font-family="sans-serif">',
        _rect(0, 0, _W, 330, "white"),
        _text(
            10,
            20,
            f"kuberefit bench refit: H = {first['checkpoint_bytes'] / MIB:.1f} MiB, "
            f"{first['nodes']} nodes, by link between the clusters",
            13,
            font_weight="bold",
        ),
        *_panel(60, 60, (330, 190), "refit latency, s", latency, labels, ".2f"),
        *_panel(480, 60, (330, 190), "speedup vs full checkpoint", speedup, labels, ".1f"),
        "</svg>",
    ]
    return "\n".join(out) + "\n"
