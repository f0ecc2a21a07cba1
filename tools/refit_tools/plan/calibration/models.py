"""What a calibration is: each fitted figure with the files it came from (`Scalar`, `Curve`,
`PowerLaw`, `Costs`), the whole `Calibration`, and the model constants it gives at a change
rate. Kept apart from the fit and the file so that a reader of the plan needs only these."""

from __future__ import annotations

import itertools
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from refit_tools.plan.model import ELEMENT_BYTES, Constants

#: A run is quiet when its 1-minute load average before it is at most this x the CPU count.
QUIET_LOAD_PER_CPU = 1.5

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
    #: One MAC-only relay hop (relay-to-relay links inside the rollout cluster, by default).
    relay_hop_mac: Scalar | None = None
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
                hop_mac_bytes_s=self.relay_hop_mac.value if self.relay_hop_mac else None,
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
