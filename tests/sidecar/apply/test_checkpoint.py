"""The checkpoint reader (apply/checkpoint.py), the one place that opens checkpoint files for a
dense restore or an audit (issue 34, item 3): bit-exact with safetensors' own reader on valid
files; everything else a `CheckpointError` naming the file, before a non-regular file is read
or a tensor allocated. The HTTP endpoints over it: tests/sidecar/receiver/test_checkpoint_input.py.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save, save_file

from refit_protocol.tensors import SAFETENSORS_DTYPES
from refit_sidecar.apply.checkpoint import (
    CheckpointError,
    SafetensorsFile,
    checkpoint_files,
    checkpoint_tensors,
    feed_checkpoint,
)
from refit_sidecar.codec.dtypes import dtype_from_name
from refit_sidecar.codec.records import TensorMeta


def _tensors() -> dict[str, torch.Tensor]:
    """One tensor of every dtype the codec carries, random bits, plus a 0-d and an empty one."""
    g = torch.Generator().manual_seed(34)
    out: dict[str, torch.Tensor] = {}
    for tag, name in SAFETENSORS_DTYPES.items():
        dtype = dtype_from_name(name)
        raw = torch.randint(0, 256, (3 * 5 * dtype.itemsize,), dtype=torch.uint8, generator=g)
        if dtype == torch.bool:
            raw = raw % 2
        out[f"x.{tag}"] = raw.view(dtype).reshape(3, 5)
    out["scalar"] = torch.tensor(1.5, dtype=torch.float64)
    out["empty"] = torch.zeros(0, 7, dtype=torch.bfloat16)
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.view(-1).view(torch.uint8).equal(b.view(-1).view(torch.uint8))
    )


def test_valid_files_read_bit_exactly_as_safetensors_reads_them(tmp_path: Path) -> None:
    state = _tensors()
    names = sorted(state)
    save_file({n: state[n] for n in names[::2]}, tmp_path / "a.safetensors", {"format": "pt"})
    save_file({n: state[n] for n in names[1::2]}, tmp_path / "b.safetensors")
    files = checkpoint_files(tmp_path)
    got = dict(checkpoint_tensors(files))
    assert sorted(got) == names
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for n in fh.keys():  # noqa: SIM118 (safe_open has no __iter__)
                assert _same_bits(got[n], fh.get_tensor(n)), n
    fed: list[str] = []

    class Loader:
        def load_weights(self, weights: object) -> None:
            fed.extend(n for n, _ in weights)  # type: ignore[attr-defined]

    assert feed_checkpoint(Loader(), files) == set(names)
    assert sorted(fed) == names


def _write(tmp_path: Path, raw: bytes, name: str = "model.safetensors") -> Path:
    path = tmp_path / name
    path.write_bytes(raw)
    return path


def _header(entries: object, data: bytes = b"") -> bytes:
    head = json.dumps(entries).encode()
    return struct.pack("<Q", len(head)) + head + data


F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


MALFORMED: list[tuple[bytes, str]] = [
    (b"", "0 bytes, shorter than a safetensors header length"),
    (struct.pack("<Q", 2**62) + b"{}", "header length 4611686018427387904 is larger than"),
    (struct.pack("<Q", 2) + b"\xff\xfe", "the header is not UTF-8 JSON"),
    (struct.pack("<Q", 9000) + b"[" * 9000, "the header is not UTF-8 JSON"),
    (_header([]), "the header is not a JSON object"),
    (_header({"t": F32}, bytes(7)), "describes 8 bytes of tensor data, the file holds 7"),
    (_header({"t": F32}, bytes(9)), "describes 8 bytes of tensor data, the file holds 9"),
    (_header({"t": {**F32, "dtype": "F4"}}, bytes(8)), "t: unsupported dtype 'F4'"),
    (_header({"t": {**F32, "shape": [-2]}}, bytes(8)), "t: bad shape [-2]"),
    (_header({"t": {**F32, "shape": [True]}}, bytes(8)), "t: bad shape [True]"),
    (_header({"t": {**F32, "data_offsets": [0]}}, bytes(8)), "t: bad data_offsets [0]"),
    (_header({"t": {**F32, "data_offsets": [8, 0]}}, bytes(8)), "hold -8 bytes"),
    (_header({"t": {**F32, "shape": [2**62]}}, bytes(8)), "needs 18446744073709551616"),
    (_header({"t": {"dtype": "F32", "shape": [2]}}, bytes(8)), "t: an entry needs exactly"),
    (
        _header({"t": F32, "u": {**F32, "data_offsets": [4, 12]}}, bytes(12)),
        "u starts at byte 4 of the data, expected 8",
    ),
    (_header({"t": F32, "__metadata__": {"k": 1}}, bytes(8)), "__metadata__ is not"),
    (
        b"".join([struct.pack("<Q", 27), b'{"t": {}, "t": {}}         ']),
        "the header names t twice",
    ),
    (
        _header({"b": {"dtype": "BOOL", "shape": [2], "data_offsets": [0, 2]}}, b"\x01\x02"),
        "b: a bool value is neither 0 nor 1",
    ),
]


@pytest.mark.parametrize(("raw", "why"), MALFORMED, ids=[why for _, why in MALFORMED])
def test_a_malformed_file_is_refused_with_the_file_and_the_reason(
    tmp_path: Path, raw: bytes, why: str
) -> None:
    path = _write(tmp_path, raw)
    with pytest.raises(CheckpointError) as err:
        list(checkpoint_tensors(checkpoint_files(tmp_path)))
    assert str(err.value).startswith(f"{path}: ")
    assert why in str(err.value)


def test_what_is_not_a_regular_file_is_refused_unread(tmp_path: Path) -> None:
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(CheckpointError, match=r"dir\.safetensors: not a regular file \(a dir"):
        list(checkpoint_tensors(checkpoint_files(tmp_path)))
    (tmp_path / "dir.safetensors").rmdir()
    os.mkfifo(tmp_path / "fifo.safetensors")
    with pytest.raises(CheckpointError, match=r"fifo\.safetensors: not a regular file \(a FIFO"):
        feed_checkpoint(object(), checkpoint_files(tmp_path))  # type: ignore[arg-type]
    (tmp_path / "fifo.safetensors").unlink()
    (tmp_path / "gone.safetensors").symlink_to(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"gone\.safetensors: no such file or directory"):
        list(checkpoint_tensors(checkpoint_files(tmp_path)))
    with pytest.raises(CheckpointError, match=r"nowhere: no such file or directory"):
        checkpoint_files(tmp_path / "nowhere")
    (tmp_path / "gone.safetensors").unlink()
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"file: not a directory \(a regular file\)"):
        checkpoint_files(tmp_path / "file")
    (tmp_path / "file").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files in"):
        checkpoint_files(tmp_path)


def test_a_fifo_swapped_in_after_the_check_is_refused_without_blocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The descriptor opened (O_NONBLOCK) is what is checked and read, not the path."""
    regular = _write(tmp_path, save({"t": torch.zeros(2)}), "regular")
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    real_stat = os.stat
    monkeypatch.setattr(
        os, "stat", lambda p, *a, **k: real_stat(regular if p == fifo else p, *a, **k)
    )
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a regular file \(a FIFO"):
        SafetensorsFile.open(fifo)


def test_a_file_truncated_while_it_is_read_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, save({"a": torch.ones(64), "b": torch.ones(64)}))
    with SafetensorsFile.open(path) as f:
        os.truncate(path, path.stat().st_size - 10)  # after the header was validated
        assert f.read("a").equal(torch.ones(64))
        with pytest.raises(CheckpointError, match=r"the file ended at byte \d+ while reading b"):
            f.read("b")


def test_a_name_in_two_files_and_a_non_canonical_tensor_are_refused(tmp_path: Path) -> None:
    save_file({"t": torch.zeros(2)}, tmp_path / "a.safetensors")
    save_file({"t": torch.ones(2)}, tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match=r"b\.safetensors: t is also in .*a\.safetensors"):
        list(checkpoint_tensors(checkpoint_files(tmp_path)))
    (tmp_path / "b.safetensors").unlink()
    known = {"t": TensorMeta("t", (3,), torch.float32)}
    with pytest.raises(CheckpointError, match=r"t is torch.float32\[2\], the canonical tensor"):
        next(checkpoint_tensors(checkpoint_files(tmp_path), known))
    with pytest.raises(CheckpointError, match="t is not a canonical tensor"):
        next(checkpoint_tensors(checkpoint_files(tmp_path), {}))
