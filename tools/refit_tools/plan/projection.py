"""A deployment and a calibration in, a projection out (`plan`), and the same model applied to
a `bench refit` result's own settings (`project_for_bench`), which is how it is validated."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from refit_tools.plan.calibration import (
    Calibration,
    bench_deployment,
    bench_machine,
    rate_rows,
)
from refit_tools.plan.model import Breakdown, Constants, Deployment, project


def product_sizes(
    model_bytes: int, producers: int, chunk: int | str, bucket: int | str
) -> tuple[int, int, str, int]:
    """(chunk, bucket, how, split) as the producer resolves its settings, `auto` included
    (`refit_sidecar.baseline.sizing`; the split size is always the producer's auto)."""
    from refit_sidecar.baseline.sizing import resolve_sizes

    sizes = resolve_sizes(
        chunk if isinstance(chunk, int) else "auto",
        bucket if isinstance(bucket, int) else "auto",
        total_bytes=model_bytes,
        producers=producers,
    )
    assert sizes.split_bytes is not None  # resolved: only recorded sizes lack it
    return sizes.chunk_bytes, sizes.bucket_bytes, sizes.rule, sizes.split_bytes


@dataclass(frozen=True)
class Plan:
    deployment: Deployment
    constants: Constants
    breakdown: Breakdown
    notes: list[str]


def plan(
    d: Deployment,
    calibration: Calibration,
    *,
    colocated: bool = False,
    construction_bytes_s: float | None = None,
    apply_bytes_s: float | None = None,
    relay_hop_bytes_s: float | None = None,
) -> Plan:
    """Project `d` with the calibration's constants at its change rate; `construction_bytes_s`
    (per producer), `apply_bytes_s` (per node, the drain's last apply included) and
    `relay_hop_bytes_s` (one relay hop's receive, verify and forward) replace the calibrated
    throughputs when given (the plan then marks them as inputs)."""
    constants, notes = calibration.constants(
        d.change_rate, colocated=colocated, element_bytes=d.element_bytes
    )
    if construction_bytes_s is not None:
        constants = replace(constants, construction_bytes_s=construction_bytes_s)
    if apply_bytes_s is not None:
        # The drain's last apply runs at the given rate too.
        constants = replace(constants, apply_bytes_s=apply_bytes_s, drain_bytes_s=None)
    if relay_hop_bytes_s is not None:  # every hop, MAC-only and encrypted
        constants = replace(
            constants, hop_bytes_s=relay_hop_bytes_s, hop_mac_bytes_s=relay_hop_bytes_s
        )
    if d.transport == "s3" and (
        constants.s3_upload_bytes_s is None or constants.s3_download_bytes_s is None
    ):
        raise ValueError(
            "no S3 calibration: run `kuberefit bench transport --s3-endpoint-url URL "
            "--s3-bucket BUCKET` (its result in bench/results), then `kuberefit plan --calibrate`"
        )
    breakdown = project(d, constants)
    notes = notes + breakdown.notes
    if d.transport == "zmq" and constants.hop_bytes_s is None:
        notes.append(
            "fan-out: relay hop throughput and per-payload cost assumed unlimited (no transport "
            "bench result); only the intra-cluster link rate bounds it"
        )
    if d.transport == "zmq" and relay_hop_bytes_s is None and breakdown.hop_bound:
        notes.append(_hop_note(breakdown.hop_bound, calibration, _hops(d, constants)))
    if d.transport == "s3":
        notes.append("s3: start-up, drain and finalization come from relay-tree refit runs")
    return Plan(d, constants, breakdown, notes)


_HOP_PARTS = {
    "fan-out": "fan-out",
    "cross-cluster": "the cross-cluster stage (a relay root's receive)",
    "reference": "the full-checkpoint reference",
}
_LINK_OPTIONS = {"intra": "--intra-link", "cross": "--cross-link"}


def _hops(d: Deployment, k: Constants) -> dict[str, str]:
    """The hop figure behind each link a bound names ("intra": the relay-to-relay hop of the
    policy's mode; "cross": a root's receive, always encrypted)."""
    intra = k.hop_mac_bytes_s if d.intra_cluster == "mac" and k.hop_mac_bytes_s else None
    enc = f"{k.hop_bytes_s / 1e9:.3g} GB/s" if k.hop_bytes_s else ""
    return {"intra": f"{intra / 1e9:.3g} GB/s MAC-only" if intra else enc, "cross": enc}


def _hop_note(bound: Mapping[str, str], calibration: Calibration, hops: Mapping[str, str]) -> str:
    """Which figures the measured relay hop bounds rather than the links given."""
    parts = [_HOP_PARTS[k] for k in _HOP_PARTS if k in bound]
    links = [_LINK_OPTIONS[k] for k in _LINK_OPTIONS if k in bound.values()]
    listed = ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]
    shown = list(dict.fromkeys(hops[k] for k in _LINK_OPTIONS if k in bound.values() and hops[k]))
    rate = f" ({', '.join(shown)})" if shown else ""
    return (
        f"{listed} {'are' if len(parts) > 1 else 'is'} bounded by the relay hop measured on the "
        f"{bench_machine(calibration)}{rate}, not by {' or '.join(links)}; give "
        "--relay-hop-rate for your hosts"
    )


def sweep(base: Plan, rates: list[float]) -> list[Breakdown]:
    """The same deployment and constants at other cross-cluster rates (for the plot)."""
    return [project(replace(base.deployment, cross_bytes_s=r), base.constants) for r in rates]


def project_bench(result: Mapping[str, Any], calibration: Calibration) -> dict[str, Breakdown]:
    """Each rate of a `bench refit` result projected with its own settings (H, change rate,
    link, nodes, chunk and bucket sizes and the payload regions they give; producer, relays and
    receivers sharing the machine's CPUs)."""
    out = {}
    for key, rate, _ in rate_rows(result):
        out[key] = plan(bench_deployment(result, rate), calibration, colocated=True).breakdown
    return out


def project_for_bench(
    result: Mapping[str, Any], calibration: Calibration, rate: str | None = None
) -> float:
    """Projected latency (s) of one rate of a `bench refit` result (its key, e.g. "0.03"; may be
    omitted when the result has one rate). Compare with `result["rates"][rate]["latency_s"]`."""
    projected = project_bench(result, calibration)
    if rate is None:
        if len(projected) != 1:
            raise ValueError(f"the result has rates {sorted(projected)}: name one")
        rate = next(iter(projected))
    return projected[rate].latency_s
