"""The dtypes the codec carries, their one-byte wire codes, names and same-width integer views.

Codes are part of wire format v1 (docs/wire-format.md): never renumber, only append. The names
are the protocol's (`refit_protocol.tensors.DTYPE_NAMES`: one table for both planes); the
integer views are `refit_sidecar.bits`'.
"""

from __future__ import annotations

import numpy as np
import torch

from refit_protocol.tensors import DTYPE_NAMES
from refit_sidecar.bits import NP_INT_VIEW, TORCH_INT_VIEW
from refit_sidecar.codec.errors import SchemaError

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.bool: 1,
    torch.uint8: 2,
    torch.int8: 3,
    torch.int16: 4,
    torch.int32: 5,
    torch.int64: 6,
    torch.float16: 7,
    torch.bfloat16: 8,
    torch.float32: 9,
    torch.float64: 10,
    torch.float8_e4m3fn: 11,
    torch.float8_e5m2: 12,
    torch.uint16: 13,
    torch.uint32: 14,
    torch.uint64: 15,
}
CODE_DTYPES: dict[int, torch.dtype] = {code: dt for dt, code in DTYPE_CODES.items()}
_WIDTHS: dict[torch.dtype, int] = {
    dt: torch.empty((), dtype=dt).element_size() for dt in DTYPE_CODES
}
_BY_NAME: dict[str, torch.dtype] = {str(dt).removeprefix("torch."): dt for dt in DTYPE_CODES}
if set(_BY_NAME) != DTYPE_NAMES:  # pragma: no cover - a dtype added on one side only
    raise ImportError(
        f"codec dtypes and protocol dtype names differ: {set(_BY_NAME) ^ DTYPE_NAMES}"
    )


def dtype_name(dtype: torch.dtype) -> str:
    """The protocol's name of a supported dtype ("bfloat16")."""
    dtype_code(dtype)
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of `dtype_name` for untrusted input (SchemaError for names the codec lacks)."""
    dtype = _BY_NAME.get(name)
    if dtype is None:
        raise SchemaError(f"dtype {name!r} is not carried by the codec")
    return dtype


def dtype_code(dtype: torch.dtype) -> int:
    """Wire code of a supported dtype (TypeError for anything else)."""
    code = DTYPE_CODES.get(dtype)
    if code is None:
        raise TypeError(f"dtype {dtype} is not supported by the codec")
    return code


def dtype_from_code(code: int) -> torch.dtype:
    """Inverse of `dtype_code` for untrusted input (SchemaError for unknown codes)."""
    dtype = CODE_DTYPES.get(code)
    if dtype is None:
        raise SchemaError(f"unknown dtype code {code}")
    return dtype


def width(dtype: torch.dtype) -> int:
    """Element width in bytes of a supported dtype."""
    w = _WIDTHS.get(dtype)
    if w is None:
        raise TypeError(f"dtype {dtype} is not supported by the codec")
    return w


def value_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype `Item.values` has for tensors of `dtype` (bool travels as uint8)."""
    return TORCH_INT_VIEW[width(dtype)]


def np_value_dtype(dtype: torch.dtype) -> np.dtype[np.generic]:
    """numpy twin of `value_dtype`."""
    return NP_INT_VIEW[width(dtype)]
