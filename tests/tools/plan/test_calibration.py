"""The plan's calibration: fitted from this repository's bench results, shipped as package data,
and validated by leave-one-out against the measured `bench refit` runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from refit_tools.plan import calibration as cal
from refit_tools.plan.projection import project_bench, project_for_bench

REPO = Path(__file__).resolve().parents[3]
RESULTS = REPO / "bench" / "results"
#: Runs of the product before the early baseline update: kept, not fitted.
SUPERSEDED = RESULTS / "superseded"
TOLERANCE = 0.25
#: Today's runs: the acceptance set of the leave-one-out validation.
TODAY = "refit-20261206T02"
REGENERATE = (
    "regenerate it: .venv/bin/kuberefit plan --calibrate --results-dir bench/results "
    "--calibration tools/refit_tools/plan/calibration.json"
)


def _refit_files() -> list[Path]:
    return sorted(p for p in RESULTS.glob("refit-2*.json"))


def _fitted(c: cal.Calibration) -> dict[str, Any]:
    """The fitted content (not when or from where it was fitted)."""
    return c.model_dump(exclude={"created", "results_dir"})


def _close(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(a)} != {sorted(b)}"]
        return [m for k in a for m in _close(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)}"]
        return [
            m
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for m in _close(x, y, f"{path}[{i}]")
        ]
    if isinstance(a, float) or isinstance(b, float):
        return [] if a == pytest.approx(b, rel=1e-9) else [f"{path}: {a} != {b}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def test_the_shipped_calibration_is_a_fit_of_the_results_in_this_checkout() -> None:
    shipped = cal.load()
    fresh = cal.fit(RESULTS)
    diff = _close(_fitted(shipped), _fitted(fresh))
    assert not diff, (
        f"the shipped calibration differs from bench/results ({REGENERATE}): {diff[:5]}"
    )


def test_the_shipped_calibration_names_its_sources() -> None:
    shipped = cal.load()
    used = {s.file for s in shipped.sources if s.used}
    figures: list[cal.Scalar | cal.Curve | cal.PowerLaw | cal.Costs] = [
        shipped.link_overhead,
        shipped.payload_overhead_s,
        shipped.stream_fixed_s,
        shipped.startup_fixed_s,
        shipped.construction,
        shipped.apply,
        shipped.drain,
        shipped.finalization,
        shipped.v_over_h,
    ]
    for figure in figures:
        assert figure.sources, figure
        assert set(figure.sources) <= used, figure
        assert figure.how
    for source in shipped.sources:
        assert (RESULTS / source.file).is_file(), source.file
    # Timings only from quiet runs; every run's byte counts.
    for figure in (shipped.construction, shipped.apply, shipped.drain, shipped.finalization):
        assert figure.kind == "measured"
        for name in figure.sources:
            assert cal.is_quiet(json.loads((RESULTS / name).read_text())), name
    assert set(shipped.v_over_h.sources) == {p.name for p in _refit_files()}
    # The apply costs come from the CPU-bound runs (a fast or unshaped link), the drain's from
    # the link-bound ones.
    for name in shipped.apply.sources:
        assert (json.loads((RESULTS / name).read_text())["link_mbit"] or 0) in (0, 1000)
    for name in shipped.drain.sources:
        assert json.loads((RESULTS / name).read_text())["link_mbit"] in (25, 50, 100)


def _leave_one_out(
    path: Path, link_mbit: float | None = None
) -> list[tuple[str, float, float, str]]:
    """(rate key, measured mean latency, projected latency, bound) of each rate of the run in
    `path`, projected with its own settings (H, change rates, link, nodes, chunk and bucket
    sizes, the payload regions its tensor layout gives, its machine's CPUs) and a calibration
    fitted from the OTHER result files; `link_mbit` replaces the run's link (0: unshaped)."""
    result = json.loads(path.read_text())
    fitted = cal.fit(RESULTS, exclude=[path.name])
    assert path.name not in {s.file for s in fitted.sources}
    if link_mbit is not None:
        result = dict(result, link_mbit=link_mbit)
    return [
        (key, float(result["rates"][key]["latency_s"]), b.latency_s, b.bound)
        for key, b in project_bench(result, fitted).items()
    ]


def test_leave_one_out_projects_every_quiet_run_within_25_percent(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each refit run's own settings, projected with a calibration fitted from the OTHER runs,
    against its measured mean latency: every rate of every quiet run within 25%, among them
    all of today's runs (single node with 8 MiB to 256/512 MiB sizes; 3 nodes and the quick
    2-node H at 100 Mbit/s, 1 Gbit/s and unshaped, where the 2 CPUs bound them).

    Runs measured on a busy machine (1-minute load above 1.5 x the CPUs before the run, or not
    recorded) measure the neighbour as much as KubeRefit: they are projected and printed but not
    held to the bound, as they are not used to fit timings either."""
    rows, misses, held = [], [], set()
    for path in _refit_files():
        result = json.loads(path.read_text())
        quiet = cal.is_quiet(result)
        load, _ = cal.load_of(result)
        tag = "busy machine" if load is not None else "load before the run not recorded"
        link = f"{result.get('link_mbit') or 0:g} Mbit/s" if result.get("link_mbit") else "unshaped"
        for key, measured, projected, bound in _leave_one_out(path):
            error = projected / measured - 1
            rows.append(
                f"{path.name} {result['nodes']} node(s) {link} {key}: measured {measured:.3f} s, "
                f"projected {projected:.3f} s ({error:+.1%}, {bound}-bound)"
                + ("" if quiet else f" [{tag}: not held to the bound]")
            )
            if quiet:
                held.add(path.name)
                if abs(error) > TOLERANCE:
                    misses.append(rows[-1])
    with capsys.disabled():
        print("\n" + "\n".join(rows))
    assert not misses, misses
    assert {p.name for p in _refit_files() if p.name.startswith(TODAY)} <= held
    assert len([p for p in held if p.startswith(TODAY)]) == 11


@pytest.mark.parametrize(
    ("name", "wrong_mbit"),
    [
        ("refit-20261206T024833Z.json", 1000.0),  # 3 nodes at 100 Mbit/s, projected at 1 Gbit/s
        ("refit-20261206T023738Z.json", 0.0),  # quick at 100 Mbit/s, projected unshaped
        ("refit-20261206T025129Z.json", 100.0),  # 3 nodes unshaped, projected at 100 Mbit/s
        ("refit-20261206T023834Z.json", 100.0),  # quick unshaped, projected at 100 Mbit/s
    ],
)
def test_leave_one_out_misses_with_a_wrong_link(name: str, wrong_mbit: float) -> None:
    """The bound above is not loose: the same projection with a wrong link rate misses the
    measured latency by more than it at the higher change rates (at 1% the 2 CPUs bound these
    runs nearly as much as a 100 Mbit/s link does)."""
    right = _leave_one_out(RESULTS / name)
    wrong = _leave_one_out(RESULTS / name, link_mbit=wrong_mbit)
    for key, measured, projected, _ in right:
        assert abs(projected / measured - 1) <= TOLERANCE, (name, key)
    for key, measured, projected, _ in wrong:
        if key in ("0.03", "0.05"):
            assert abs(projected / measured - 1) > TOLERANCE, (name, key, wrong_mbit)


def test_project_for_bench_is_one_rate_of_project_bench() -> None:
    result = json.loads((RESULTS / "refit-20261206T024833Z.json").read_text())
    shipped = cal.load()
    latency = project_for_bench(result, shipped, "0.03")
    assert latency == project_bench(result, shipped)["0.03"].latency_s
    assert latency == pytest.approx(result["rates"]["0.03"]["latency_s"], rel=TOLERANCE)
    with pytest.raises(ValueError, match="name one"):
        project_for_bench(result, shipped)
    single = dict(result, rates={"0.03": result["rates"]["0.03"]})
    assert project_for_bench(single, shipped) == latency


def test_an_unshaped_bench_run_is_bounded_by_the_cpu_stages() -> None:
    """A result without a link rate (the unshaped case) projects without a link term."""
    result = json.loads((RESULTS / "refit-20261206T024833Z.json").read_text())
    unshaped = dict(result, link_mbit=None)
    b = project_bench(unshaped, cal.load())["0.03"]
    assert b.bound == "shared CPU"  # producer, relays and receivers on the bench's 2 CPUs
    assert b.latency_s < project_bench(result, cal.load())["0.03"].latency_s


def test_a_transport_result_calibrates_the_relay_hop(tmp_path: Path) -> None:
    for path in _refit_files()[-3:]:
        shutil.copy(path, tmp_path)
    without = cal.fit(tmp_path)
    assert without.relay_hop is None
    assert without.relay_hop_payload_s is None
    assert without.construction_isolated is None  # no codec result here
    (tmp_path / "transport-20261202T000000Z.json").write_text(
        json.dumps(
            {
                "benchmark": "transport",
                "nodes": 1,
                "unique_gb_s": 0.45,
                "hop_gb_s": 0.45,
                "bare_gb_s": 0.9,
                "per_payload_ms": 0.54,
            }
        )
    )
    (tmp_path / "refit-20261202T000001Z.json").write_text("{not json")
    fitted = cal.fit(tmp_path)
    assert fitted.relay_hop is not None
    assert fitted.relay_hop.value == pytest.approx(0.45e9)
    assert fitted.relay_hop_payload_s is not None
    assert fitted.relay_hop_payload_s.value == pytest.approx(0.54e-3)
    assert fitted.relay_hop.sources == ["transport-20261202T000000Z.json"]
    by_file = {s.file: s for s in fitted.sources}
    assert by_file["transport-20261202T000000Z.json"].used
    assert not by_file["refit-20261202T000001Z.json"].used
    assert by_file["refit-20261202T000001Z.json"].why == "unreadable (not JSON)"
    constants, _ = fitted.constants(0.03, colocated=True)
    assert constants.hop_bytes_s == pytest.approx(0.45e9)
    assert constants.hop_mac_bytes_s is None
    # A later MAC-only run gives the MAC-only hop and leaves the encrypted one as it was.
    (tmp_path / "transport-20261202T000002Z.json").write_text(
        json.dumps(
            {
                "benchmark": "transport",
                "links": "mac",
                "nodes": 1,
                "unique_gb_s": 1.2,
                "hop_gb_s": 1.2,
                "per_payload_ms": 0.3,
            }
        )
    )
    both = cal.fit(tmp_path)
    assert both.relay_hop == fitted.relay_hop
    assert both.relay_hop_payload_s == fitted.relay_hop_payload_s
    assert both.relay_hop_mac is not None
    assert both.relay_hop_mac.value == pytest.approx(1.2e9)
    assert both.relay_hop_mac.sources == ["transport-20261202T000002Z.json"]
    constants, _ = both.constants(0.03, colocated=True)
    assert constants.hop_mac_bytes_s == pytest.approx(1.2e9)
    cal.write(fitted, tmp_path / "cal.json")
    assert cal.load(tmp_path / "cal.json") == fitted


def test_runs_of_mac_only_links_are_fitted_with_the_mac_only_hop(tmp_path: Path) -> None:
    """The fit charges a refit run's relay-to-relay hops and receives at the hop of the links
    it used: the same runs marked `--links mac`, with a MAC-only hop measured 4x faster, leave
    less time to the relay and more to the apply they share the span with."""
    for path in RESULTS.glob("*.json"):
        if path.name.startswith(("refit-2", "transport-2", "codec-2")):
            shutil.copy(path, tmp_path)
    curve = cal.fit(tmp_path)
    assert curve.relay_hop is not None
    for path in tmp_path.glob("refit-2*.json"):
        data = json.loads(path.read_text())
        data.setdefault("settings", {})["links"] = "mac"
        path.write_text(json.dumps(data))
    hop_gb_s = 4 * curve.relay_hop.value / 1e9
    (tmp_path / "transport-20991231T000000Z.json").write_text(
        json.dumps({"benchmark": "transport", "links": "mac", "nodes": 1, "hop_gb_s": hop_gb_s})
    )
    mac = cal.fit(tmp_path)
    assert mac.relay_hop == curve.relay_hop  # the root's receive: still CurveZMQ
    assert mac.relay_hop_mac is not None
    assert mac.relay_hop_mac.value == pytest.approx(hop_gb_s * 1e9)

    def apply_s(c: cal.Calibration) -> float:  # one GB's apply at 3% of elements changed
        return c.apply.s_per_byte * 1e9 + c.apply.s_per_changed * 0.03 * 1e9 / 2

    assert apply_s(mac) > 1.05 * apply_s(curve), (mac.apply, curve.apply)


def test_without_quiet_or_any_refit_results_it_says_so(tmp_path: Path) -> None:
    with pytest.raises(cal.CalibrationError, match="no refit"):
        cal.fit(tmp_path)
    busy = SUPERSEDED / "refit-20261130T201034Z.json"  # measured beside a busy neighbour
    shutil.copy(busy, tmp_path)
    with pytest.raises(cal.CalibrationError, match="quiet"):
        cal.fit(tmp_path)
    with pytest.raises(cal.CalibrationError, match="not a plan calibration"):
        cal.load(busy)


def test_curves_interpolate_and_flag_extrapolation() -> None:
    curve = cal.Curve(unit="B/s", points=[(0.01, 10.0), (0.05, 2.0)], how="test")
    value, extrapolated = curve.at(0.03)
    assert value == pytest.approx(6.0)
    assert not extrapolated
    assert curve.at(0.001) == (10.0, True)
    assert curve.at(0.2) == (2.0, True)
    law = cal.PowerLaw(coefficient=0.4, exponent=0.8, points=[(0.01, 0.0), (0.05, 0.0)], how="t")
    value, extrapolated = law.at(0.03)
    assert value == pytest.approx(0.4 * 0.03**0.8)
    assert not extrapolated
    assert law.at(0.5)[1]
    assert law.at(1.0)[0] <= 1.0


def test_bench_regions_are_the_payloads_the_runs_sent() -> None:
    """The payload regions rebuilt from a run's tensor layout and sizes give the payload count
    each of its transitions recorded, and cover H: the calibration's runs and the A/B of large
    tensors whole and in parts (`bench/results/parts`)."""
    for path in [*_refit_files(), *sorted((RESULTS / "parts").glob("refit-2*.json"))]:
        result = json.loads(path.read_text())
        for _, rate, row in cal.rate_rows(result):
            d = cal.bench_deployment(result, rate)
            assert d.regions is not None, path.name
            assert sum(d.regions) == result["checkpoint_bytes"]
            assert d.shared_cpus == result["machine"]["cpus"]
            for run in row.get("runs") or [row]:
                if "payloads" in run:
                    assert len(d.regions) == run["payloads"], (path.name, d.regions)


def test_nnls_keeps_costs_non_negative() -> None:
    rows = [[1.0, x] for x in (1.0, 2.0, 3.0, 4.0)]
    assert cal.nnls(rows, [3.0, 5.0, 7.0, 9.0], [1.0] * 4) == pytest.approx([1.0, 2.0])
    # A negative intercept is not a cost: it is dropped and the slope refitted.
    fitted = cal.nnls(rows, [0.0, 2.0, 4.0, 6.0], [1.0] * 4)
    assert fitted[0] == 0.0
    assert fitted[1] == pytest.approx(20 / 15)
    assert cal.nnls(rows, [-1.0] * 4, [1.0] * 4) == [0.0, 0.0]


def test_costs_per_byte_and_changed_element() -> None:
    c = cal.Costs(
        s_per_byte=2e-10, s_per_changed=1e-8, rates=(0.01, 0.05), points=3, rms_error=0, how="t"
    )
    assert c.s_per_h_byte(0.03) == pytest.approx(2e-10 + 1e-8 * 0.03 / 2)  # BF16 elements
    assert c.bytes_s(0.03) == pytest.approx(1 / (2e-10 + 1.5e-10))
    assert c.bytes_s(0.03, element_bytes=4) > c.bytes_s(0.03)
    assert not c.extrapolated(0.03)
    assert c.extrapolated(0.2)
    free = cal.Costs(rates=(0.01, 0.05), points=0, rms_error=0, how="t")
    assert free.bytes_s(0.03) == float("inf")


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    """Set (or, for `_DELETE`, remove) the field at a dotted path, e.g. "rates.0.03.drain_s"."""
    *parents, last = _split(path)
    for key in parents:
        data = data[key]
    if value is _DELETE:
        del data[last]
    else:
        data[last] = value


def _split(path: str) -> list[str]:
    """Dotted path to keys; a rate key such as 0.03 stays whole."""
    parts = path.split(".")
    out: list[str] = []
    for part in parts:
        if out and out[-1] in ("0", "1") and part.isdigit():
            out[-1] += "." + part
        else:
            out.append(part)
    return out


_DELETE = object()


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("checkpoint_bytes", _DELETE, "checkpoint_bytes is missing"),
        ("checkpoint_bytes", "594MiB", 'checkpoint_bytes is not a number ("594MiB")'),
        ("checkpoint_bytes", 10**400, "checkpoint_bytes is 1000000000000000000000000000000"),
        ("nodes", None, "nodes is missing"),
        ("nodes", 2.5, "nodes is 2.5, not a whole number"),
        ("link_mbit", "fast", 'link_mbit is not a number ("fast")'),
        ("machine", [2], "machine is not an object"),
        ("machine.load_avg_before", "low", "machine.load_avg_before is not a list of numbers"),
        ("rates", {}, "rates is empty"),
        ("rates.0.03", 7, "rates.0.03 is not an object"),
        ("rates.0.03.v_payload_bytes", _DELETE, "rates.0.03.v_payload_bytes is missing"),
        ("rates.0.03.v_payload_bytes", 0, "rates.0.03.v_payload_bytes is 0, not positive"),
        ("rates.0.03.v_payload_bytes", float("nan"), "v_payload_bytes is nan, not a finite"),
        ("rates.0.03.finalization_s", _DELETE, "rates.0.03.finalization_s is missing"),
        ("rates.0.03.drain_s", "slow", 'rates.0.03.drain_s is not a number ("slow")'),
        ("rates.0.03.changed_fraction", 3, "rates.0.03.changed_fraction is 3, above 1"),
        ("rates.0.03.runs", "many", "rates.0.03.runs is not a list"),
        ("full_reference.wire_bytes", _DELETE, "full_reference.wire_bytes is missing"),
        ("full_reference.link_bytes", "1 GB", "full_reference.link_bytes is not a number"),
        ("settings.seed", -1, "settings.seed is -1, not >= 0"),
        ("sizes.chunk_bytes", "auto", 'sizes.chunk_bytes is not a number ("auto")'),
    ],
)
def test_a_refit_result_with_a_bad_field_is_skipped_and_named(
    tmp_path: Path, field: str, value: Any, says: str
) -> None:
    """A readable refit result missing a field the fit reads, or holding something other than a
    usable number there, is skipped (not a KeyError / TypeError out of `fit`), and the
    calibration's sources say which field."""
    good = _refit_files()[-3:]
    for path in good:
        shutil.copy(path, tmp_path)
    clean = cal.fit(tmp_path)
    data = json.loads(good[0].read_text())  # quiet, 100 Mbit/s: every field is read
    assert cal.is_quiet(data)
    _set(data, field, value)
    crafted = "refit-20261202T060000Z.json"
    (tmp_path / crafted).write_text(json.dumps(data))
    fitted = cal.fit(tmp_path)
    by_file = {s.file: s for s in fitted.sources}
    assert not by_file[crafted].used
    assert by_file[crafted].why.startswith("skipped: "), by_file[crafted].why
    assert says in by_file[crafted].why, by_file[crafted].why
    assert _fitted(fitted) == _fitted(clean) | {"sources": _fitted(fitted)["sources"]}
    assert [s for s in fitted.sources if s.file != crafted] == clean.sources


def test_unreadable_or_foreign_results_are_skipped_with_the_reason(tmp_path: Path) -> None:
    for path in _refit_files()[-3:]:
        shutil.copy(path, tmp_path)
    (tmp_path / "refit-20261202T060000Z.json").write_text("[1, 2]")
    (tmp_path / "refit-20261202T060001Z.json").write_text(json.dumps({"benchmark": "codec"}))
    (tmp_path / "transport-20261202T000000Z.json").write_text(
        json.dumps({"benchmark": "transport", "nodes": 1, "hop_gb_s": "fast"})
    )
    (tmp_path / "codec-20261202T000000Z.json").write_text(
        json.dumps({"quick": False, "checkpoint": {"0.03": {"encode_gbps_2t": "quick"}}})
    )
    fitted = cal.fit(tmp_path)
    why = {s.file: s.why for s in fitted.sources if not s.used}
    assert why == {
        "refit-20261202T060000Z.json": "unreadable (not a JSON object)",
        "refit-20261202T060001Z.json": 'not a refit result (benchmark "codec")',
        "transport-20261202T000000Z.json": 'skipped: hop_gb_s is not a number ("fast")',
        "codec-20261202T000000Z.json": (
            'skipped: checkpoint.0.03.encode_gbps_2t is not a number ("quick")'
        ),
    }
    assert fitted.relay_hop is None
    assert fitted.construction_isolated is None


def test_a_wan_emulated_run_gives_its_byte_counts_only(tmp_path: Path) -> None:
    """A `bench refit --delay-ms/--loss/--cut-link-s` run measured a link the plan's model does
    not have (a round trip, retransmits): its V_payload counts, its timings and link bytes not."""
    good = _refit_files()[-3:]
    for path in good:
        shutil.copy(path, tmp_path)
    clean = cal.fit(tmp_path)
    data = json.loads(good[0].read_text())  # quiet, 100 Mbit/s: its timings would be used
    assert cal.is_quiet(data)
    data["settings"]["delay_ms"] = 50.0
    crafted = "refit-20261202T060000Z.json"
    (tmp_path / crafted).write_text(json.dumps(data))
    fitted = cal.fit(tmp_path)
    by_file = {s.file: s for s in fitted.sources}
    assert by_file[crafted].why.startswith("a WAN-emulated run"), by_file[crafted].why
    # The same timings as without it (a copy of a used run's V_payload moves only the fit's
    # byte-count curve, which it shares with that run).
    assert fitted.finalization == clean.finalization
    assert fitted.construction == clean.construction


def test_a_run_into_real_engines_gives_its_byte_counts_only(tmp_path: Path) -> None:
    """A `bench refit --engine vllm` run applied through vLLM's loaders, not the fitted torch
    receivers: its V_payload counts, its timings not."""
    good = _refit_files()[-3:]
    for path in good:
        shutil.copy(path, tmp_path)
    clean = cal.fit(tmp_path)
    data = json.loads(good[0].read_text())
    assert cal.is_quiet(data)
    data["engine"] = "vllm"
    crafted = "refit-20261202T060000Z.json"
    (tmp_path / crafted).write_text(json.dumps(data))
    fitted = cal.fit(tmp_path)
    by_file = {s.file: s for s in fitted.sources}
    assert by_file[crafted].used
    assert by_file[crafted].why.startswith("applied by vllm engines"), by_file[crafted].why
    assert fitted.finalization == clean.finalization
    assert fitted.construction == clean.construction
