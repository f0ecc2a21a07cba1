"""The fit: every constant of the plan's model from this repository's bench results, each
stage of a refit's window fitted by its own function so that each reads as the formula it fits.

`fit(results_dir)` reads the result files the benches write (`bench/results/`):

- `refit-<UTC>.json` (`kuberefit bench refit`). Byte counts come from every run: V_payload / H
  at each change rate (a power law in the rate) and the link overhead (bytes through the qdisc /
  payload bytes of the full-checkpoint reference). Times come only from runs on a quiet machine
  (1-minute load average before the run at most `QUIET_LOAD_PER_CPU` x the CPU count), since a
  busy neighbour on the bench's shared cores measures the neighbour. Each quiet run splits every
  rate's window into start-up, transport span, drain and finalization; with the run's own
  settings (H, nodes, link, the payload regions its tensor layout and chunk / bucket sizes give,
  the machine's CPUs) these are fitted by non-negative least squares of relative errors, each
  CPU cost as (fixed + per byte of H + per changed element [+ per payload]):

  * start-up = fixed + the first payload's region at the producer's construction cost (the
    producer alone: the receivers are idle until the first send) -> construction, fixed start-up;
  * link-bound rates (link time of V_payload >= `LINK_BOUND_SHARE` of the span): span - link
    time = fixed + payloads x per-payload cost -> the cross-cluster stream's overheads; drain =
    fixed + the last payload's region x max(1, nodes / CPUs) at the drain's cost, after its
    relay hops -> the drain;
  * CPU-bound rates (link time <= `CPU_BOUND_SHARE` of the span, or no shaped link): span +
    drain = the producer's remaining construction + every node's receive at the relay hop's pace
    + nodes / CPUs x every node's apply of all but the last payload (one core each) + the drain
    -> apply per byte, per changed element and per payload;
  * finalization = fixed + per byte of H.
- `codec-<UTC>.json` and `transport-<UTC>.json`: see `codec_transport`.

Each figure keeps its sources. A result file that cannot be read, or lacks a field the fit reads
(or holds something other than a usable number there), is skipped: its `Source` is not used and
says which field.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from refit_tools.plan.calibration.codec_transport import codec_construction, transport_figures
from refit_tools.plan.calibration.models import (
    Calibration,
    CalibrationError,
    Costs,
    PowerLaw,
    Scalar,
    Source,
)
from refit_tools.plan.calibration.numerics import nnls, power_law, rms
from refit_tools.plan.calibration.refit_runs import Point, RefitRun, read_refit
from refit_tools.plan.calibration.results import stamped
from refit_tools.plan.model import tree_depth

#: A rate is link-bound when the link time of its V_payload fills at least this share of its
#: transport span, and CPU-bound when at most this other share (or the link is unshaped).
LINK_BOUND_SHARE = 0.75
CPU_BOUND_SHARE = 0.5


def fit(results_dir: Path, *, exclude: Iterable[str] = ()) -> Calibration:
    """Fit every constant from the result files in `results_dir` (file names in `exclude` are
    left out: the leave-one-out validation uses it)."""
    skip = set(exclude)
    sources, refits = _read_refits(results_dir, skip)
    quiet = [r for r in refits if r.quiet]
    if not quiet:
        raise CalibrationError(f"{results_dir}: no refit result measured on a quiet machine")

    # Byte counts: every run.
    v_over_h, link_overhead = _byte_counts(refits)
    overhead = link_overhead.value

    transport = transport_figures(results_dir, skip, sources)
    relay = _Relay.of(transport)

    # Timings: every rate of the quiet runs that splits its window.
    points = [p for r in quiet for p in r.points]
    if not points:
        raise CalibrationError("no quiet refit result splits its window (startup_s, drain_s)")
    rates = (min(p.rate for p in points), max(p.rate for p in points))

    construction, startup_fixed = _startup(points)
    link_bound = [p for p in points if p.link and p.link_s(overhead) >= LINK_BOUND_SHARE * p.span]
    cpu_bound = [p for p in points if p.link_s(overhead) <= CPU_BOUND_SHARE * p.span]
    payload_overhead, stream_fixed = _stream(link_bound, overhead)
    drain = _drain(link_bound or points, relay, link_bound=bool(link_bound))
    apply = _apply(cpu_bound, construction, drain, relay, rates)
    finalization = _finalization(points)

    isolated = codec_construction(results_dir, skip, sources)
    return Calibration(
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        results_dir=str(results_dir),
        sources=sources,
        v_over_h=v_over_h,
        link_overhead=link_overhead,
        payload_overhead_s=payload_overhead,
        stream_fixed_s=stream_fixed,
        construction=construction,
        construction_isolated=isolated,
        startup_fixed_s=startup_fixed,
        apply=apply,
        drain=drain,
        finalization=finalization,
        relay_hop=transport.get("hop"),
        relay_hop_payload_s=transport.get("hop_payload"),
        relay_hop_mac=transport.get("hop_mac"),
        s3_upload=transport.get("s3_upload"),
        s3_download=transport.get("s3_download"),
    )


def _read_refits(results_dir: Path, skip: set[str]) -> tuple[list[Source], list[RefitRun]]:
    """(a `Source` for every refit result file, the runs it can use); `CalibrationError` when
    none."""
    sources: list[Source] = []
    refits: list[RefitRun] = []
    for path in stamped(results_dir, "refit"):
        if path.name in skip:
            continue
        run, why = read_refit(path)
        sources.append(
            Source(
                file=path.name,
                benchmark="refit",
                started=run.data.get("started") if run else None,
                machine=run.data.get("machine") or {} if run else {},
                used=run is not None,
                why=why,
            )
        )
        if run is not None:
            refits.append(run)
    if not refits:
        raise CalibrationError(
            f"{results_dir}: no refit-<UTC>.json results it can use (kuberefit bench refit)"
        )
    return sources, refits


def _names(pts: Iterable[Point]) -> list[str]:
    return sorted({p.file for p in pts})


@dataclass(frozen=True)
class _Relay:
    """The transport bench's relay hops: the encrypted one's throughput (None when not
    measured), the MAC-only one's (None: not measured, the encrypted one stands in), and the
    time per payload (0 when not measured)."""

    bytes_s: float | None
    payload_s: float
    mac_bytes_s: float | None = None

    @classmethod
    def of(cls, transport: Mapping[str, Any]) -> _Relay:
        hop: Scalar | None = transport.get("hop")
        hop_payload: Scalar | None = transport.get("hop_payload")
        hop_mac: Scalar | None = transport.get("hop_mac")
        return cls(
            hop.value if hop is not None else None,
            hop_payload.value if hop_payload is not None else 0.0,
            hop_mac.value if hop_mac is not None else None,
        )

    def intra(self, p: Point) -> float | None:
        """A relay-to-relay hop of `p`'s run: MAC-only where its links were (`--links mac`)."""
        return self.mac_bytes_s if p.mac and self.mac_bytes_s else self.bytes_s

    def hops_s(self, p: Point) -> float:
        """The last payload's relay hops below the root (before the drain's apply)."""
        last_wire = p.v * p.last / p.h
        depth = tree_depth(p.nodes)
        hop = self.intra(p)
        return (depth - 1) * ((last_wire / hop if hop else 0.0) + self.payload_s)

    def receive_s(self, p: Point) -> float:
        """Every node's receive of V_payload at its relay hop's pace: the root's from the
        producer over CurveZMQ, the other nodes' over the run's intra-cluster links (as
        `model.project` charges them)."""
        root, intra = self.bytes_s, self.intra(p)
        return (
            (p.v / root if root else 0.0)
            + (p.nodes - 1) * (p.v / intra if intra else 0.0)
            + p.nodes * p.payloads * self.payload_s
        )


def _byte_counts(refits: list[RefitRun]) -> tuple[PowerLaw, Scalar]:
    """V_payload / H as a power law in the change rate, and the link overhead, from every run."""
    names_all = [r.name for r in refits]
    v_points = [point for r in refits for point in r.v_points]
    coef, exponent = power_law(v_points)
    # Only shaped runs count link bytes (an unshaped run has no qdisc to count them).
    refs = [r.reference for r in refits if r.reference is not None]
    if not refs:
        raise CalibrationError("no shaped refit result counts the reference's link bytes")
    overhead = sum(link for link, _ in refs) / sum(wire for _, wire in refs)
    return (
        PowerLaw(
            coefficient=coef,
            exponent=exponent,
            points=sorted(v_points),
            sources=names_all,
            how="least squares of log(V_payload / H) on log(change rate) over every refit "
            "run's per-rate means (synthetic uniform changes of relative amplitude 1e-2)",
        ),
        Scalar(
            value=overhead,
            unit="link bytes / payload byte",
            sources=names_all,
            how="full-checkpoint reference: bytes through the tbf qdisc (TCP/IP and Ethernet "
            "headers) / payload bytes sent, summed over every refit run",
        ),
    )


def _costs(
    points: list[Point],
    rows: list[list[float]],
    ys: list[float],
    totals: list[float],
    unknowns: Sequence[str | None],
    how: str,
) -> tuple[list[float], Costs]:
    """Non-negative least squares of `ys` on `rows`, each residual relative to its point's
    measured total: the solution, and the `Costs` it gives (`unknowns` names each unknown's
    field; None: not one of them), fitted to `points`."""
    x = nnls(rows, ys, [1 / t for t in totals])
    fields = {name: value for name, value in zip(unknowns, x, strict=True) if name}
    costs = Costs.model_validate(
        {
            **fields,
            "rates": (min(p.rate for p in points), max(p.rate for p in points)),
            "points": len(points),
            "rms_error": rms(rows, ys, x, totals),
            "sources": _names(points),
            "how": how,
        }
    )
    return x, costs


def _startup(points: list[Point]) -> tuple[Costs, Scalar]:
    """Start-up: fixed + the first payload's region, the producer alone on the machine ->
    (the refit bench's construction cost, the fixed start-up)."""
    ys = [p.startup for p in points]
    (s0, *_), construction = _costs(
        points,
        [[1.0, p.first, p.changed(p.first)] for p in points],
        ys,
        ys,
        (None, "s_per_byte", "s_per_changed"),
        "start-up (t0 to the first send) = fixed + the first payload's region of H "
        "(from the run's tensor layout and sizes) x this, non-negative least squares of "
        "relative residuals over every quiet refit rate: the refit bench's producer with the "
        "machine to itself",
    )
    fixed = Scalar(
        value=s0,
        unit="s",
        sources=_names(points),
        how="the start-up fit's fixed part: the start call and the first seal",
    )
    return construction, fixed


def _stream(link_bound: list[Point], overhead: float) -> tuple[Scalar, Scalar]:
    """Cross-cluster stream beyond the link time: fixed + per payload (link-bound rates) ->
    (per payload, fixed); both 0 (assumed) without a link-bound rate."""
    if link_bound:
        rows = [[1.0, float(p.payloads)] for p in link_bound]
        ys = [p.span - p.link_s(overhead) for p in link_bound]
        stream_fixed, per_payload = nnls(rows, ys, [1 / p.span for p in link_bound])
    else:
        stream_fixed = per_payload = 0.0

    def figure(value: float, unit: str, how: str) -> Scalar:
        return Scalar(
            value=value,
            unit=unit,
            kind="measured" if link_bound else "assumed",
            sources=_names(link_bound),
            how=how if link_bound else "no quiet link-bound refit run: taken as 0",
        )

    return (
        figure(
            per_payload,
            "s per payload",
            "link-bound quiet refit rates: span - V_payload x link overhead / link rate = "
            "fixed + payloads x this (non-negative least squares): the send window's stalls",
        ),
        figure(
            stream_fixed,
            "s",
            "the same fit's fixed part: the cross-cluster stream's ramp and last ACK",
        ),
    )


def _drain(points: list[Point], relay: _Relay, *, link_bound: bool) -> Costs:
    """Drain after the last root ACK: its relay hops, then fixed + the last region on every
    node at once (`points`: the link-bound rates, nothing else is left to do then; else every
    quiet rate)."""
    where = (
        f"link-bound quiet refit rates (link time of V_payload >= {LINK_BOUND_SHARE:.0%} "
        "of the span)"
        if link_bound
        else "every quiet refit rate (none link-bound)"
    )
    _, drain = _costs(
        points,
        [[1.0, p.tail_share * p.last, p.tail_share * p.changed(p.last)] for p in points],
        [p.drain - relay.hops_s(p) for p in points],
        [p.drain for p in points],
        ("fixed_s", "s_per_byte", "s_per_changed"),
        where + ": drain (last root ACK to every completion ACK) less the last payload's relay "
        "hops = fixed (flush barriers) + max(1, nodes / CPUs) x the last payload's region "
        "x this (its apply on every node at once), non-negative least squares of relative "
        "residuals",
    )
    return drain


def _apply(
    cpu_bound: list[Point],
    construction: Costs,
    drain: Costs,
    relay: _Relay,
    rates: tuple[float, float],
) -> Costs:
    """Apply: what a CPU-bound rate's span + drain leaves after the producer's remaining
    construction, each node's receive and the drain, shared by the nodes on the CPUs; the
    drain's cost (assumed) without a CPU-bound rate."""
    if not cpu_bound:
        return Costs(
            kind="assumed",
            s_per_byte=drain.s_per_byte,
            s_per_changed=drain.s_per_changed,
            rates=rates,
            points=0,
            rms_error=0.0,
            sources=drain.sources,
            how="no CPU-bound quiet refit run (unshaped or fast link): taken as the drain's "
            "cost per byte of the last payload's region",
        )

    def construction_s(p: Point, nbytes: float) -> float:
        return construction.s_per_byte * nbytes + construction.s_per_changed * p.changed(nbytes)

    def drain_s(p: Point) -> float:
        return (
            drain.fixed_s
            + relay.hops_s(p)
            + p.tail_share * (drain.s_per_byte * p.last + drain.s_per_changed * p.changed(p.last))
        )

    _, apply = _costs(
        cpu_bound,
        [
            [
                p.nodes / p.cpus * (p.h - p.last),
                p.nodes / p.cpus * p.changed(p.h - p.last),
                p.nodes / p.cpus * (p.payloads - 1),
            ]
            for p in cpu_bound
        ],
        [
            p.span + p.drain - drain_s(p) - construction_s(p, p.h - p.first) - relay.receive_s(p)
            for p in cpu_bound
        ],
        [p.span + p.drain for p in cpu_bound],
        ("s_per_byte", "s_per_changed", "s_per_payload"),
        "CPU-bound quiet refit rates (link time of V_payload <= "
        f"{CPU_BOUND_SHARE:.0%} of the span): span + drain = the producer's remaining "
        "construction + each node's receive at its relay hop's pace (the root's CurveZMQ, "
        "the others' over the run's links) + nodes / CPUs x each "
        "node's apply of all but the last payload (one core each) + the fitted drain; "
        "non-negative least squares of relative residuals",
    )
    return apply


def _finalization(points: list[Point]) -> Costs:
    """Finalization: fixed + per byte of H (one producer), every quiet rate."""
    ys = [p.finalization for p in points]
    _, finalization = _costs(
        points,
        [[1.0, p.h] for p in points],
        ys,
        ys,
        ("fixed_s", "s_per_byte"),
        "finalization (every completion ACK to t1: the compare-and-set commit and the "
        "wait for the baseline writes still running) = fixed + H x this (one producer), "
        "non-negative least squares of relative residuals over every quiet refit rate",
    )
    return finalization
