"""The JSON files `kuberefit plan` reads (a safetensors index, a Hugging Face config.json, a
calibration, bench results), read with bounds so that a hostile or broken file is refused in
one line instead of exhausting the process:

- at most `MAX_INPUT_FILE_BYTES` (64 MiB; the safetensors index of a 1T-parameter model is a
  few MB), read as at most that plus one byte;
- arrays and objects nested at most `MAX_INPUT_DEPTH` (64) levels and at most
  `MAX_INPUT_BRACKETS` brackets, checked before parsing (Python's parser recurses per level);
- numbers written in at most `MAX_INPUT_NUMBER_CHARS` (1,000) characters and, where the
  reader asks (a calibration, whose every number is used), finite (no NaN, Infinity or 1e999);
  the readers then check the range of each field they use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from refit_protocol.kit.config_files import (
    ConfigFileError,
    json_loads_bounded,
    json_shape_problem,
    read_limited,
)

#: The largest plan input file read, in bytes.
MAX_INPUT_FILE_BYTES = 64 << 20
#: The deepest nesting of arrays and objects in a plan input file.
MAX_INPUT_DEPTH = 64
#: The most brackets ([ ] { }) outside strings in a plan input file: a million arrays and
#: objects (an index has a few, a calibration or a bench result some hundreds).
MAX_INPUT_BRACKETS = 2_000_000
#: The longest number, as written, in a plan input file (characters).
MAX_INPUT_NUMBER_CHARS = 1000


class InputFileError(ValueError):
    """A file beyond the bounds, not text, or holding a number too long or not finite (the
    message, one line without the path, says which)."""


def read_json(path: Path, *, finite: bool = True) -> Any:
    """The JSON value in `path`, within the bounds (`finite=False` admits NaN, Infinity and
    1e999, for a reader that names the field holding one). Raises OSError (unreadable),
    `InputFileError` (beyond the bounds, not text, a bad number) or `json.JSONDecodeError`
    (not JSON)."""
    try:
        raw = read_limited(path, MAX_INPUT_FILE_BYTES)
    except ConfigFileError:
        raise InputFileError(f"larger than {MAX_INPUT_FILE_BYTES >> 20}MiB") from None
    try:
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
    except (UnicodeDecodeError, LookupError):
        raise InputFileError("not JSON (not text)") from None
    problem = json_shape_problem(text, max_depth=MAX_INPUT_DEPTH, max_brackets=MAX_INPUT_BRACKETS)
    if problem is not None:
        raise InputFileError(problem)
    try:
        return json_loads_bounded(text, MAX_INPUT_NUMBER_CHARS, finite=finite)
    except json.JSONDecodeError:
        raise
    except ValueError as exc:  # a number too long or not finite
        raise InputFileError(str(exc)) from None


def quote(value: Any) -> str:
    """A value read from an input file as a one-line message shows it: JSON, at most 40
    characters."""
    text = json.dumps(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
