"""What `kuberefit bench refit` reports: the definitions every result file carries, the means
over repeats, the result files and the terminal table (the run itself: `refit.py`)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
from datetime import datetime
from pathlib import Path
from typing import Any

from refit_tools.bench.plot import link_label, link_of, refit_svg
from refit_tools.bench.refit_workload import MIB


def default_results_dir() -> Path:
    """bench/results of this source checkout, else of the current directory."""
    checkout = Path(__file__).resolve().parents[3]
    return (checkout if (checkout / "bench").is_dir() else Path.cwd()) / "bench" / "results"


#: Definitions written into every result file, so a number never travels without its meaning.
DEFINITIONS = {
    "latency_s": "timed window t1 - t0: t0 = producer begins delta construction (first start "
    "of the version), t1 = producer finished its baseline update after the joint commit "
    "(paper Appendix C); excludes change injection, verification and gate reopening",
    "v_payload_bytes": "wire bytes of the committed attempt's payloads (V_payload)",
    "full_reference_s": "transport-only full-checkpoint reference: H bytes of overwrite payloads "
    "through the same producer transport, link and relay tree, first send until the last "
    "node's relay flush; measured in this run",
    "speedup": "full_reference_s / latency_s",
    "transport_share": "union of the payloads' transport intervals (send-window admission to "
    "the root relay's queueing ACK) clipped to [t0, t1], over t1 - t0 (paper §8.7)",
    "link_busy_share": "bytes the tbf qdisc sent during the transition / link rate, over latency_s "
    "(null on the unshaped veth: it has no rate)",
    "link_limit": "H / V_payload: the speedup if the refit and the reference were both link-bound",
    "speedup_over_limit": "speedup / link_limit: how close the run is to what the link allows",
    "finalization_s": "every receiver's completion ACK reached the coordinator .. t1 "
    "(compare-and-set commit + baseline update)",
    "startup_s": "t0 .. the first payload submitted to the transport",
    "drain_s": "the last root ACK .. every receiver's completion ACK",
    "median_payload_s": "the median payload's wire size x transport_span_s / the bytes of every "
    "payload: how long the median payload takes at the stream's pace",
    "startup_over_payload": "startup_s / median_payload_s",
    "drain_over_payload": "drain_s / median_payload_s",
    "apply_s": "the slowest receiver's time in its applier's calls during the transition (with "
    "--engine vllm: its refit_apply calls into the vLLM server), from its flush ACK",
    "peak_rss": "per node process tree (receiver; with --engine vllm also the vLLM server and "
    "its engine processes), sampled every 50 ms while the transition runs: the largest peak "
    "of any node (bytes) and the largest rise above the tree's size at the transition's start "
    "(extra_bytes)",
    "dense_reload_s": "--engine vllm: a dense in-place load of the same version from its local "
    "safetensors directory, every tensor through the model's own load_weights() (what a "
    "colocated user does), on the reference server",
    "reference_cold_start_s": "--engine vllm: the reference server's cold start on the "
    "version's directory, process start until /health answers",
    "dense_reload_over_latency": "dense_reload_s / latency_s (>1: the refit over the link "
    "beats reloading the version from local disk)",
}


def summarize(
    runs: list[dict[str, Any]], reference_s: float, checkpoint_bytes: int
) -> dict[str, Any]:
    """Means over the repeats; speedup from the mean latency; every run kept."""
    keys = (
        *("latency_s", "v_payload_bytes", "transport_share", "finalization_s"),
        *("transport_union_s", "link_bytes", "changed_fraction"),
        *("startup_s", "transport_span_s", "drain_s"),
    )
    out: dict[str, Any] = {k: statistics.fmean(float(r[k]) for r in runs) for k in keys}
    for k in ("median_payload_s", "startup_over_payload", "drain_over_payload"):
        got = [float(r[k]) for r in runs if r.get(k) is not None]
        out[k] = statistics.fmean(got) if len(got) == len(runs) else None
    busy = [r["link_busy_share"] for r in runs]
    out["link_busy_share"] = None if None in busy else statistics.fmean(busy)
    out["v_payload_bytes"] = round(out["v_payload_bytes"])
    out["link_bytes"] = round(out["link_bytes"])
    out["full_reference_s"] = reference_s
    out["speedup"] = reference_s / out["latency_s"]
    out["link_limit"] = checkpoint_bytes / out["v_payload_bytes"]
    out["speedup_over_limit"] = out["speedup"] / out["link_limit"]
    out["bit_exact"] = all(r["bit_exact"] for r in runs)
    out["peak_rss"] = {
        kind: {k: max(r["peak_rss"][kind][k] for r in runs) for k in ("bytes", "extra_bytes")}
        for kind in runs[0]["peak_rss"]
    }
    if "dense_reload_s" in runs[0]:
        for k in ("dense_reload_s", "reference_cold_start_s"):
            out[k] = statistics.fmean(float(r[k]) for r in runs)
        out["dense_reload_over_latency"] = out["dense_reload_s"] / out["latency_s"]
    out["runs"] = runs
    return out


def write_results(result: dict[str, Any], directory: Path, when: datetime) -> list[Path]:
    """`refit-<UTC time>.{json,svg}` plus `refit-latest.{json,svg}` copies."""
    directory.mkdir(parents=True, exist_ok=True)
    stamp = when.strftime("%Y%m%dT%H%M%SZ")
    body = json.dumps(result, indent=2, sort_keys=True) + "\n"
    svg = refit_svg(result)
    paths = []
    for name, text in ((f"refit-{stamp}.json", body), (f"refit-{stamp}.svg", svg)):
        paths.append(directory / name)
        paths[-1].write_text(text)
    for src in list(paths):
        latest = directory / ("refit-latest" + src.suffix)
        tmp = latest.with_suffix(latest.suffix + ".tmp")
        shutil.copyfile(src, tmp)
        os.replace(tmp, latest)
        paths.append(latest)
    return paths


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def format_report(result: dict[str, Any]) -> str:
    """A table for the terminal."""
    ref = result["full_reference"]
    lines = [
        f"H = {result['checkpoint_bytes'] / MIB:.1f} MiB, {result['nodes']} nodes, link "
        f"{link_label(*link_of(result))}; full-checkpoint reference {ref['seconds']:.2f} s"
        + ("" if ref["nominal_s"] is None else f" (nominal {ref['nominal_s']:.2f} s)"),
        "",
        f"{'rate':>5} {'latency s':>10} {'V_payload MiB':>14} {'speedup':>8} "
        f"{'limit':>7} {'transport':>10} {'link busy':>10} {'final. s':>9} {'bit-exact':>9}",
    ]
    for key, r in result["rates"].items():
        lines.append(
            f"{float(key):>5.0%} {r['latency_s']:>10.2f} {r['v_payload_bytes'] / MIB:>14.2f} "
            f"{r['speedup']:>7.1f}x {r['link_limit']:>6.1f}x {r['transport_share']:>10.0%} "
            f"{_share(r['link_busy_share']):>10} "
            f"{r['finalization_s']:>9.3f} {'yes' if r['bit_exact'] else 'NO':>9}"
        )
    for key, r in result["rates"].items():
        mem = ", ".join(
            f"{kind} {m['bytes'] / 1e9:.2f} GB (+{m['extra_bytes'] / 1e6:.0f} MB)"
            for kind, m in r["peak_rss"].items()
        )
        line = f"{float(key):>5.0%} peak memory per node: {mem}"
        if "dense_reload_s" in r:
            line += (
                f"; dense reload from local disk {r['dense_reload_s']:.2f} s "
                f"({r['dense_reload_over_latency']:.2f}x the refit), cold start "
                f"{r['reference_cold_start_s']:.1f} s; every node equal to a cold dense load"
            )
        lines.append(line)
    if result.get("files"):
        lines.append("results: " + ", ".join(result["files"]))
    return "\n".join(lines)
