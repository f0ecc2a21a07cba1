"""The plan's calibration: every constant of the model, fitted from this repository's bench
results, with the files it came from.

`fit(results_dir)` reads the result files the benches write (`bench/results/`):

- `refit-<UTC>.json` (`kuberefit bench refit`): the link overhead (bytes through the qdisc /
  payload bytes of the full-checkpoint reference), V_payload / H at each change rate (a power
  law in the rate), the per-payload cost of the send window (the transport span beyond the link
  time of V_payload, per payload), construction throughput (H / the producer's compare +
  compress busy time), the fixed part of start-up, apply throughput (the drain: the last
  payload's region applied after the last send) and finalization per byte of H. Byte counts come
  from every run; times only from runs on a quiet machine (1-minute load average before the run
  at most `QUIET_LOAD_PER_CPU` x the CPU count), since a busy neighbour on the bench's shared
  cores measures the neighbour.
- `codec-<UTC>.json` (`kuberefit bench codec`, full size): construction throughput of one
  producer alone on the machine (the plan's figure; the refit bench's producer shares its cores
  with every receiver, which is the bench's own figure).
- `transport-<UTC>.json` (`kuberefit bench transport`), when present: one relay hop's throughput
  and per-payload cost (the fan-out stage), and S3 upload/download throughput when measured.

Each figure keeps its sources, and the whole calibration is one JSON file: `write` / `load`.
The package ships one fitted from this checkout's results (`calibration.json`).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import statistics
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from refit_tools.plan.model import Constants, Deployment, first_region, last_region, tree_depth

#: A run is quiet when its 1-minute load average before it is at most this x the CPU count.
QUIET_LOAD_PER_CPU = 1.5
#: Codec results within this many seconds of the latest full one form its batch.
CODEC_BATCH_S = 3600
SHIPPED = Path(__file__).with_name("calibration.json")
_STAMP = re.compile(r"-(\d{8}T\d{6}Z)\.json$")

Kind = Literal["measured", "assumed"]


class CalibrationError(ValueError):
    """The results cannot calibrate the model (the message says what is missing)."""


class Source(BaseModel):
    """One result file read, and whether (and why) its timings were used."""

    model_config = ConfigDict(frozen=True)

    file: str
    benchmark: str
    started: str | None = None
    machine: dict[str, Any] = Field(default_factory=dict)
    used: bool
    why: str


class Scalar(BaseModel):
    """One figure with its provenance."""

    model_config = ConfigDict(frozen=True)

    value: float
    unit: str
    kind: Kind = "measured"
    sources: list[str] = Field(default_factory=list)
    how: str


class Curve(BaseModel):
    """A figure measured at several change rates, interpolated linearly between them."""

    model_config = ConfigDict(frozen=True)

    unit: str
    points: list[tuple[float, float]]
    kind: Kind = "measured"
    sources: list[str] = Field(default_factory=list)
    how: str

    def at(self, rate: float) -> tuple[float, bool]:
        """(value, extrapolated): outside the measured rates the nearest value is kept."""
        pts = sorted(self.points)
        if rate <= pts[0][0]:
            return pts[0][1], rate < pts[0][0] * 0.999
        if rate >= pts[-1][0]:
            return pts[-1][1], rate > pts[-1][0] * 1.001
        for (r0, v0), (r1, v1) in itertools.pairwise(pts):
            if r0 <= rate <= r1:
                return v0 + (v1 - v0) * (rate - r0) / (r1 - r0), False
        raise AssertionError("unreachable")  # pragma: no cover


class PowerLaw(BaseModel):
    """V_payload / H = coefficient * rate ** exponent, fitted in log-log space."""

    model_config = ConfigDict(frozen=True)

    coefficient: float
    exponent: float
    points: list[tuple[float, float]]
    sources: list[str] = Field(default_factory=list)
    how: str

    def at(self, rate: float) -> tuple[float, bool]:
        lo, hi = min(r for r, _ in self.points), max(r for r, _ in self.points)
        value = min(self.coefficient * rate**self.exponent, 1.0)
        return value, not (lo * 0.95 <= rate <= hi * 1.05)


class Calibration(BaseModel):
    """Everything `model.project` needs, with where each figure came from."""

    model_config = ConfigDict(frozen=True)

    format: Literal[1] = 1
    created: str
    results_dir: str
    quiet_load_per_cpu: float = QUIET_LOAD_PER_CPU
    sources: list[Source]
    v_over_h: PowerLaw
    link_overhead: Scalar
    payload_overhead_s: Scalar
    construction_colocated: Curve
    construction_isolated: Curve | None = None
    apply: Curve
    startup_fixed_s: Scalar
    finalization_s_per_byte: Scalar
    relay_hop: Scalar | None = None
    relay_hop_payload_s: Scalar | None = None
    s3_upload: Scalar | None = None
    s3_download: Scalar | None = None

    def constants(self, rate: float, *, colocated: bool) -> tuple[Constants, list[str]]:
        """The model's constants at `rate`, and notes on extrapolation and missing figures.

        `colocated`: the bench's setting (producer and receivers on the same cores), which uses
        the refit bench's own construction throughput; otherwise the codec bench's producer
        alone, when measured."""
        notes: list[str] = []
        v, out = self.v_over_h.at(rate)
        if out:
            lo, hi = (f(r for r, _ in self.v_over_h.points) for f in (min, max))
            notes.append(
                f"V_payload extrapolated: change rate {rate:.3g} outside the measured "
                f"{lo:.3g}-{hi:.3g}"
            )
        construction = self.construction_colocated
        if not colocated and self.construction_isolated is not None:
            construction = self.construction_isolated
        elif not colocated:
            notes.append(
                "construction: no codec bench result; the refit bench's producer (sharing its "
                "cores with the receivers) is used"
            )
        g_c, out_c = construction.at(rate)
        g_a, out_a = self.apply.at(rate)
        if out_c or out_a:
            notes.append("throughputs held at the nearest measured change rate (extrapolated)")
        hop = self.relay_hop.value if self.relay_hop else None
        return (
            Constants(
                v_over_h=v,
                link_overhead=self.link_overhead.value,
                payload_overhead_s=self.payload_overhead_s.value,
                construction_bytes_s=g_c,
                apply_bytes_s=g_a,
                startup_fixed_s=self.startup_fixed_s.value,
                finalization_s_per_byte=self.finalization_s_per_byte.value,
                hop_bytes_s=hop,
                hop_payload_s=self.relay_hop_payload_s.value if self.relay_hop_payload_s else 0.0,
                s3_upload_bytes_s=self.s3_upload.value if self.s3_upload else None,
                s3_download_bytes_s=self.s3_download.value if self.s3_download else None,
            ),
            notes,
        )


# ------------------------------------------------------------------------------------ files
def default_results_dir() -> Path:
    """bench/results of this source checkout, else of the current directory."""
    checkout = Path(__file__).resolve().parents[3]
    return (checkout if (checkout / "bench").is_dir() else Path.cwd()) / "bench" / "results"


def load(path: Path | None = None) -> Calibration:
    """A calibration file (default: the one shipped with the package)."""
    path = path or SHIPPED
    try:
        return Calibration.model_validate_json(path.read_text())
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot read the calibration: {exc.strerror}") from exc
    except ValueError as exc:
        raise CalibrationError(f"{path}: not a plan calibration: {exc}") from exc


def write(calibration: Calibration, path: Path) -> None:
    """Write atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(calibration.model_dump_json(indent=2) + "\n")
    os.replace(tmp, path)


def _stamped(results_dir: Path, benchmark: str) -> list[Path]:
    """`<benchmark>-<UTC stamp>.json`, oldest first (the `-latest` copies are skipped)."""
    return sorted(p for p in results_dir.glob(f"{benchmark}-*.json") if _STAMP.search(p.name))


def _stamp_time(path: Path) -> datetime:
    match = _STAMP.search(path.name)
    assert match is not None
    return datetime.strptime(match.group(1), "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# ------------------------------------------------------------------------------- refit runs
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


def link_bytes_s(result: Mapping[str, Any]) -> float | None:
    """The shaped link's rate in bytes/s; None for an unshaped run (no `link_mbit`, or 0)."""
    mbit = result.get("link_mbit")
    return float(mbit) * 1e6 / 8 if mbit else None


def bench_last_tensor_bytes(result: Mapping[str, Any]) -> int | None:
    """Bytes of the last tensor of the bench's synthetic checkpoint (its output head), rebuilt
    from the run's settings; None when that does not reproduce the run's H."""
    from refit_tools.bench.refit_workload import Workload

    requested = (result.get("settings") or {}).get("checkpoint_bytes")
    if not requested:
        return None
    work = Workload(checkpoint_bytes=int(requested))
    if work.nbytes != int(result["checkpoint_bytes"]):
        return None
    return 2 * math.prod(work.layout()[-1][1])


def bench_deployment(result: Mapping[str, Any], rate: float) -> Deployment:
    """The deployment a `bench refit` result measured: one producer, its nodes, its link, the
    rollout namespace's relay links unshaped."""
    from refit_sidecar.baseline.sizing import resolve_sizes

    settings = result.get("settings") or {}
    h = int(result["checkpoint_bytes"])
    chunk, bucket = (settings.get(k) for k in ("chunk_bytes", "bucket_bytes"))
    sizes = resolve_sizes(
        chunk if isinstance(chunk, int) else "auto",
        bucket if isinstance(bucket, int) else "auto",
        total_bytes=h,
        producers=1,
    )
    return Deployment(
        model_bytes=h,
        change_rate=rate,
        producers=1,
        nodes=int(result["nodes"]),
        cross_bytes_s=link_bytes_s(result),
        intra_bytes_s=None,
        chunk_bytes=sizes.chunk_bytes,
        bucket_bytes=sizes.bucket_bytes,
        transport="relay",
        last_tensor_bytes=bench_last_tensor_bytes(result),
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


def _pipeline_s(run: Mapping[str, Any]) -> float | None:
    pipe = run.get("pipeline") or {}
    if "compare" not in pipe:
        return None
    return float(pipe["compare"]) + float(pipe.get("compress", 0.0))


def _pooled(points: Iterable[tuple[float, float, float]]) -> list[tuple[float, float]]:
    """Per nominal rate: sum(bytes) / sum(seconds) over (rate, bytes, seconds) samples."""
    groups: dict[float, list[tuple[float, float, float]]] = {}
    for rate, nbytes, secs in points:
        groups.setdefault(round(rate, 3), []).append((rate, nbytes, secs))
    out = []
    for samples in groups.values():
        rate = statistics.fmean(r for r, _, _ in samples)
        out.append((rate, sum(b for _, b, _ in samples) / sum(s for _, _, s in samples)))
    return sorted(out)


def _power_law(points: list[tuple[float, float]]) -> tuple[float, float]:
    xs = [math.log(r) for r, _ in points]
    ys = [math.log(v) for _, v in points]
    if len({round(x, 6) for x in xs}) < 2:
        raise CalibrationError("V_payload needs refit results at two or more change rates")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return math.exp(my - slope * mx), slope


# ------------------------------------------------------------------------------------- fit
def fit(results_dir: Path, *, exclude: Iterable[str] = ()) -> Calibration:
    """Fit every constant from the result files in `results_dir` (file names in `exclude` are
    left out: the leave-one-out validation uses it)."""
    skip = set(exclude)
    sources: list[Source] = []
    refits: list[tuple[str, dict[str, Any]]] = []
    for path in _stamped(results_dir, "refit"):
        if path.name in skip:
            continue
        data = _read(path)
        if data is None or data.get("benchmark") != "refit" or "rates" not in data:
            sources.append(Source(file=path.name, benchmark="refit", used=False, why="unreadable"))
            continue
        load, cpus = load_of(data)
        why = (
            f"load {load:.1f} on {cpus} CPUs: "
            + ("quiet, timings used" if is_quiet(data) else "busy, byte counts only")
            if load is not None
            else "no load average before the run: byte counts only"
        )
        sources.append(
            Source(
                file=path.name,
                benchmark="refit",
                started=data.get("started"),
                machine=data.get("machine") or {},
                used=True,
                why=why,
            )
        )
        refits.append((path.name, data))
    if not refits:
        raise CalibrationError(
            f"{results_dir}: no refit-<UTC>.json results (kuberefit bench refit)"
        )
    quiet = [(n, d) for n, d in refits if is_quiet(d)]
    if not quiet:
        raise CalibrationError(f"{results_dir}: no refit result measured on a quiet machine")
    names_all = [n for n, _ in refits]
    names_quiet = [n for n, _ in quiet]

    # Byte counts: every run.
    v_points = [
        (rate, float(row["v_payload_bytes"]) / float(d["checkpoint_bytes"]))
        for _, d in refits
        for _, rate, row in rate_rows(d)
    ]
    coef, exponent = _power_law(v_points)
    # Only shaped runs count link bytes (an unshaped run has no qdisc to count them).
    refs = [
        d["full_reference"]
        for _, d in refits
        if link_bytes_s(d) and (d.get("full_reference") or {}).get("link_bytes")
    ]
    if not refs:
        raise CalibrationError("no shaped refit result counts the reference's link bytes")
    overhead = sum(float(r["link_bytes"]) for r in refs) / sum(float(r["wire_bytes"]) for r in refs)

    transport = _transport(results_dir, skip, sources)
    hop_figure = transport.get("hop")
    hop = hop_figure.value if hop_figure is not None else None
    hop_payload = transport.get("hop_payload_s")

    # Timings: quiet runs only.
    construction: list[tuple[float, float, float]] = []
    finalization: list[tuple[float, float]] = []
    for _, d in quiet:
        h = float(d["checkpoint_bytes"])
        for _, rate, row in rate_rows(d):
            for run in _runs(row):
                secs = _pipeline_s(run)
                if secs:
                    construction.append((rate, h, secs))
                finalization.append((float(run["finalization_s"]), h))
    g_c = _pooled(construction)
    if not g_c:
        raise CalibrationError("no refit result carries the producer's pipeline timings")
    construction_curve = Curve(
        unit="B/s",
        points=g_c,
        sources=names_quiet,
        how="H / (compare + compress busy seconds of the producer), pooled per change rate "
        "over the quiet refit runs (producer and receivers share the bench's cores)",
    )

    per_payload, startup_fixed, apply_samples = [], [], []
    for _, d in quiet:
        link = link_bytes_s(d)
        for _, rate, row in rate_rows(d):
            if "drain_s" not in row:
                continue
            dep = bench_deployment(d, rate)
            n_p = max(int(r.get("payloads") or 1) for r in _runs(row))
            g, _ = construction_curve.at(rate)
            startup_fixed.append(float(row["startup_s"]) - first_region(dep) / g)
            if link:
                link_s = float(row["v_payload_bytes"]) * overhead / link
                per_payload.append((float(row["transport_span_s"]) - link_s) / n_p)
            v_h = float(row["v_payload_bytes"]) / float(d["checkpoint_bytes"])
            last = last_region(dep)
            hop_s = (tree_depth(dep.nodes) - 1) * (
                (v_h * last / hop if hop else 0.0) + (hop_payload or 0.0)
            )
            apply_samples.append((rate, last, max(float(row["drain_s"]) - hop_s, 1e-3)))
    if not apply_samples:
        raise CalibrationError("no quiet refit result splits its window (startup_s, drain_s)")
    apply_curve = Curve(
        unit="B/s",
        points=_pooled(apply_samples),
        sources=names_quiet,
        how="region of H the last payload covers (a bucket, or the output head when larger) / "
        "the drain after the last send less its relay hops: the last payload's apply, pooled "
        "per change rate over the quiet refit runs (all of the bench's receivers share its "
        "cores, so this is low for a node of its own)",
    )
    isolated = _codec(results_dir, skip, sources)
    fin_rate = sum(f for f, _ in finalization) / sum(h for _, h in finalization)
    return Calibration(
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        results_dir=str(results_dir),
        sources=sources,
        v_over_h=PowerLaw(
            coefficient=coef,
            exponent=exponent,
            points=sorted(v_points),
            sources=names_all,
            how="least squares of log(V_payload / H) on log(change rate) over every refit "
            "run's per-rate means (synthetic uniform changes of relative amplitude 1e-2)",
        ),
        link_overhead=Scalar(
            value=overhead,
            unit="link bytes / payload byte",
            sources=names_all,
            how="full-checkpoint reference: bytes through the tbf qdisc (TCP/IP and Ethernet "
            "headers) / payload bytes sent, summed over every refit run",
        ),
        payload_overhead_s=Scalar(
            value=max(statistics.fmean(per_payload), 0.0) if per_payload else 0.0,
            unit="s per payload",
            kind="measured" if per_payload else "assumed",
            sources=names_quiet if per_payload else [],
            how="(transport span - V_payload * link overhead / link rate) / payloads, mean over "
            "the quiet shaped refit runs: the send window's per-payload round trips"
            if per_payload
            else "no quiet shaped refit run: taken as 0",
        ),
        construction_colocated=construction_curve,
        construction_isolated=isolated,
        apply=apply_curve,
        startup_fixed_s=Scalar(
            value=max(statistics.fmean(startup_fixed), 0.0),
            unit="s",
            sources=names_quiet,
            how="start-up (t0 to the first send) less the first payload's construction, mean "
            "over the quiet refit runs: the start call and the first seal",
        ),
        finalization_s_per_byte=Scalar(
            value=fin_rate,
            unit="s per byte of a producer's share of H",
            sources=names_quiet,
            how="sum of finalization times / sum of H over the quiet refit runs' transitions "
            "(one producer): the compare-and-set commit and the baseline update",
        ),
        relay_hop=hop_figure,
        relay_hop_payload_s=transport.get("hop_payload"),
        s3_upload=transport.get("s3_upload"),
        s3_download=transport.get("s3_download"),
    )


def _codec(results_dir: Path, skip: set[str], sources: list[Source]) -> Curve | None:
    """Construction throughput of one producer alone (2 compare threads), from the latest batch
    of full codec results (median per change rate)."""
    full = []
    for path in _stamped(results_dir, "codec"):
        if path.name in skip:
            continue
        data = _read(path)
        if data is None or data.get("quick") or "checkpoint" not in data:
            continue
        full.append((path, data))
    if not full:
        return None
    newest = _stamp_time(full[-1][0])
    batch = [(p, d) for p, d in full if (newest - _stamp_time(p)).total_seconds() <= CODEC_BATCH_S]
    per_rate: dict[float, list[float]] = {}
    for path, data in batch:
        settings = data.get("checkpoint_settings") or {}
        sources.append(
            Source(
                file=path.name,
                benchmark="codec",
                started=_stamp_time(path).isoformat(timespec="seconds"),
                machine={"cpus": settings.get("cpus"), "torch_threads": data.get("torch_threads")},
                used=True,
                why="latest batch of full codec runs",
            )
        )
        for key, row in data["checkpoint"].items():
            gbps = row.get("encode_gbps_2t") or row.get("encode_gbps_1t")
            if gbps:
                per_rate.setdefault(float(key), []).append(float(gbps) * 1e9)
    if not per_rate:
        return None
    return Curve(
        unit="B/s",
        points=sorted((r, statistics.median(v)) for r, v in per_rate.items()),
        sources=[p.name for p, _ in batch],
        how="codec bench: H / encode time of the real producer pipeline (compare, coalesce, "
        "zstd) with 2 compare threads, alone on the machine; median per change rate over the "
        "latest batch of full runs",
    )


def _transport(results_dir: Path, skip: set[str], sources: list[Source]) -> dict[str, Any]:
    """Relay hop and S3 figures from the latest transport result, if any."""
    files = [p for p in _stamped(results_dir, "transport") if p.name not in skip]
    for path in reversed(files):
        data = _read(path)
        if data is None or data.get("benchmark", "transport") != "transport":
            continue
        if not any(data.get(k) for k in ("hop_gb_s", "upload_gb_s", "download_gb_s")):
            continue  # a multi-node run: its figures are not one hop's
        out: dict[str, Any] = {}
        hop_gbs = data.get("hop_gb_s")
        per_payload_ms = data.get("per_payload_ms")
        if hop_gbs:
            out["hop"] = Scalar(
                value=float(hop_gbs) * 1e9,
                unit="B/s",
                sources=[path.name],
                how="transport bench: one relay hop's throughput (1 node, loopback)",
            )
        if per_payload_ms is not None:
            out["hop_payload_s"] = float(per_payload_ms) / 1e3
            out["hop_payload"] = Scalar(
                value=float(per_payload_ms) / 1e3,
                unit="s per payload per hop",
                sources=[path.name],
                how="transport bench: time per 1 KiB payload of a stream (window 2)",
            )
        for key, name in (("upload_gb_s", "s3_upload"), ("download_gb_s", "s3_download")):
            if data.get(key):
                out[name] = Scalar(
                    value=float(data[key]) * 1e9,
                    unit="B/s",
                    sources=[path.name],
                    how=f"transport bench: S3 {key.split('_')[0]} throughput of one client",
                )
        sources.append(
            Source(
                file=path.name,
                benchmark="transport",
                started=data.get("started") or _stamp_time(path).isoformat(timespec="seconds"),
                machine=data.get("machine") or {},
                used=bool(out),
                why="latest transport result" if out else "no relay hop or S3 figures in it",
            )
        )
        if out:
            return out
    return {}
