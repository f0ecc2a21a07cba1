"""The calibration file: the one shipped with the package (`SHIPPED`), reading one with a
one-line reason when a file cannot be a calibration (`load`), and writing one atomically
(`write`). Kept apart from the fit: every plan reads a calibration, only --calibrate fits
one."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from refit_tools.plan.calibration.models import Calibration, CalibrationError
from refit_tools.plan.files import InputFileError, quote, read_json

#: The calibration fitted from this checkout's bench results (package data in plan/).
SHIPPED = Path(__file__).parents[1] / "calibration.json"


def default_results_dir() -> Path:
    """bench/results of this source checkout, else of the current directory."""
    checkout = Path(__file__).resolve().parents[4]
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
            f"format {quote(version)}, and this KubeRefit reads format 2: refit it with "
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
