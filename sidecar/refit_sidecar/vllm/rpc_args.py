"""Canonical metadata as plain lists, the form it takes through vLLM's `collective_rpc`
(tensors and dtypes cannot travel there): `[name, shape, dtype name]` per tensor."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from refit_sidecar.codec.dtypes import dtype_from_name, dtype_name
from refit_sidecar.codec.records import TensorMeta


def metas_to_wire(metas: Iterable[TensorMeta]) -> list[list[Any]]:
    """TensorMetas -> lists that survive collective_rpc."""
    return [[m.name, list(m.shape), dtype_name(m.dtype)] for m in metas]


def metas_from_wire(rows: list[list[Any]]) -> dict[str, TensorMeta]:
    """Inverse of `metas_to_wire`, by name (SchemaError for a dtype the codec lacks)."""
    return {
        str(name): TensorMeta(str(name), tuple(int(d) for d in shape), dtype_from_name(dtype))
        for name, shape, dtype in rows
    }
