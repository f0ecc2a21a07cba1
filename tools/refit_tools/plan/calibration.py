"""The plan's calibration: every constant of the model, fitted from this repository's bench
results, with the files it came from.

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
- `codec-<UTC>.json` (`kuberefit bench codec`, full size): construction throughput of one
  producer alone on the machine (the plan's figure; the refit bench's own producer is fitted
  from its start-up, see above).
- `transport-<UTC>.json` (`kuberefit bench transport`), when present: one relay hop's throughput
  and per-payload cost (the fan-out stage, and each bench node's receive), and S3
  upload/download throughput when measured.

Each figure keeps its sources, and the whole calibration is one JSON file: `write` / `load`.
A result file that cannot be read, or lacks a field the fit reads (or holds something other
than a usable number there), is skipped: its `Source` is not used and says which field.
The package ships one fitted from this checkout's results (`calibration.json`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from refit_tools.plan.files import InputFileError, read_json
from refit_tools.plan.model import (
    ELEMENT_BYTES,
    Constants,
    Deployment,
    first_region,
    last_region,
    tree_depth,
)

#: A run is quiet when its 1-minute load average before it is at most this x the CPU count.
QUIET_LOAD_PER_CPU = 1.5
#: A rate is link-bound when the link time of its V_payload fills at least this share of its
#: transport span, and CPU-bound when at most this other share (or the link is unshaped).
LINK_BOUND_SHARE = 0.75
CPU_BOUND_SHARE = 0.5
#: Codec results within this many seconds of the latest full one form its batch.
CODEC_BATCH_S = 3600
SHIPPED = Path(__file__).with_name("calibration.json")
_STAMP = re.compile(r"-(\d{8}T\d{6}Z)\.json$")
#: A refit result's rate row splits its window when it has these (and finalization_s).
_WINDOW = ("startup_s", "transport_span_s", "drain_s")

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


class Costs(BaseModel):
    """A fitted CPU cost: seconds = fixed_s + s_per_byte x bytes of H + s_per_changed x changed
    elements in them + s_per_payload x payloads, on the bench machine."""

    model_config = ConfigDict(frozen=True)

    fixed_s: float = 0.0
    s_per_byte: float = 0.0
    s_per_changed: float = 0.0
    s_per_payload: float = 0.0
    #: Change rates of the points it was fitted to (lowest, highest).
    rates: tuple[float, float]
    #: Rate rows fitted, and the root mean square of their relative residuals.
    points: int
    rms_error: float
    kind: Kind = "measured"
    sources: list[str] = Field(default_factory=list)
    how: str

    def s_per_h_byte(self, rate: float, element_bytes: int = ELEMENT_BYTES) -> float:
        """Seconds per byte of H at `rate` (the changed elements' share included)."""
        return self.s_per_byte + self.s_per_changed * rate / element_bytes

    def bytes_s(self, rate: float, element_bytes: int = ELEMENT_BYTES) -> float:
        """Bytes of H per second at `rate` (infinite when it costs nothing per byte)."""
        per = self.s_per_h_byte(rate, element_bytes)
        return 1.0 / per if per > 0 else math.inf

    def extrapolated(self, rate: float) -> bool:
        lo, hi = self.rates
        return not (lo * 0.95 <= rate <= hi * 1.05)


class Calibration(BaseModel):
    """Everything `model.project` needs, with where each figure came from."""

    model_config = ConfigDict(frozen=True)

    format: Literal[2] = 2
    created: str
    results_dir: str
    quiet_load_per_cpu: float = QUIET_LOAD_PER_CPU
    sources: list[Source]
    v_over_h: PowerLaw
    link_overhead: Scalar
    payload_overhead_s: Scalar
    stream_fixed_s: Scalar
    #: The refit bench's producer (start-up fit: alone on the machine before the first send).
    construction: Costs
    #: The codec bench's producer alone (the plan's construction figure when measured).
    construction_isolated: Curve | None = None
    startup_fixed_s: Scalar
    #: One node applying payloads on one core (per byte of H, changed element and payload).
    apply: Costs
    #: After the last send: fixed flush barriers, and the last payload's region.
    drain: Costs
    #: Commit and baseline update (fixed, per byte of a producer's share of H).
    finalization: Costs
    relay_hop: Scalar | None = None
    relay_hop_payload_s: Scalar | None = None
    s3_upload: Scalar | None = None
    s3_download: Scalar | None = None

    def constants(
        self, rate: float, *, colocated: bool, element_bytes: int = ELEMENT_BYTES
    ) -> tuple[Constants, list[str]]:
        """The model's constants at `rate`, and notes on extrapolation and missing figures.

        `colocated`: the bench's setting (producer and receivers on the same machine), which
        uses the refit bench's own producer; otherwise the codec bench's producer alone, when
        measured."""
        notes: list[str] = []
        v, out = self.v_over_h.at(rate)
        if out:
            lo, hi = (f(r for r, _ in self.v_over_h.points) for f in (min, max))
            notes.append(
                f"V_payload extrapolated: change rate {rate:.3g} outside the measured "
                f"{lo:.3g}-{hi:.3g}"
            )
        g_c = self.construction.bytes_s(rate, element_bytes)
        out_c = self.construction.extrapolated(rate)
        if not colocated and self.construction_isolated is not None:
            g_c, out_c = self.construction_isolated.at(rate)
        elif not colocated:
            notes.append(
                "construction: no codec bench result; the refit bench's producer (alone on its "
                "machine before the first send) is used"
            )
        out_a = any(c.extrapolated(rate) for c in (self.apply, self.drain))
        if out_c or out_a:
            notes.append(
                "CPU costs extrapolated: the change rate is outside the measured ones "
                "(linear in the changed elements)"
            )
        hop = self.relay_hop.value if self.relay_hop else None
        return (
            Constants(
                v_over_h=v,
                link_overhead=self.link_overhead.value,
                payload_overhead_s=self.payload_overhead_s.value,
                construction_bytes_s=g_c,
                apply_bytes_s=self.apply.bytes_s(rate, element_bytes),
                startup_fixed_s=self.startup_fixed_s.value,
                finalization_s_per_byte=self.finalization.s_per_byte,
                hop_bytes_s=hop,
                hop_payload_s=self.relay_hop_payload_s.value if self.relay_hop_payload_s else 0.0,
                s3_upload_bytes_s=self.s3_upload.value if self.s3_upload else None,
                s3_download_bytes_s=self.s3_download.value if self.s3_download else None,
                stream_fixed_s=self.stream_fixed_s.value,
                apply_payload_s=self.apply.s_per_payload,
                drain_fixed_s=self.drain.fixed_s,
                drain_bytes_s=self.drain.bytes_s(rate, element_bytes),
                finalization_fixed_s=self.finalization.fixed_s,
            ),
            notes,
        )


def bench_machine(cal: Calibration) -> str:
    """The bench machine the calibration's timings came from, in words."""
    cpus = sorted({int(s.machine["cpus"]) for s in cal.sources if s.used and s.machine.get("cpus")})
    return f"{'/'.join(str(c) for c in cpus)}-CPU bench machine" if cpus else "bench machine"


# ------------------------------------------------------------------------------------ files
def default_results_dir() -> Path:
    """bench/results of this source checkout, else of the current directory."""
    checkout = Path(__file__).resolve().parents[3]
    return (checkout if (checkout / "bench").is_dir() else Path.cwd()) / "bench" / "results"


def load(path: Path | None = None) -> Calibration:
    """A calibration file (default: the one shipped with the package). A file that cannot be
    one raises `CalibrationError` with a one-line reason: missing or unreadable, not JSON,
    another kind of JSON (a bench result, say), an older format, or a field of the wrong shape."""
    path = path or SHIPPED
    try:
        data = read_json(path)  # bounded: size, depth, finite numbers (plan/files.py)
    except FileNotFoundError:
        raise CalibrationError(f"{path}: no such file") from None
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise CalibrationError(
            f"{path}: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    except InputFileError as exc:
        raise CalibrationError(f"{path}: {exc}") from None
    problem = _calibration_problem(data)
    if problem is not None:
        raise CalibrationError(f"{path}: not a plan calibration: {problem}")
    try:
        return Calibration.model_validate(data)
    except ValidationError as exc:
        raise CalibrationError(f"{path}: not a plan calibration: {_first_error(exc)}") from None


#: What to do about a file that is not a calibration.
_REWRITE = "write one with `kuberefit plan --calibrate`"
_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}
_JSON_KINDS[type(None)] = "null"


def _calibration_problem(data: Any) -> str | None:
    """Why `data` is plainly not a calibration of this format (None: validate it)."""
    if not isinstance(data, dict):
        kind = _JSON_KINDS.get(type(data), type(data).__name__)
        return f"a JSON {kind}, not an object; {_REWRITE}"
    benchmark = data.get("benchmark")
    if isinstance(benchmark, str) and "format" not in data:
        return f"it is a `kuberefit bench {benchmark}` result; {_REWRITE}"
    version = data.get("format")
    if "format" not in data:
        return f"it has no format field; {_REWRITE}"
    if version != 2:
        return (
            f"format {_short(version)}, and this KubeRefit reads format 2: refit it with "
            "`kuberefit plan --calibrate`"
        )
    return None


def _first_error(exc: ValidationError) -> str:
    """One line for a validation failure: how many problems, and the first."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"]) or "the file"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {first['msg'].lower()}{more}; {_REWRITE}"


def write(calibration: Calibration, path: Path) -> None:
    """Write atomically (a reader never sees half a file); an OSError leaves no temporary file
    behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(calibration.model_dump_json(indent=2) + "\n")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def _stamped(results_dir: Path, benchmark: str) -> list[Path]:
    """`<benchmark>-<UTC stamp>.json`, oldest first (the `-latest` copies and other benches'
    groupings such as `refit-links-<UTC>.json` are skipped)."""
    return sorted(p for p in results_dir.glob(f"{benchmark}-2*.json") if _STAMP.search(p.name))


def _stamp_time(path: Path) -> datetime:
    match = _STAMP.search(path.name)
    assert match is not None
    return datetime.strptime(match.group(1), "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)


def _read(path: Path) -> dict[str, Any] | None:
    return _read_why(path)[0]


def _read_why(path: Path) -> tuple[dict[str, Any] | None, str]:
    """(the result file's JSON object, or None and why not)."""
    try:
        data = read_json(path, finite=False)  # bounded; each field's number is checked by name
    except OSError as exc:
        return None, f"unreadable ({exc.strerror or exc})"
    except InputFileError as exc:
        return None, f"unreadable ({exc})"
    except ValueError:
        return None, "unreadable (not JSON)"
    if not isinstance(data, dict):
        return None, "unreadable (not a JSON object)"
    return data, ""


# ------------------------------------------------------------------ result files' fields
class _FieldError(ValueError):
    """A field of a result file that the fit cannot use (the message names it)."""


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _number(
    value: Any,
    where: str,
    *,
    positive: bool = True,
    integer: bool = False,
    optional: bool = False,
    at_most: float | None = None,
) -> None:
    """Raise `_FieldError` unless `value` is a finite number (positive, or non-negative), whole
    when `integer`; None passes when `optional`."""
    if value is None:
        if optional:
            return
        raise _FieldError(f"{where} is missing")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _FieldError(f"{where} is not a number ({_short(value)})")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer beyond a float's range
        finite = False
    if not finite:
        raise _FieldError(f"{where} is {_short(value)}, not a finite number")
    if value < 0 or (positive and value == 0):
        raise _FieldError(f"{where} is {_short(value)}, not {'positive' if positive else '>= 0'}")
    if integer and value != int(value):
        raise _FieldError(f"{where} is {_short(value)}, not a whole number")
    if at_most is not None and value > at_most:
        raise _FieldError(f"{where} is {_short(value)}, above {at_most:g}")


def _object(value: Any, where: str, *, optional: bool = True) -> dict[str, Any]:
    """`value` as an object ({} for None when `optional`), else `_FieldError`."""
    if value is None and optional:
        return {}
    if not isinstance(value, dict):
        raise _FieldError(f"{where} is {'missing' if value is None else 'not an object'}")
    return value


def _rate_key(key: str, row: Mapping[str, Any]) -> None:
    """The change rate `rate_rows` reads: the row's changed_fraction, else its key."""
    fraction = row.get("changed_fraction")
    if fraction:
        _number(fraction, f"rates.{key}.changed_fraction", at_most=1.0)
        return
    try:
        rate = float(key)
    except ValueError:
        raise _FieldError(f"rates key {_short(key)} is not a change rate") from None
    _number(rate, f"rates key {_short(key)}", at_most=1.0)


def _check_refit(data: Mapping[str, Any]) -> None:
    """Raise `_FieldError` naming the first field `fit` reads from a refit result that is missing or
    not a number it can use."""
    _number(data.get("checkpoint_bytes"), "checkpoint_bytes", integer=True)
    _number(data.get("nodes"), "nodes", integer=True)
    _number(data.get("link_mbit"), "link_mbit", positive=False, optional=True)
    machine = _object(data.get("machine"), "machine")
    _number(machine.get("cpus"), "machine.cpus", integer=True, optional=True)
    load = machine.get("load_avg_before")
    if load is not None:
        if not isinstance(load, list) or not load:
            raise _FieldError(f"machine.load_avg_before is not a list of numbers ({_short(load)})")
        _number(load[0], "machine.load_avg_before[0]", positive=False)
    rates = _object(data.get("rates"), "rates", optional=False)
    if not rates:
        raise _FieldError("rates is empty")
    for key, raw in rates.items():
        row = _object(raw, f"rates.{key}", optional=False)
        _rate_key(key, row)
        _number(row.get("v_payload_bytes"), f"rates.{key}.v_payload_bytes")
        if all(k in row for k in _WINDOW):
            for k in (*_WINDOW, "finalization_s"):
                _number(row.get(k), f"rates.{key}.{k}")
        runs = row.get("runs")
        if runs is not None:
            if not isinstance(runs, list):
                raise _FieldError(f"rates.{key}.runs is not a list")
            for i, run in enumerate(runs):
                where = f"rates.{key}.runs[{i}]"
                _number(
                    _object(run, where, optional=False).get("payloads"),
                    f"{where}.payloads",
                    positive=False,
                    integer=True,
                    optional=True,
                )
    reference = _object(data.get("full_reference"), "full_reference")
    if reference.get("link_bytes"):
        _number(reference["link_bytes"], "full_reference.link_bytes")
        _number(reference.get("wire_bytes"), "full_reference.wire_bytes")
    settings = _object(data.get("settings"), "settings")
    _number(
        settings.get("checkpoint_bytes"),
        "settings.checkpoint_bytes",
        positive=False,
        integer=True,
        optional=True,
    )
    _number(settings.get("seed"), "settings.seed", positive=False, integer=True, optional=True)
    recorded = data.get("sizes")
    if recorded:
        sizes = _object(recorded, "sizes")
        for k in ("chunk_bytes", "bucket_bytes"):
            _number(sizes.get(k), f"sizes.{k}", integer=True)


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
    result: Mapping[str, Any], chunk_bytes: int, bucket_bytes: int
) -> tuple[int, ...] | None:
    """Bytes of H of each payload of the run, in send order: its synthetic checkpoint's tensors
    grouped into export chunks (`refit_sidecar.baseline.chunks.plan_chunks`) and the chunks into
    buckets as the producer's `Bucketer` closes them (every chunk carries changes at the
    bench's rates). None when the layout cannot be rebuilt."""
    from refit_sidecar.baseline.chunks import plan_chunks

    work = _bench_workload(result)
    if work is None:
        return None
    regions: list[int] = []
    current = 0
    for chunk in plan_chunks(work.metas(), chunk_bytes):
        nbytes = sum(m.nbytes for m in chunk)
        if current and current + nbytes > bucket_bytes:
            regions.append(current)
            current = 0
        current += nbytes
        if current >= bucket_bytes:
            regions.append(current)
            current = 0
    if current:
        regions.append(current)
    return tuple(regions)


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
        Sizes(int(recorded["chunk_bytes"]), int(recorded["bucket_bytes"]), str(recorded["rule"]))
        if recorded
        else resolve_sizes(
            chunk if isinstance(chunk, int) else "auto",
            bucket if isinstance(bucket, int) else "auto",
            total_bytes=h,
            producers=1,
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
        transport="relay",
        last_tensor_bytes=bench_last_tensor_bytes(result),
        regions=bench_regions(result, sizes.chunk_bytes, sizes.bucket_bytes),
        shared_cpus=cpus,
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


# --------------------------------------------------------------------------- least squares
def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when (nearly) singular."""
    n = len(b)
    m = [[*row, rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-10:  # unit-norm columns: a (nearly) dependent one
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] for i in range(n)]


def nnls(
    rows: Sequence[Sequence[float]], targets: Sequence[float], weights: Sequence[float]
) -> list[float]:
    """Non-negative weighted least squares: the x >= 0 minimising sum (w (row . x - y))^2.

    Exact for the few unknowns here: every subset of free unknowns is solved unconstrained
    (normal equations of unit-norm columns) and the best solution with all of them positive is
    kept."""
    n = len(rows[0])
    wrows = [[w * x for x in row] for row, w in zip(rows, weights, strict=True)]
    wy = [w * y for y, w in zip(targets, weights, strict=True)]
    norms = [math.sqrt(sum(r[i] ** 2 for r in wrows)) for i in range(n)]

    def residual(x: list[float]) -> float:
        return sum(
            (sum(a * b for a, b in zip(r, x, strict=True)) - y) ** 2
            for r, y in zip(wrows, wy, strict=True)
        )

    best, best_res = [0.0] * n, residual([0.0] * n)
    usable = [i for i in range(n) if norms[i] > 0]
    for size in range(1, len(usable) + 1):
        for free in itertools.combinations(usable, size):
            ata = [
                [sum(r[i] * r[j] for r in wrows) / (norms[i] * norms[j]) for j in free]
                for i in free
            ]
            aty = [sum(r[i] * y for r, y in zip(wrows, wy, strict=True)) / norms[i] for i in free]
            sol = _solve(ata, aty)
            if sol is None or min(sol) <= 0:
                continue
            x = [0.0] * n
            for i, value in zip(free, sol, strict=True):
                x[i] = value / norms[i]
            res = residual(x)
            if res < best_res * (1 - 1e-12):
                best, best_res = x, res
    return best


def _rms(
    rows: Sequence[Sequence[float]],
    targets: Sequence[float],
    x: Sequence[float],
    totals: Sequence[float],
) -> float:
    """Root mean square of the residuals relative to each point's measured total."""
    errs = [
        (sum(a * b for a, b in zip(r, x, strict=True)) - y) / t
        for r, y, t in zip(rows, targets, totals, strict=True)
    ]
    return math.sqrt(statistics.fmean(e * e for e in errs)) if errs else 0.0


@dataclass(frozen=True)
class _Point:
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

    def changed(self, nbytes: float) -> float:
        return self.rate * nbytes / ELEMENT_BYTES

    def link_s(self, overhead: float) -> float:
        """The link time of the run's V_payload (0 when unshaped)."""
        return 0.0 if self.link is None else self.v * overhead / self.link

    @property
    def tail_share(self) -> float:
        return max(1.0, self.nodes / self.cpus)


def _points(name: str, result: Mapping[str, Any]) -> list[_Point]:
    out = []
    _, cpus = load_of(result)
    for _, rate, row in rate_rows(result):
        if not all(k in row for k in _WINDOW):
            continue
        dep = bench_deployment(result, rate)
        payloads = max(int(r.get("payloads") or 0) for r in _runs(row)) or len(dep.regions or ())
        out.append(
            _Point(
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
            )
        )
    return out


def _check_codec(data: Mapping[str, Any]) -> None:
    """Raise `_FieldError` naming the first field `_codec` reads that it cannot use."""
    settings = _object(data.get("checkpoint_settings"), "checkpoint_settings")
    _number(settings.get("cpus"), "checkpoint_settings.cpus", integer=True, optional=True)
    rows = _object(data.get("checkpoint"), "checkpoint", optional=False)
    for key, raw in rows.items():
        row = _object(raw, f"checkpoint.{key}", optional=False)
        try:
            rate = float(key)
        except ValueError:
            raise _FieldError(f"checkpoint key {_short(key)} is not a change rate") from None
        _number(rate, f"checkpoint key {_short(key)}", at_most=1.0)
        for k in ("encode_gbps_2t", "encode_gbps_1t"):
            _number(row.get(k), f"checkpoint.{key}.{k}", positive=False, optional=True)


def _check_transport(data: Mapping[str, Any]) -> None:
    """Raise `_FieldError` naming the first figure `_transport` reads that it cannot use."""
    for key in ("hop_gb_s", "upload_gb_s", "download_gb_s", "per_payload_ms"):
        _number(data.get(key), key, positive=False, optional=True)
    _object(data.get("machine"), "machine")


@dataclass(frozen=True)
class _Refit:
    """What the fit takes from one refit result file."""

    name: str
    data: dict[str, Any]
    quiet: bool
    #: (change rate, V_payload / H) of each rate.
    v_points: list[tuple[float, float]]
    #: The full-checkpoint reference's (link bytes, payload bytes) on a shaped link.
    reference: tuple[float, float] | None
    #: Each rate's window split (quiet runs only).
    points: list[_Point]


def _refit(path: Path) -> tuple[_Refit | None, str]:
    """(the run, why it is used) or (None, why it is skipped: the problem, named)."""
    data, why = _read_why(path)
    if data is None:
        return None, why
    if data.get("benchmark") != "refit":
        return None, f"not a refit result (benchmark {_short(data.get('benchmark'))})"
    try:
        _check_refit(data)
        quiet = is_quiet(data)
        h = float(data["checkpoint_bytes"])
        v_points = [(rate, float(row["v_payload_bytes"]) / h) for _, rate, row in rate_rows(data)]
        full = data.get("full_reference") or {}
        reference = (
            (float(full["link_bytes"]), float(full["wire_bytes"]))
            if link_bytes_s(data) and full.get("link_bytes")
            else None
        )
        points = _points(path.name, data) if quiet else []
    except _FieldError as exc:
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
    return _Refit(path.name, data, quiet, v_points, reference, points), why


# ------------------------------------------------------------------------------------- fit
def fit(results_dir: Path, *, exclude: Iterable[str] = ()) -> Calibration:
    """Fit every constant from the result files in `results_dir` (file names in `exclude` are
    left out: the leave-one-out validation uses it)."""
    skip = set(exclude)
    sources: list[Source] = []
    refits: list[_Refit] = []
    for path in _stamped(results_dir, "refit"):
        if path.name in skip:
            continue
        run, why = _refit(path)
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
    quiet = [r for r in refits if r.quiet]
    if not quiet:
        raise CalibrationError(f"{results_dir}: no refit result measured on a quiet machine")
    names_all = [r.name for r in refits]

    # Byte counts: every run.
    v_points = [point for r in refits for point in r.v_points]
    coef, exponent = _power_law(v_points)
    # Only shaped runs count link bytes (an unshaped run has no qdisc to count them).
    refs = [r.reference for r in refits if r.reference is not None]
    if not refs:
        raise CalibrationError("no shaped refit result counts the reference's link bytes")
    overhead = sum(link for link, _ in refs) / sum(wire for _, wire in refs)

    transport = _transport(results_dir, skip, sources)
    hop_figure: Scalar | None = transport.get("hop")
    hop = hop_figure.value if hop_figure is not None else None
    hop_payload_figure: Scalar | None = transport.get("hop_payload")
    hop_payload = hop_payload_figure.value if hop_payload_figure is not None else 0.0

    # Timings: every rate of the quiet runs that splits its window.
    points = [p for r in quiet for p in r.points]
    if not points:
        raise CalibrationError("no quiet refit result splits its window (startup_s, drain_s)")
    rates = (min(p.rate for p in points), max(p.rate for p in points))

    def names(pts: Iterable[_Point]) -> list[str]:
        return sorted({p.file for p in pts})

    # Start-up: fixed + the first payload's region, the producer alone on the machine.
    rows = [[1.0, p.first, p.changed(p.first)] for p in points]
    ys = [p.startup for p in points]
    s0, c_byte, c_changed = nnls(rows, ys, [1 / y for y in ys])
    startup_rms = _rms(rows, ys, (s0, c_byte, c_changed), ys)

    def construction_s(p: _Point, nbytes: float) -> float:
        return c_byte * nbytes + c_changed * p.changed(nbytes)

    link_bound = [p for p in points if p.link and p.link_s(overhead) >= LINK_BOUND_SHARE * p.span]
    cpu_bound = [p for p in points if p.link_s(overhead) <= CPU_BOUND_SHARE * p.span]

    # Cross-cluster stream beyond the link time: fixed + per payload (link-bound rates).
    if link_bound:
        rows = [[1.0, float(p.payloads)] for p in link_bound]
        ys = [p.span - p.link_s(overhead) for p in link_bound]
        stream_fixed, per_payload = nnls(rows, ys, [1 / p.span for p in link_bound])
    else:
        stream_fixed = per_payload = 0.0

    # Drain after the last root ACK: its relay hops, then fixed + the last region on every
    # node at once (link-bound rates: nothing else is left to do then).
    def hops_s(p: _Point) -> float:
        last_wire = p.v * p.last / p.h
        depth = tree_depth(p.nodes)
        return (depth - 1) * ((last_wire / hop if hop else 0.0) + hop_payload)

    drain_points = link_bound or points
    rows = [[1.0, p.tail_share * p.last, p.tail_share * p.changed(p.last)] for p in drain_points]
    ys = [p.drain - hops_s(p) for p in drain_points]
    d0, d_byte, d_changed = nnls(rows, ys, [1 / p.drain for p in drain_points])
    drain_rms = _rms(rows, ys, (d0, d_byte, d_changed), [p.drain for p in drain_points])

    def drain_s(p: _Point) -> float:
        return d0 + hops_s(p) + p.tail_share * (d_byte * p.last + d_changed * p.changed(p.last))

    # Apply: what a CPU-bound rate's span + drain leaves after the producer's remaining
    # construction, each node's receive and the drain, shared by the nodes on the CPUs.
    def relay_s(p: _Point) -> float:
        return p.nodes * ((p.v / hop if hop else 0.0) + p.payloads * hop_payload)

    if cpu_bound:
        rows = [
            [
                p.nodes / p.cpus * (p.h - p.last),
                p.nodes / p.cpus * p.changed(p.h - p.last),
                p.nodes / p.cpus * (p.payloads - 1),
            ]
            for p in cpu_bound
        ]
        ys = [
            p.span + p.drain - drain_s(p) - construction_s(p, p.h - p.first) - relay_s(p)
            for p in cpu_bound
        ]
        totals = [p.span + p.drain for p in cpu_bound]
        a_byte, a_changed, a_payload = nnls(rows, ys, [1 / t for t in totals])
        apply = Costs(
            s_per_byte=a_byte,
            s_per_changed=a_changed,
            s_per_payload=a_payload,
            rates=(min(p.rate for p in cpu_bound), max(p.rate for p in cpu_bound)),
            points=len(cpu_bound),
            rms_error=_rms(rows, ys, (a_byte, a_changed, a_payload), totals),
            sources=names(cpu_bound),
            how="CPU-bound quiet refit rates (link time of V_payload <= "
            f"{CPU_BOUND_SHARE:.0%} of the span): span + drain = the producer's remaining "
            "construction + each node's receive at the relay hop's pace + nodes / CPUs x each "
            "node's apply of all but the last payload (one core each) + the fitted drain; "
            "non-negative least squares of relative residuals",
        )
    else:
        apply = Costs(
            s_per_byte=d_byte,
            s_per_changed=d_changed,
            rates=rates,
            points=0,
            rms_error=0.0,
            kind="assumed",
            sources=names(drain_points),
            how="no CPU-bound quiet refit run (unshaped or fast link): taken as the drain's "
            "cost per byte of the last payload's region",
        )

    rows = [[1.0, p.h] for p in points]
    ys = [p.finalization for p in points]
    f0, f_byte = nnls(rows, ys, [1 / y for y in ys])

    isolated = _codec(results_dir, skip, sources)
    return Calibration(
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
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
            value=per_payload,
            unit="s per payload",
            kind="measured" if link_bound else "assumed",
            sources=names(link_bound),
            how="link-bound quiet refit rates: span - V_payload x link overhead / link rate = "
            "fixed + payloads x this (non-negative least squares): the send window's stalls"
            if link_bound
            else "no quiet link-bound refit run: taken as 0",
        ),
        stream_fixed_s=Scalar(
            value=stream_fixed,
            unit="s",
            kind="measured" if link_bound else "assumed",
            sources=names(link_bound),
            how="the same fit's fixed part: the cross-cluster stream's ramp and last ACK"
            if link_bound
            else "no quiet link-bound refit run: taken as 0",
        ),
        construction=Costs(
            s_per_byte=c_byte,
            s_per_changed=c_changed,
            rates=rates,
            points=len(points),
            rms_error=startup_rms,
            sources=names(points),
            how="start-up (t0 to the first send) = fixed + the first payload's region of H "
            "(from the run's tensor layout and sizes) x this, non-negative least squares of "
            "relative residuals over every quiet refit rate: the refit bench's producer with the "
            "machine to itself",
        ),
        construction_isolated=isolated,
        startup_fixed_s=Scalar(
            value=s0,
            unit="s",
            sources=names(points),
            how="the start-up fit's fixed part: the start call and the first seal",
        ),
        apply=apply,
        drain=Costs(
            fixed_s=d0,
            s_per_byte=d_byte,
            s_per_changed=d_changed,
            rates=(min(p.rate for p in drain_points), max(p.rate for p in drain_points)),
            points=len(drain_points),
            rms_error=drain_rms,
            sources=names(drain_points),
            how=(
                f"link-bound quiet refit rates (link time of V_payload >= {LINK_BOUND_SHARE:.0%} "
                "of the span)"
                if link_bound
                else "every quiet refit rate (none link-bound)"
            )
            + ": drain (last root ACK to every completion ACK) less the last payload's relay "
            "hops = fixed (flush barriers) + max(1, nodes / CPUs) x the last payload's region "
            "x this (its apply on every node at once), non-negative least squares of relative "
            "residuals",
        ),
        finalization=Costs(
            fixed_s=f0,
            s_per_byte=f_byte,
            rates=rates,
            points=len(points),
            rms_error=_rms(rows, ys, (f0, f_byte), ys),
            sources=names(points),
            how="finalization (every completion ACK to t1: the compare-and-set commit and the "
            "wait for the baseline writes still running) = fixed + H x this (one producer), "
            "non-negative least squares of relative residuals over every quiet refit rate",
        ),
        relay_hop=hop_figure,
        relay_hop_payload_s=hop_payload_figure,
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
        try:
            _check_codec(data)
        except _FieldError as exc:
            why = f"skipped: {exc}"
            sources.append(Source(file=path.name, benchmark="codec", used=False, why=why))
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
        try:
            _check_transport(data)
        except _FieldError as exc:
            why = f"skipped: {exc}"
            sources.append(Source(file=path.name, benchmark="transport", used=False, why=why))
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
            out["hop_payload"] = Scalar(
                value=float(per_payload_ms) / 1e3,
                unit="s per payload per hop",
                sources=[path.name],
                how="transport bench: time per 1 KiB payload of a stream (window 4)",
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
