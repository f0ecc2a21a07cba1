"""The figures the codec and transport benches add to a fit: the construction throughput of
one producer alone (`codec-<UTC>.json`, the latest batch of full runs) and one relay hop's and
S3's throughput (`transport-<UTC>.json`, the latest result with them). Each file read is
recorded as a `Source`, used or skipped with the reason."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from refit_tools.plan.calibration.models import Curve, Scalar, Source
from refit_tools.plan.calibration.results import (
    FieldError,
    check_codec,
    check_transport,
    read_result,
    stamp_time,
    stamped,
)

#: Codec results within this many seconds of the latest full one form its batch.
CODEC_BATCH_S = 3600


def codec_construction(results_dir: Path, skip: set[str], sources: list[Source]) -> Curve | None:
    """Construction throughput of one producer alone (2 compare threads), from the latest batch
    of full codec results (median per change rate)."""
    full = []
    for path in stamped(results_dir, "codec"):
        if path.name in skip:
            continue
        data = read_result(path)
        if data is None or data.get("quick") or "checkpoint" not in data:
            continue
        if _usable(path, data, check_codec, "codec", sources):
            full.append((path, data))
    if not full:
        return None
    newest = stamp_time(full[-1][0])
    batch = [(p, d) for p, d in full if (newest - stamp_time(p)).total_seconds() <= CODEC_BATCH_S]
    per_rate: dict[float, list[float]] = {}
    for path, data in batch:
        settings = data.get("checkpoint_settings") or {}
        sources.append(
            Source(
                file=path.name,
                benchmark="codec",
                started=stamp_time(path).isoformat(timespec="seconds"),
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


def transport_figures(results_dir: Path, skip: set[str], sources: list[Source]) -> dict[str, Any]:
    """Relay hop and S3 figures from the latest transport result, if any (the encrypted hop:
    a result of CurveZMQ links, or from before results named their links), and the MAC-only
    hop from the latest 1-node result of MAC-only links."""
    files = [p for p in stamped(results_dir, "transport") if p.name not in skip]
    out = _mac_hop(files, sources)
    for path in reversed(files):
        data = read_result(path)
        if data is None or data.get("benchmark", "transport") != "transport":
            continue
        # The encrypted hop comes from CurveZMQ runs only (`_mac_hop` takes the other kind).
        encrypted = data.get("links", "curve") == "curve"
        hop_keys = ("hop_gb_s",) if encrypted else ()
        if not any(data.get(k) for k in (*hop_keys, "upload_gb_s", "download_gb_s")):
            continue  # a multi-node run: its figures are not one hop's
        if not _usable(path, data, check_transport, "transport", sources):
            continue
        found: dict[str, Any] = {}
        hop_gbs = data.get("hop_gb_s") if encrypted else None
        per_payload_ms = data.get("per_payload_ms") if encrypted else None
        if hop_gbs:
            found["hop"] = Scalar(
                value=float(hop_gbs) * 1e9,
                unit="B/s",
                sources=[path.name],
                how="transport bench: one encrypted (CurveZMQ) relay hop's throughput "
                "(1 node, loopback)",
            )
        if per_payload_ms is not None:
            found["hop_payload"] = Scalar(
                value=float(per_payload_ms) / 1e3,
                unit="s per payload per hop",
                sources=[path.name],
                how="transport bench: time per 1 KiB payload of a stream (window 4)",
            )
        for key, name in (("upload_gb_s", "s3_upload"), ("download_gb_s", "s3_download")):
            if data.get(key):
                found[name] = Scalar(
                    value=float(data[key]) * 1e9,
                    unit="B/s",
                    sources=[path.name],
                    how=f"transport bench: S3 {key.split('_')[0]} throughput of one client",
                )
        why = "latest transport result" if found else "no relay hop or S3 figures in it"
        sources.append(_transport_source(path, data, bool(found), why))
        if found:
            return out | found
    return out


def _mac_hop(files: list[Path], sources: list[Source]) -> dict[str, Any]:
    """`hop_mac` from the latest 1-node transport result of MAC-only links, if any."""
    for path in reversed(files):
        data = read_result(path)
        if data is None or data.get("links") != "mac" or not data.get("hop_gb_s"):
            continue
        if not _usable(path, data, check_transport, "transport", sources):
            continue
        why = "latest 1-node transport result of MAC-only links"
        sources.append(_transport_source(path, data, True, why))
        return {
            "hop_mac": Scalar(
                value=float(data["hop_gb_s"]) * 1e9,
                unit="B/s",
                sources=[path.name],
                how="transport bench: one MAC-only relay hop's throughput (1 node, loopback)",
            )
        }
    return {}


def _transport_source(path: Path, data: Mapping[str, Any], used: bool, why: str) -> Source:
    """How a transport result file was used (the calibration's `sources`)."""
    return Source(
        file=path.name,
        benchmark="transport",
        started=data.get("started") or stamp_time(path).isoformat(timespec="seconds"),
        machine=data.get("machine") or {},
        used=used,
        why=why,
    )


def _usable(
    path: Path,
    data: Mapping[str, Any],
    check: Callable[[Mapping[str, Any]], None],
    benchmark: str,
    sources: list[Source],
) -> bool:
    """Whether `check` passes on the result; one it fails is recorded as a skipped `Source`
    naming the field."""
    try:
        check(data)
    except FieldError as exc:
        why = f"skipped: {exc}"
        sources.append(Source(file=path.name, benchmark=benchmark, used=False, why=why))
        return False
    return True
