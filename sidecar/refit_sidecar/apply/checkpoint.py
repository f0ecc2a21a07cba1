"""Dense loads from a safetensors checkpoint directory through a runtime's own `load_weights`.

Used by joining receivers (`POST /v1/restore`), the audit (`POST /v1/audit`) and the vLLM worker
extension. safetensors only: a checkpoint is read without unpickling anything.

This is the one place that opens checkpoint files, and what it opens comes from outside this
process (a path in a request, files someone else wrote), so it reads defensively, for every
caller:

- only regular files: a FIFO, a device, a directory, or a symlink to one of them is refused before
  anything is read from it, never waited on. The type is checked with `os.stat` before opening
  (nothing is opened that is not a regular file) and again with `fstat` on the descriptor, which
  is opened with O_NONBLOCK (opening a FIFO swapped in meanwhile does not block) and is the only
  thing read afterwards (no race between the check and the read);
- the header length is checked against the file's size, and the whole header is validated (dtype,
  shape, offsets that tile the data exactly, as safetensors itself requires) before any tensor is
  read or allocated: what is allocated is bounded by the file's size;
- tensors are read with plain reads from that descriptor, no mmap: a file truncated meanwhile is a
  short read, not a SIGBUS;
- every file of the directory is opened and validated before the first tensor is handed to a
  loader (a broken file refuses the whole checkpoint, not half a dense load).

Anything wrong is a `CheckpointError` (a ValueError) naming the file and what is wrong.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from refit_protocol.limits import shown_name
from refit_protocol.tensors import SAFETENSORS_DTYPES
from refit_sidecar.codec.dtypes import dtype_from_name
from refit_sidecar.codec.records import TensorMeta

SUFFIX = ".safetensors"
#: Largest JSON header accepted (safetensors' own limit).
MAX_HEADER_BYTES = 100_000_000
#: Bytes asked of the OS per read (Linux returns at most ~2 GiB per call anyway).
_READ_CHUNK = 1 << 30
_TORCH_DTYPES: dict[str, torch.dtype] = {
    tag: dtype_from_name(name) for tag, name in SAFETENSORS_DTYPES.items()
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: the message names the file (or directory) and why.

    One argument, the message, so that it survives pickling between a vLLM worker and its
    engine."""


class _Loader(Protocol):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object: ...


def checkpoint_files(directory: str | Path) -> list[Path]:
    """The directory's `*.safetensors` entries, sorted; a `CheckpointError` when it is not a
    directory or holds none (a wrong or unmounted path must fail loudly, never load nothing).
    Each entry is checked when it is opened (`open_checkpoint`)."""
    try:
        st = os.stat(directory)
    except OSError as exc:
        raise CheckpointError(f"{directory}: {_reason(exc)}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{directory}: not a directory ({_kind(st.st_mode)})")
    try:
        with os.scandir(directory) as entries:
            files = sorted(Path(directory, e.name) for e in entries if e.name.endswith(SUFFIX))
    except OSError as exc:
        raise CheckpointError(f"{directory}: {_reason(exc)}") from None
    if not files:
        raise CheckpointError(f"no *.safetensors files in {directory}")
    return files


@dataclass(frozen=True)
class _Entry:
    meta: TensorMeta
    offset: int  # absolute position of the first byte in the file
    nbytes: int


class SafetensorsFile:
    """One safetensors file, open and validated (`open`): its tensors' metadata, and reads."""

    def __init__(self, path: Path, fd: int, entries: dict[str, _Entry]) -> None:
        self.path = path
        self._fd = fd
        self._entries = entries

    @classmethod
    def open(cls, path: str | Path) -> SafetensorsFile:
        """Open a regular file and validate its header completely (`CheckpointError`)."""
        path = Path(path)
        fd = _open_regular(path)
        try:
            size = os.fstat(fd).st_size
            return cls(path, fd, _read_header(path, fd, size))
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def names(self) -> list[str]:
        """The tensors' names, sorted (as safetensors' `keys()`)."""
        return sorted(self._entries)

    def meta(self, name: str) -> TensorMeta:
        return self._entries[name].meta

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name`, read from the file into a new CPU tensor."""
        e = self._entries[name]
        try:
            raw = torch.empty(e.nbytes, dtype=torch.uint8)
        except RuntimeError as exc:  # the allocator's "can't allocate memory"
            raise CheckpointError(
                f"{self.path}: {shown_name(name)}: cannot allocate {e.nbytes} bytes: {exc}"
            ) from None
        if e.nbytes:
            _read_into(self.path, self._fd, raw.numpy().data, e.offset, what=name)
        if e.meta.dtype == torch.bool and bool((raw > 1).any()):
            raise CheckpointError(
                f"{self.path}: {shown_name(name)}: a bool value is neither 0 nor 1"
            )
        return raw.view(e.meta.dtype).reshape(e.meta.shape)

    def tensors(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names() if names is None else names:
            yield name, self.read(name)


@contextmanager
def open_checkpoint(files: Iterable[Path]) -> Iterator[list[SafetensorsFile]]:
    """Every file opened and validated before the caller reads a tensor; closed afterwards. A
    name in two files is refused (which one would a dense load mean?)."""
    with ExitStack() as stack:
        opened: list[SafetensorsFile] = []
        where: dict[str, Path] = {}
        for path in files:
            f = stack.enter_context(SafetensorsFile.open(path))
            for name in f.names():
                if name in where:
                    raise CheckpointError(f"{path}: {shown_name(name)} is also in {where[name]}")
                where[name] = path
            opened.append(f)
        yield opened


def feed_checkpoint(model: _Loader, files: Iterable[Path]) -> set[str]:
    """Stream every tensor of `files` into `model.load_weights`; returns the names fed."""
    fed: set[str] = set()
    with open_checkpoint(files) as opened:
        for f in opened:
            names = f.names()
            model.load_weights(f.tensors(names))
            fed.update(names)
    return fed


def checkpoint_tensors(
    files: Iterable[Path], known: Mapping[str, TensorMeta] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of `files`, one at a time (the audit holds one canonical tensor at once).

    With `known` (the canonical metadata), a tensor that is not one of them, or has another
    dtype or shape, is refused from the header, before its bytes are read or allocated."""
    with open_checkpoint(files) as opened:
        if known is not None:
            for f in opened:
                for name in f.names():
                    meta, expected = f.meta(name), known.get(name)
                    if expected is None:
                        raise CheckpointError(
                            f"{f.path}: {shown_name(name)} is not a canonical tensor"
                        )
                    if meta != expected:
                        raise CheckpointError(
                            f"{f.path}: {shown_name(name)} is {meta.dtype}{list(meta.shape)}, "
                            f"the canonical tensor is {expected.dtype}{list(expected.shape)}"
                        )
        for f in opened:
            yield from f.tensors()


# -- opening and validating ------------------------------------------------------------------------


def _open_regular(path: Path) -> int:
    """A read-only descriptor of `path` (symlinks followed), which must be a regular file."""
    try:
        st = os.stat(path)  # never open a device or FIFO at all: opening may have effects
    except OSError as exc:
        raise CheckpointError(f"{path}: {_reason(exc)}") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: not a regular file ({_kind(st.st_mode)})")
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise CheckpointError(f"{path}: {_reason(exc)}") from None
    try:
        st = os.fstat(fd)  # what was opened, if the path changed since the stat
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: not a regular file ({_kind(st.st_mode)})")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_header(path: Path, fd: int, size: int) -> dict[str, _Entry]:
    if size < 8:
        raise CheckpointError(f"{path}: {size} bytes, shorter than a safetensors header length")
    (length,) = struct.unpack("<Q", _pread(path, fd, 8, 0, what="the header length"))
    if length > size - 8:
        raise CheckpointError(
            f"{path}: header length {length} is larger than the {size - 8} bytes after it"
        )
    if length > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{path}: header length {length} is larger than the limit of {MAX_HEADER_BYTES}"
        )
    raw = _pread(path, fd, length, 8, what="the header")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except _DuplicateKeyError as exc:
        raise CheckpointError(f"{path}: the header names {exc} twice") from None
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"{path}: the header is not UTF-8 JSON: {_short(exc)}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: __metadata__ is not an object of strings")
    data_start, data_bytes = 8 + length, size - 8 - length
    entries: dict[str, _Entry] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        meta, begin, end = _entry(path, name, info)
        entries[name] = _Entry(meta, data_start + begin, end - begin)
        spans.append((begin, end, name))
    cursor = 0
    for begin, end, name in sorted(spans):
        if begin != cursor:
            raise CheckpointError(
                f"{path}: {shown_name(name)} starts at byte {begin} of the data, expected {cursor} "
                "(tensors must tile the data without gaps or overlaps)"
            )
        cursor = end
    if cursor != data_bytes:
        raise CheckpointError(
            f"{path}: the header describes {cursor} bytes of tensor data, the file holds "
            f"{data_bytes}"
        )
    return entries


def _entry(path: Path, name: str, info: object) -> tuple[TensorMeta, int, int]:
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise CheckpointError(
            f"{path}: {shown_name(name)}: an entry needs exactly dtype, shape and data_offsets"
        )
    tag, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    dtype = _TORCH_DTYPES.get(tag) if isinstance(tag, str) else None
    if dtype is None:
        raise CheckpointError(f"{path}: {shown_name(name)}: unsupported dtype {_short(tag)}")
    if not (isinstance(shape, list) and all(_nonneg_int(d) for d in shape)):
        raise CheckpointError(f"{path}: {shown_name(name)}: bad shape {_short(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_nonneg_int, offsets))):
        raise CheckpointError(f"{path}: {shown_name(name)}: bad data_offsets {_short(offsets)}")
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * dtype.itemsize
    if end < begin or end - begin != nbytes:
        raise CheckpointError(
            f"{path}: {shown_name(name)}: data_offsets {_short(offsets)} hold {end - begin} "
            f"bytes, {tag}{_short(shape)} needs {nbytes}"
        )
    return TensorMeta(name, tuple(shape), dtype), begin, end


class _DuplicateKeyError(ValueError):
    """A JSON object of the header names one key twice (which entry would be meant?)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(shown_name(key))
        out[key] = value
    return out


def _pread(path: Path, fd: int, n: int, offset: int, *, what: str) -> bytes:
    buf = bytearray(n)
    _read_into(path, fd, memoryview(buf), offset, what=what)
    return bytes(buf)


def _read_into(path: Path, fd: int, buf: memoryview, offset: int, *, what: str) -> None:
    """Fill `buf` from `offset`; a file that ends first (truncated meanwhile) is refused."""
    buf = buf.cast("B")
    done = 0
    while done < len(buf):
        try:
            got = os.preadv(fd, [buf[done : done + _READ_CHUNK]], offset + done)
        except OSError as exc:
            raise CheckpointError(f"{path}: reading {shown_name(what)}: {_reason(exc)}") from None
        if got == 0:
            raise CheckpointError(
                f"{path}: the file ended at byte {offset + done} while reading {shown_name(what)} "
                f"(truncated while being read?)"
            )
        done += got


def _nonneg_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return f"mode {stat.filemode(mode)}"


def _reason(exc: OSError) -> str:
    return exc.strerror.lower() if exc.strerror else str(exc)


def _short(value: object, most: int = 120) -> str:
    text = repr(value) if not isinstance(value, BaseException) else str(value)
    return text if len(text) <= most else f"{text[:most]}..."
