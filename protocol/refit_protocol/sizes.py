"""Sizes in bytes as the protocol and every settings file write them: an int, or a string with
a unit ("256MiB", "64Mi", "1.5GB"), and `auto` where a size may be chosen by the process.

A size string is refused before any arithmetic when it is longer than `MAX_SIZE_CHARS` (32)
characters, and a size must be below 8EiB (`MAX_BYTE_SIZE`): the messages that carry sizes come
from the network.
"""

from __future__ import annotations

import re
from decimal import Decimal, localcontext
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kKmMgGtTpP])(i?))?[bB]?\s*$")
_POWER = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_BINARY_UNITS = ("PiB", "TiB", "GiB", "MiB", "KiB")
#: The longest size string ("256MiB") parsed, in characters: longer ones are refused before
#: any arithmetic.
MAX_SIZE_CHARS = 32
#: The largest size in bytes (2^63 - 1: it fits a signed 64-bit integer).
MAX_BYTE_SIZE = (1 << 63) - 1


def parse_byte_size(value: Any) -> Any:
    """An int, or a size with a unit: B; k/M/G/T/P (powers of 1000, optional B); Ki/Mi/Gi/Ti/Pi
    (powers of 1024, optional B, as Kubernetes writes them). Other inputs pass through to
    pydantic's own int validation, which names the field. A string longer than
    `MAX_SIZE_CHARS` or a size above `MAX_BYTE_SIZE` is refused (before any arithmetic)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        if value > MAX_BYTE_SIZE:
            raise ValueError("a size must be less than 8EiB (2^63 bytes)")
        return value
    if not isinstance(value, str):
        return value
    if len(value) > MAX_SIZE_CHARS:
        raise ValueError(
            f"a size of {len(value)} characters is longer than {MAX_SIZE_CHARS} characters: "
            "write bytes as an integer or with a unit, e.g. 256MiB, 64Mi, 1.5GB"
        )
    match = _SIZE.match(value)
    if match is None:
        raise ValueError(
            f"{value!r} is not a size: write bytes as an integer or with a unit, "
            "e.g. 256MiB, 64Mi, 1.5GB"
        )
    number, prefix, binary = match.groups()
    scale = (1024 if binary else 1000) ** _POWER[prefix.lower()] if prefix else 1
    with localcontext() as exact:  # 32 digits times 1024^5: exact, never rounded
        exact.prec = 2 * MAX_SIZE_CHARS + 16
        size = Decimal(number) * scale  # 1.07GB is 1070000000 bytes, not 1070000000.0000001
    if size != size.to_integral_value():
        raise ValueError(f"{value!r} is not a whole number of bytes")
    if size > MAX_BYTE_SIZE:
        raise ValueError(f"{value!r}: a size must be less than 8EiB (2^63 bytes)")
    return int(size)


def format_byte_size(size: int) -> str:
    """The shortest exact binary-unit spelling ("512MiB"), else the plain integer."""
    for index, unit in enumerate(_BINARY_UNITS):
        step = 1024 ** (len(_BINARY_UNITS) - index)
        if size and size % step == 0:
            return f"{size // step}{unit}"
    return str(size)


class _Bytes:
    """Marks a ByteSize field, so examples and the reference print it with a unit."""


#: Put in a size type's `Annotated` metadata (as `ByteSize` does) to print it with a unit.
BYTE_SIZE = _Bytes()


Auto = Literal["auto"]
AUTO: Auto = "auto"


def _size_or_auto(value: Any) -> Any:
    if value == AUTO:
        return value
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size: write auto, bytes, or a unit (256MiB)")
    size = parse_byte_size(value)
    if isinstance(size, int) and size < 1:
        raise ValueError(f"{value!r}: a size must be at least 1 byte (or auto)")
    return size


#: A size setting that may also be `auto` (one clear error for anything else).
SizeOrAuto = Annotated[
    int | Auto, BeforeValidator(_size_or_auto, json_schema_input_type=int | str), BYTE_SIZE
]


#: A number of bytes: an int or a string with a unit ("256MiB").
ByteSize = Annotated[
    int, BeforeValidator(parse_byte_size, json_schema_input_type=int | str), _Bytes()
]


def is_byte_size_marker(metadata: object) -> bool:
    """Whether `metadata` (of a field's `Annotated`) marks a size printed with a unit."""
    return isinstance(metadata, _Bytes)
