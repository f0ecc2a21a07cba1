"""What a `bench refit` result says: its machine's load and CPUs (`is_quiet`), its link, the
deployment it measured with its payload regions rebuilt from its settings
(`bench_deployment`), its per-rate rows, and what the fit takes from one result file
(`read_refit`: byte counts of every run, the window split of each rate of a quiet one).
`projection` uses the same reading to project a bench run's own settings."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from refit_tools.plan.calibration.models import QUIET_LOAD_PER_CPU
from refit_tools.plan.calibration.results import (
    WINDOW,
    FieldError,
    check_refit,
    read_result_why,
)
from refit_tools.plan.files import quote
from refit_tools.plan.model import ELEMENT_BYTES, Deployment, first_region, last_region
from refit_tools.plan.payloads import payload_regions


def load_of(result: Mapping[str, Any]) -> tuple[float | None, int]:
    """(1-minute load average before the run, None when the file predates that field; CPUs).
    The load after a run is no substitute: the run itself raises it."""
    machine = result.get("machine") or {}
    cpus = int(machine.get("cpus") or 1)
    avg = machine.get("load_avg_before")
    return (float(avg[0]) if avg else None), cpus


def is_quiet(result: Mapping[str, Any], per_cpu: float = QUIET_LOAD_PER_CPU) -> bool:
    load, cpus = load_of(result)
    return load is not None and load <= per_cpu * cpus


def is_wan(result: Mapping[str, Any]) -> bool:
    """A run with an emulated round trip, loss or link cut (`bench refit --delay-ms --loss
    --cut-link-s`): its timings and link bytes are not the model's link."""
    settings = result.get("settings") or {}
    return any(settings.get(k) for k in ("delay_ms", "loss", "link_cut_s"))


def link_bytes_s(result: Mapping[str, Any]) -> float | None:
    """The shaped link's rate in bytes/s; None for an unshaped run (no `link_mbit`, or 0)."""
    mbit = result.get("link_mbit")
    return float(mbit) * 1e6 / 8 if mbit else None


def _bench_workload(result: Mapping[str, Any]) -> Any | None:
    """The bench's synthetic checkpoint rebuilt from the run's settings; None when that does
    not reproduce the run's H."""
    from refit_tools.bench.refit_workload import Workload

    settings = result.get("settings") or {}
    requested = settings.get("checkpoint_bytes")
    if not requested:
        return None
    work = Workload(checkpoint_bytes=int(requested), seed=int(settings.get("seed") or 0))
    return work if work.nbytes == int(result["checkpoint_bytes"]) else None


def bench_last_tensor_bytes(result: Mapping[str, Any]) -> int | None:
    """Bytes of the last tensor of the bench's synthetic checkpoint (its output head), rebuilt
    from the run's settings; None when that does not reproduce the run's H."""
    work = _bench_workload(result)
    return None if work is None else 2 * math.prod(work.layout()[-1][1])


def bench_regions(
    result: Mapping[str, Any], chunk_bytes: int, bucket_bytes: int, split_bytes: int | None = None
) -> tuple[int, ...] | None:
    """Bytes of H of each payload of the run, in send order: its synthetic checkpoint's tensors
    grouped into export chunks (`refit_sidecar.baseline.chunks.plan_chunks`), the larger ones cut
    into parts (`split_bytes`, None for a run from before the parts) and all of them into
    buckets as the producer's `Bucketer` closes them (every chunk carries changes at the
    bench's rates). None when the layout cannot be rebuilt."""
    work = _bench_workload(result)
    if work is None:
        return None
    sizes = [m.nbytes for m in work.metas()]
    return payload_regions(sizes, 1, chunk_bytes, bucket_bytes, split_bytes)


def bench_deployment(result: Mapping[str, Any], rate: float) -> Deployment:
    """The deployment a `bench refit` result measured: one producer, its nodes, its link, the
    rollout namespace's relay links unshaped, its payload regions, and every process sharing
    the machine's CPUs."""
    from refit_sidecar.baseline.sizing import Sizes, resolve_sizes

    settings = result.get("settings") or {}
    h = int(result["checkpoint_bytes"])
    chunk, bucket = (settings.get(k) for k in ("chunk_bytes", "bucket_bytes"))
    recorded = result.get("sizes")  # what the run used (results since the auto sizes)
    sizes = (
        Sizes(
            int(recorded["chunk_bytes"]),
            int(recorded["bucket_bytes"]),
            str(recorded["rule"]),
            # None: recorded before tensors were split (they travelled whole)
            None if recorded.get("split_bytes") is None else int(recorded["split_bytes"]),
        )
        if recorded
        else replace(  # older than the recorded sizes, so older than the parts too
            resolve_sizes(
                chunk if isinstance(chunk, int) else "auto",
                bucket if isinstance(bucket, int) else "auto",
                total_bytes=h,
                producers=1,
            ),
            split_bytes=None,
        )
    )
    _, cpus = load_of(result)
    return Deployment(
        model_bytes=h,
        change_rate=rate,
        producers=1,
        nodes=int(result["nodes"]),
        cross_bytes_s=link_bytes_s(result),
        intra_bytes_s=None,
        chunk_bytes=sizes.chunk_bytes,
        bucket_bytes=sizes.bucket_bytes,
        transport="zmq",
        split_bytes=sizes.split_bytes,
        last_tensor_bytes=bench_last_tensor_bytes(result),
        regions=bench_regions(result, sizes.chunk_bytes, sizes.bucket_bytes, sizes.split_bytes),
        shared_cpus=cpus,
        # Runs from before `--links` linked every relay over CurveZMQ.
        intra_cluster="mac" if settings.get("links") == "mac" else "encrypted",
    )


def rate_rows(result: Mapping[str, Any]) -> list[tuple[str, float, dict[str, Any]]]:
    """(key, measured change rate, per-rate summary) of a refit result."""
    rows = []
    for key, row in (result.get("rates") or {}).items():
        rate = float(row.get("changed_fraction") or key)
        rows.append((key, rate, row))
    return rows


def _runs(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list(row.get("runs") or [row])


@dataclass(frozen=True)
class Point:
    """One rate of a quiet refit run, with its settings and its measured window split."""

    file: str
    rate: float
    h: float
    nodes: int
    cpus: int
    link: float | None
    v: float
    payloads: int
    first: float
    last: float
    startup: float
    span: float
    drain: float
    finalization: float
    #: The run's relay-to-relay links were MAC-only (`bench refit --links mac`), not CurveZMQ.
    mac: bool = False

    def changed(self, nbytes: float) -> float:
        return self.rate * nbytes / ELEMENT_BYTES

    def link_s(self, overhead: float) -> float:
        """The link time of the run's V_payload (0 when unshaped)."""
        return 0.0 if self.link is None else self.v * overhead / self.link

    @property
    def tail_share(self) -> float:
        return max(1.0, self.nodes / self.cpus)


def _points(name: str, result: Mapping[str, Any]) -> list[Point]:
    out = []
    _, cpus = load_of(result)
    for _, rate, row in rate_rows(result):
        if not all(k in row for k in WINDOW):
            continue
        dep = bench_deployment(result, rate)
        payloads = max(int(r.get("payloads") or 0) for r in _runs(row)) or len(dep.regions or ())
        out.append(
            Point(
                file=name,
                rate=rate,
                h=float(result["checkpoint_bytes"]),
                nodes=int(result["nodes"]),
                cpus=cpus,
                link=link_bytes_s(result),
                v=float(row["v_payload_bytes"]),
                payloads=max(payloads, 1),
                first=first_region(dep),
                last=last_region(dep),
                startup=float(row["startup_s"]),
                span=float(row["transport_span_s"]),
                drain=float(row["drain_s"]),
                finalization=float(row["finalization_s"]),
                mac=dep.intra_cluster == "mac",
            )
        )
    return out


@dataclass(frozen=True)
class RefitRun:
    """What the fit takes from one refit result file."""

    name: str
    data: dict[str, Any]
    quiet: bool
    #: (change rate, V_payload / H) of each rate.
    v_points: list[tuple[float, float]]
    #: The full-checkpoint reference's (link bytes, payload bytes) on a shaped link.
    reference: tuple[float, float] | None
    #: Each rate's window split (quiet runs only).
    points: list[Point]


def read_refit(path: Path) -> tuple[RefitRun | None, str]:
    """(the run, why it is used) or (None, why it is skipped: the problem, named)."""
    data, why = read_result_why(path)
    if data is None:
        return None, why
    if data.get("benchmark") != "refit":
        return None, f"not a refit result (benchmark {quote(data.get('benchmark'))})"
    try:
        check_refit(data)
        wan = is_wan(data)
        # Real vLLM engines apply through another path than the fitted one (torch receivers).
        engines = data.get("engine", "torch") != "torch"
        quiet = is_quiet(data) and not wan and not engines
        h = float(data["checkpoint_bytes"])
        v_points = [(rate, float(row["v_payload_bytes"]) / h) for _, rate, row in rate_rows(data)]
        full = data.get("full_reference") or {}
        reference = (
            (float(full["link_bytes"]), float(full["wire_bytes"]))
            if link_bytes_s(data) and full.get("link_bytes") and not wan
            else None
        )
        points = _points(path.name, data) if quiet else []
    except FieldError as exc:
        return None, f"skipped: {exc}"
    except (ArithmeticError, LookupError, TypeError, ValueError) as exc:
        return None, f"skipped: cannot use it ({type(exc).__name__}: {exc})"
    load, cpus = load_of(data)
    why = (
        f"load {load:.1f} on {cpus} CPUs: "
        + ("quiet, timings used" if quiet else "busy, byte counts only")
        if load is not None
        else "no load average before the run: byte counts only"
    )
    if wan:  # the model has no round trip, loss or cut; retransmits inflate the link's bytes
        why = "a WAN-emulated run (round trip, loss or a link cut): V_payload / H only"
    elif engines:
        why = f"applied by {data['engine']} engines, not the fitted receivers: byte counts only"
    return RefitRun(path.name, data, quiet, v_points, reference, points), why
