"""The bench result files a fit reads: finding them by benchmark and UTC stamp, reading each
within bounds, and checking every field the fit takes from a refit, codec or transport result.
A file that fails a check is skipped, and the `FieldError` names the field, so one broken
result never stops a fit nor passes it a number it cannot use."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from refit_tools.plan.files import InputFileError, quote, read_json

_STAMP = re.compile(r"-(\d{8}T\d{6}Z)\.json$")
#: A refit result's rate row splits its window when it has these (and finalization_s).
WINDOW = ("startup_s", "transport_span_s", "drain_s")


def stamped(results_dir: Path, benchmark: str) -> list[Path]:
    """`<benchmark>-<UTC stamp>.json`, oldest first (the `-latest` copies and other benches'
    groupings such as `refit-links-<UTC>.json` are skipped)."""
    return sorted(p for p in results_dir.glob(f"{benchmark}-2*.json") if _STAMP.search(p.name))


def stamp_time(path: Path) -> datetime:
    match = _STAMP.search(path.name)
    assert match is not None
    return datetime.strptime(match.group(1), "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)


def read_result(path: Path) -> dict[str, Any] | None:
    return read_result_why(path)[0]


def read_result_why(path: Path) -> tuple[dict[str, Any] | None, str]:
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
class FieldError(ValueError):
    """A field of a result file that the fit cannot use (the message names it)."""


def _number(
    value: Any,
    where: str,
    *,
    positive: bool = True,
    integer: bool = False,
    optional: bool = False,
    at_most: float | None = None,
) -> None:
    """Raise `FieldError` unless `value` is a finite number (positive, or non-negative), whole
    when `integer`; None passes when `optional`."""
    if value is None:
        if optional:
            return
        raise FieldError(f"{where} is missing")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FieldError(f"{where} is not a number ({quote(value)})")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer beyond a float's range
        finite = False
    if not finite:
        raise FieldError(f"{where} is {quote(value)}, not a finite number")
    if value < 0 or (positive and value == 0):
        raise FieldError(f"{where} is {quote(value)}, not {'positive' if positive else '>= 0'}")
    if integer and value != int(value):
        raise FieldError(f"{where} is {quote(value)}, not a whole number")
    if at_most is not None and value > at_most:
        raise FieldError(f"{where} is {quote(value)}, above {at_most:g}")


def _object(value: Any, where: str, *, optional: bool = True) -> dict[str, Any]:
    """`value` as an object ({} for None when `optional`), else `FieldError`."""
    if value is None and optional:
        return {}
    if not isinstance(value, dict):
        raise FieldError(f"{where} is {'missing' if value is None else 'not an object'}")
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
        raise FieldError(f"rates key {quote(key)} is not a change rate") from None
    _number(rate, f"rates key {quote(key)}", at_most=1.0)


def check_refit(data: Mapping[str, Any]) -> None:
    """Raise `FieldError` naming the first field `fit` reads from a refit result that is missing or
    not a number it can use."""
    _number(data.get("checkpoint_bytes"), "checkpoint_bytes", integer=True)
    _number(data.get("nodes"), "nodes", integer=True)
    _number(data.get("link_mbit"), "link_mbit", positive=False, optional=True)
    machine = _object(data.get("machine"), "machine")
    _number(machine.get("cpus"), "machine.cpus", integer=True, optional=True)
    load = machine.get("load_avg_before")
    if load is not None:
        if not isinstance(load, list) or not load:
            raise FieldError(f"machine.load_avg_before is not a list of numbers ({quote(load)})")
        _number(load[0], "machine.load_avg_before[0]", positive=False)
    rates = _object(data.get("rates"), "rates", optional=False)
    if not rates:
        raise FieldError("rates is empty")
    for key, raw in rates.items():
        row = _object(raw, f"rates.{key}", optional=False)
        _rate_key(key, row)
        _number(row.get("v_payload_bytes"), f"rates.{key}.v_payload_bytes")
        if all(k in row for k in WINDOW):
            for k in (*WINDOW, "finalization_s"):
                _number(row.get(k), f"rates.{key}.{k}")
        runs = row.get("runs")
        if runs is not None:
            if not isinstance(runs, list):
                raise FieldError(f"rates.{key}.runs is not a list")
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


def check_codec(data: Mapping[str, Any]) -> None:
    """Raise `FieldError` naming the first field `codec_construction` reads that it cannot use."""
    settings = _object(data.get("checkpoint_settings"), "checkpoint_settings")
    _number(settings.get("cpus"), "checkpoint_settings.cpus", integer=True, optional=True)
    rows = _object(data.get("checkpoint"), "checkpoint", optional=False)
    for key, raw in rows.items():
        row = _object(raw, f"checkpoint.{key}", optional=False)
        try:
            rate = float(key)
        except ValueError:
            raise FieldError(f"checkpoint key {quote(key)} is not a change rate") from None
        _number(rate, f"checkpoint key {quote(key)}", at_most=1.0)
        for k in ("encode_gbps_2t", "encode_gbps_1t"):
            _number(row.get(k), f"checkpoint.{key}.{k}", positive=False, optional=True)


def check_transport(data: Mapping[str, Any]) -> None:
    """Raise `FieldError` naming the first figure `transport_figures` reads that it cannot use."""
    for key in ("hop_gb_s", "upload_gb_s", "download_gb_s", "per_payload_ms"):
        _number(data.get(key), key, positive=False, optional=True)
    _object(data.get("machine"), "machine")
