"""The decoded payload file the receiver hands to the vLLM workers: what the worker reads is what
the receiver decoded, bit for bit (integer views), for every dtype, op and location kind; and
a file that does not match the worker's canonical metadata is refused with a `CodecError`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from refit_sidecar.bits import int_view
from refit_sidecar.codec import (
    CODEC_VERSION,
    CodecError,
    Item,
    LocationError,
    MetaMismatch,
    Op,
    PayloadHeader,
    SchemaError,
    TensorMeta,
    apply_item_,
    decode_payload,
    encode_payload,
)
from refit_sidecar.codec.decoded_file import read_decoded, write_decoded
from refit_sidecar.codec.dtypes import DTYPE_CODES, value_dtype


def _items() -> tuple[list[Item], dict[str, TensorMeta]]:
    """One gap item and one run item per dtype the codec carries, XOR and overwrite."""
    rng = np.random.default_rng(0)
    items, known = [], {}
    for k, dtype in enumerate(DTYPE_CODES):
        meta = TensorMeta(f"t{k}.weight", (64, 33), dtype)
        known[meta.name] = meta
        vdt = value_dtype(dtype)
        hi = 2 if dtype == torch.bool else 100
        positions = np.sort(rng.choice(meta.numel, size=50, replace=False)).astype(np.int64)
        values = torch.from_numpy(rng.integers(1, hi, size=50).astype(np.int64)).to(vdt)
        op = Op.XOR if k % 2 else Op.OVERWRITE
        items.append(Item(meta, op, None, torch.from_numpy(positions), values))
        run = TensorMeta(f"t{k}.bias", (300,), dtype)
        known[run.name] = run
        run_values = torch.from_numpy(rng.integers(1, hi, size=40).astype(np.int64)).to(vdt)
        items.append(Item(run, Op.OVERWRITE, 200, None, run_values))
    return items, known


def _decoded(items: list[Item]):  # type: ignore[no-untyped-def]
    header = PayloadHeader(CODEC_VERSION, "attempt-7", 2, 11, 5)
    return decode_payload(encode_payload(header, items).body)


def test_worker_reads_exactly_what_the_receiver_decoded(tmp_path: Path) -> None:
    items, known = _items()
    decoded = _decoded(items)
    path = tmp_path / "p.krd"
    assert write_decoded(decoded, path) == path.stat().st_size > 0
    assert not list(tmp_path.glob("*.tmp*"))  # published atomically
    header, read = read_decoded(path, known)
    assert header == decoded.header
    assert len(read) == len(decoded.items)
    for a, b in zip(decoded.items, read, strict=True):
        assert (a.meta, a.op, a.range_start) == (b.meta, b.op, b.range_start)
        assert a.values.dtype == b.values.dtype
        assert torch.equal(a.values, b.values)
        if a.locations is None:
            assert b.locations is None
        else:
            assert b.locations is not None
            assert torch.equal(a.locations, b.locations)
    # Applying what the worker read gives the bits of applying what was encoded.
    for original, got in zip(items, read, strict=True):
        base = torch.zeros(original.meta.shape, dtype=original.meta.dtype)
        expect, actual = base.clone(), base.clone()
        apply_item_(expect, original)
        apply_item_(actual, got)
        assert torch.equal(int_view(expect), int_view(actual)), original.meta.name


def test_a_name_shape_or_dtype_the_worker_does_not_know_is_refused(tmp_path: Path) -> None:
    items, known = _items()
    path = tmp_path / "p.krd"
    write_decoded(_decoded(items[:2]), path)
    name = items[0].meta.name
    for other in (
        {},
        {name: TensorMeta(name, (33, 64), items[0].meta.dtype)},
        {
            name: TensorMeta(
                name, (64, 33), torch.int32 if items[0].meta.dtype != torch.int32 else torch.int64
            )
        },
    ):
        with pytest.raises(MetaMismatch):
            read_decoded(path, {**known, **other} if other else {})


def test_positions_outside_the_tensor_are_refused(tmp_path: Path) -> None:
    meta = TensorMeta("w", (10,), torch.bfloat16)
    path = tmp_path / "bad.krd"
    header = json.dumps([CODEC_VERSION, "a", 0, 0, 0])
    rows = json.dumps([["w", "bfloat16", [10], int(Op.OVERWRITE), None]])
    save_file(
        {"v0": torch.ones(2, dtype=torch.int16), "p0": torch.tensor([3, 10])},
        str(path),
        metadata={"format": "kuberefit-decoded-payload-v1", "header": header, "items": rows},
    )
    with pytest.raises(LocationError):
        read_decoded(path, {"w": meta})


@pytest.mark.parametrize(
    "metadata",
    [
        {"format": "something-else", "header": '[1, "a", 0, 0, 0]', "items": "[]"},
        {"format": "kuberefit-decoded-payload-v1", "items": "[]"},
        {"format": "kuberefit-decoded-payload-v1", "header": "not json", "items": "[]"},
        {"format": "kuberefit-decoded-payload-v1", "header": '[1, "a", 0, 0, 0]', "items": "[[1]]"},
    ],
)
def test_malformed_files_are_typed_codec_errors(tmp_path: Path, metadata: dict[str, str]) -> None:
    path = tmp_path / "bad.krd"
    save_file({"v0": torch.ones(1, dtype=torch.int16)}, str(path), metadata=metadata)
    with pytest.raises(CodecError):
        read_decoded(path, {})
    path.write_bytes(b"\x00" * 12)
    with pytest.raises(SchemaError):
        read_decoded(path, {})


def test_file_layout_is_one_values_tensor_per_item_and_positions_only_for_gaps(
    tmp_path: Path,
) -> None:
    items, _ = _items()
    path = tmp_path / "p.krd"
    write_decoded(_decoded(items[:4]), path)
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == ["p0", "p2", "v0", "v1", "v2", "v3"]
