"""Parsing and printing the plan's quantities: sizes, link rates and change rates.

Sizes reuse the settings files' parser (`refit_protocol.kit.config_files.parse_byte_size`: 60GB is
60 * 10^9 bytes, 1.5TiB is 1.5 * 2^40). Link rates are written as a network engineer would
("100Mbit", "10Gbit/s", "400Gbps", "1.25GB/s"): a lowercase b or "bit" means bits, an
uppercase B bytes; k/M/G/T are powers of 1000 and Ki/Mi/Gi/Ti powers of 1024. A bare number is
refused rather than guessed. Every error is a ValueError whose message says what to write.

Every input is bounded (and `kuberefit plan --help` says so), so that every projection is a
finite number: link rates from 1 kbit/s to 10 Tbit/s, throughputs from 1 kB/s to 100 TB/s,
sizes from 1 byte to 1 PB, producers and nodes from 1 to a million, change rates from 1e-9 to
1; a rate, size or count is written in at most 32 characters (checked before any parsing).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

from refit_protocol.sizes import MAX_SIZE_CHARS, parse_byte_size

#: Link rates (--cross-link, --intra-link), bytes per second: 1 kbit/s to 10 Tbit/s.
MIN_LINK_BYTES_S = 1e3 / 8
MAX_LINK_BYTES_S = 10e12 / 8
LINK_BOUNDS_TEXT = "1 kbit/s", "10 Tbit/s"
#: Throughputs (--construction-rate, --apply-rate, --relay-hop-rate), bytes per second:
#: 1 kB/s to 100 TB/s.
MIN_THROUGHPUT_BYTES_S = 1e3
MAX_THROUGHPUT_BYTES_S = 100e12
THROUGHPUT_BOUNDS_TEXT = "1 kB/s", "100 TB/s"
#: H and the chunk and bucket sizes: at most 1 PB (10^15 bytes; a 1T-parameter model in BF16
#: is 2 TB).
MAX_MODEL_BYTES = 10**15
MAX_MODEL_TEXT = "1 PB"
#: Producers and rollout nodes: 1 to a million.
MAX_COUNT = 1_000_000
#: The smallest change rate: one element in a billion.
MIN_CHANGE_RATE = 1e-9
#: The longest rate, size, count or change rate parsed, in characters.
MAX_INPUT_CHARS = MAX_SIZE_CHARS

_RATE = re.compile(
    r"^\s*(?P<num>[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*"
    r"(?P<prefix>[kKmMgGtTpP]?)(?P<binary>i?)"
    r"(?P<unit>bits|bit|bps|b|Bps|B|bytes|byte)"
    r"(?P<per>\s*/\s*s(?:ec)?)?\s*$"
)
_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
RATE_EXAMPLES = "e.g. 100Mbit, 10Gbit/s, 400Gbps or 1.25GB/s"


def _not_too_long(text: str, what: str, examples: str) -> None:
    if len(text.strip()) > MAX_INPUT_CHARS:
        raise ValueError(
            f"{what} of {len(text.strip())} characters is longer than {MAX_INPUT_CHARS} "
            f"characters ({examples})"
        )


def parse_size(text: str) -> int:
    """Bytes from "622891008", "60GB", "1.5TiB" (must be > 0 and at most 1 PB)."""
    _not_too_long(text, "a size", "e.g. 60GB, 1.5TiB")
    if text.strip().startswith("-"):
        raise ValueError(f"{text!r}: the size must be positive (e.g. 60GB, 1.5TiB)")
    try:
        size = parse_byte_size(text.strip())
        size = int(size)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"{text!r} is not a size: write bytes or a unit, e.g. 60GB, 1.5TiB"
        ) from exc
    if size <= 0:
        raise ValueError(f"{text!r}: the size must be positive")
    if size > MAX_MODEL_BYTES:
        raise ValueError(f"{text!r}: a size must be at most {MAX_MODEL_TEXT} (10^15 bytes)")
    return size


def parse_size_or_auto(text: str) -> int | str:
    """`auto` (the product's rule, resolved against H and the producers) or a size."""
    return "auto" if text.strip().lower() == "auto" else parse_size(text)


def parse_rate(
    text: str,
    low: float = MIN_LINK_BYTES_S,
    high: float = MAX_LINK_BYTES_S,
    bounds: tuple[str, str] = LINK_BOUNDS_TEXT,
    what: str = "a link rate",
) -> float:
    """Bytes per second from a link rate with a unit, within [low, high] (by default a link's:
    1 kbit/s to 10 Tbit/s; `bounds` says them in words)."""
    _not_too_long(text, what, RATE_EXAMPLES)
    raw = text.strip()
    if raw.startswith("-"):
        raise ValueError(f"{text!r}: {what} must be positive ({RATE_EXAMPLES})")
    match = _RATE.match(raw)
    if match is None:
        raise ValueError(f"{text!r} is not a link rate: write a number and a unit, {RATE_EXAMPLES}")
    try:
        number = Decimal(match["num"])
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only numbers
        raise ValueError(f"{text!r} is not a link rate ({RATE_EXAMPLES})") from exc
    base = 1024 if match["binary"] else 1000
    scale = Decimal(base) ** _POWER[match["prefix"].lower()]
    unit = match["unit"]
    per_bit = unit in ("b", "bit", "bits", "bps")
    try:
        value = float(number * scale / (8 if per_bit else 1))
    except ArithmeticError:  # an exponent beyond Decimal's range, e.g. 1e9999999999
        value = math.inf
    if math.isinf(value):
        raise ValueError(f"{text!r}: {what} must be finite ({RATE_EXAMPLES})")
    if not value > 0:
        raise ValueError(f"{text!r}: {what} must be positive ({RATE_EXAMPLES})")
    if not low <= value <= high:
        raise ValueError(f"{text!r}: {what} must be at least {bounds[0]} and at most {bounds[1]}")
    return value


def parse_throughput(text: str) -> float:
    """Bytes per second from a throughput with a unit, 1 kB/s to 100 TB/s."""
    return parse_rate(
        text,
        MIN_THROUGHPUT_BYTES_S,
        MAX_THROUGHPUT_BYTES_S,
        THROUGHPUT_BOUNDS_TEXT,
        "a throughput",
    )


def parse_count(text: str, what: str) -> int:
    """A whole number from 1 to `MAX_COUNT` (producers, nodes)."""
    raw = text.strip()
    if len(raw) > MAX_INPUT_CHARS or not raw.isascii() or not raw.isdigit():
        shown = repr(raw) if len(raw) <= MAX_INPUT_CHARS else f"a {len(raw)}-character value"
        raise ValueError(f"{shown} is not a number of {what}: write 1 to {MAX_COUNT}")
    count = int(raw)
    if not 1 <= count <= MAX_COUNT:
        raise ValueError(f"{count} {what}: write 1 to {MAX_COUNT}")
    return count


def parse_change_rate(text: str) -> float:
    """A fraction of elements in [1e-9, 1] from "0.03" or "3%"."""
    _not_too_long(text, "a change rate", "e.g. 0.03 or 3%")
    raw = text.strip()
    percent = raw.endswith("%")
    try:
        value = float(raw[:-1] if percent else raw)
    except ValueError as exc:
        raise ValueError(
            f"{text!r} is not a change rate: write a fraction (0.03) or a percentage (3%)"
        ) from exc
    if percent:
        value /= 100
    if value != value or value <= 0:  # NaN or not positive
        raise ValueError(f"{text!r}: the change rate must be above 0 (e.g. 0.03 or 3%)")
    if value > 1:
        hint = f" ({value:g} is {value:.0%}; 3% is 0.03)" if not percent else ""
        raise ValueError(f"{text!r}: a change rate over 100% is impossible{hint}")
    if value < MIN_CHANGE_RATE:
        raise ValueError(
            f"{text!r}: the change rate must be at least {MIN_CHANGE_RATE:g} (one element in "
            "a billion)"
        )
    return value


def format_bytes(n: float) -> str:
    """Decimal units, as the paper counts them (1 GB = 10^9 bytes)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def format_rate(bytes_per_s: float) -> str:
    """A link rate in bits per second."""
    bits = bytes_per_s * 8
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.4g} {unit}"
    return f"{bits:.4g} bit/s"


def format_seconds(s: float) -> str:
    if s >= 120:
        return f"{s / 60:.1f} min"
    if s >= 10:
        return f"{s:.1f} s"
    if s >= 0.1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms"
