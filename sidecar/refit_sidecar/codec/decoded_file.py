"""A decoded payload as a file: how the receiver hands a validated payload to the vLLM workers.

The receiver decompresses, parses and checks every payload once (❺); the workers of its pod
only read the result (❻), so no payload is decoded twice. The file is a safetensors file (a JSON
header plus raw little-endian bytes: reading it never runs code) on the pod's shared-memory
volume: per item `v{i}`, its values (the dtype's same-width integer view) and, unless the item is
a contiguous run, `p{i}`, its int64 flat positions; the header's metadata names the payload and
each item's tensor, dtype, shape, op and run start.

The volume is shared only by the receiver sidecar and the vLLM container of one pod, but the
reader still checks what is cheap to check (format tag, item metadata against the worker's own
canonical metadata, dtypes, lengths, position bounds) and fails with a `CodecError`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from refit_sidecar.codec import dtypes
from refit_sidecar.codec.errors import CodecError, LocationError, MetaMismatch, SchemaError
from refit_sidecar.codec.records import Item, Op, TensorMeta
from refit_sidecar.codec.wire import DecodedPayload, PayloadHeader

FORMAT = "kuberefit-decoded-payload-v1"


def write_decoded(decoded: DecodedPayload, path: Path) -> int:
    """Write `decoded` to `path` atomically (temporary name, then rename); returns its bytes."""
    tensors: dict[str, torch.Tensor] = {}
    rows: list[list[Any]] = []
    for i, item in enumerate(decoded.items):
        m = item.meta
        tensors[f"v{i}"] = item.values
        if item.locations is not None:
            tensors[f"p{i}"] = item.locations
        rows.append(
            [m.name, dtypes.dtype_name(m.dtype), list(m.shape), int(item.op), item.range_start]
        )
    h = decoded.header
    metadata = {
        "format": FORMAT,
        "header": json.dumps([h.codec_version, h.attempt, h.producer, h.payload_id, h.order]),
        "items": json.dumps(rows),
    }
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata=metadata)
    tmp.replace(path)
    return path.stat().st_size


def read_decoded(path: Path, known: Mapping[str, TensorMeta]) -> tuple[PayloadHeader, list[Item]]:
    """The header and items of a decoded payload file, checked against `known`."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise SchemaError(f"{path.name}: not a decoded payload file")
            header = PayloadHeader(*json.loads(meta["header"]))
            rows = json.loads(meta["items"])
            keys = set(f.keys())
            items = [_item(i, row, f, keys, known) for i, row in enumerate(rows)]
    except CodecError:
        raise
    except (SafetensorError, KeyError, TypeError, ValueError) as exc:
        raise SchemaError(f"{path.name}: malformed decoded payload file: {exc}") from exc
    return header, items


def _item(i: int, row: list[Any], f: Any, keys: set[str], known: Mapping[str, TensorMeta]) -> Item:
    name, dtype_name, shape, op, start = row
    expected = known.get(name)
    meta = TensorMeta(str(name), tuple(int(d) for d in shape), dtypes.dtype_from_name(dtype_name))
    if expected is None or expected != meta:
        raise MetaMismatch(f"{name}: not the canonical {expected}")
    values = f.get_tensor(f"v{i}")
    if f"p{i}" in keys:
        locations = f.get_tensor(f"p{i}")
        if locations.dtype != torch.int64 or locations.numel() != values.numel():
            raise SchemaError(f"{name}: positions must be int64, one per value")
        if locations.numel() and (
            int(locations.min()) < 0 or int(locations.max()) >= expected.numel
        ):
            raise LocationError(f"{name}: a position lies outside {expected.numel} elements")
        return Item(expected, Op(op), None, locations, values)
    return Item(expected, Op(op), int(start), None, values)
