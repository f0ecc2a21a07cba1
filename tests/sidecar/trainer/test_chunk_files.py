"""Chunk files are validated as untrusted input before anything is loaded."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch

from refit_sidecar.bits import int_view
from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.trainer.chunk_files import (
    chunk_file_name,
    load_tensors,
    read_header,
    safe_path,
    write_chunk_file,
)
from refit_sidecar.trainer.errors import ChunkFileError


def tensors() -> list[tuple[str, torch.Tensor]]:
    big = torch.randn(6, 5, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    return [
        ("z.weight", big[:, 1:3]),  # a strided view: written as its own storage
        ("a.bias", torch.tensor([-0.0, float("nan")], dtype=torch.float32)),
        ("m.steps", torch.arange(3, dtype=torch.int64)),
    ]


def test_round_trip_keeps_bits_and_order(tmp_path: Path) -> None:
    name = chunk_file_name(3, 1, 7)
    path, size = write_chunk_file(tmp_path, name, tensors())
    assert size == path.stat().st_size
    assert not list(tmp_path.glob(".*"))  # no temporary file left
    header = read_header(safe_path(tmp_path, name))
    assert header["z.weight"] == TensorMeta("z.weight", (6, 2), torch.bfloat16)
    got = load_tensors(path, [n for n, _ in tensors()])
    assert [n for n, _ in got] == [n for n, _ in tensors()]
    for (_, want), (_, t) in zip(tensors(), got, strict=True):
        assert torch.equal(int_view(want.contiguous()), int_view(t))


def _raw(tmp_path: Path, header: object, data: bytes, name: str = "x.safetensors") -> Path:
    h = json.dumps(header).encode()
    path = tmp_path / name
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "match"),
    [
        ({"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 5, "bytes"),
        ({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8, "dtype"),
        ({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 4]}}, b"\0" * 4, "size"),
        ({"w": {"dtype": "BF16", "shape": [-1], "data_offsets": [0, 2]}}, b"\0" * 2, "shape"),
        (
            {
                "a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]},
            },
            b"\0" * 3,
            "start",
        ),
        ([1, 2], b"", "object"),
        ({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "x": 1}}, b"\0", "malformed"),
    ],
)
def test_malformed_files_are_refused(
    tmp_path: Path, header: object, data: bytes, match: str
) -> None:
    with pytest.raises(ChunkFileError, match=match):
        read_header(_raw(tmp_path, header, data))


def test_header_length_out_of_bounds(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ChunkFileError, match="out of bounds"):
        read_header(path)


@pytest.mark.parametrize(
    "name", ["../x.safetensors", "x.pt", ".hidden.safetensors", "a/b.safetensors"]
)
def test_unsafe_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ChunkFileError, match="unsafe"):
        safe_path(tmp_path, name)


def test_symlinks_and_missing_files_are_refused(tmp_path: Path) -> None:
    target, _ = write_chunk_file(tmp_path, "real.safetensors", tensors())
    os.symlink(target, tmp_path / "link.safetensors")
    with pytest.raises(ChunkFileError, match="not a regular file"):
        safe_path(tmp_path, "link.safetensors")
    with pytest.raises(ChunkFileError, match="not in"):
        safe_path(tmp_path, "absent.safetensors")
