"""❸ encode — payload wire format v1 (docs/wire-format.md is the normative description).

A payload is a plain preamble (magic, version, identity, sizes, digest) followed by one zstd
frame. The frame holds a copy of the identity, the group and item tables, the location groups and
the value groups. The BLAKE2b-128 digest covers the compressed body, and the identity copy inside
it binds the plain header to the digest. Decoding parses with `struct` and `numpy.frombuffer`
only (never pickle or torch.load), checks every declared size against the bytes actually present
before allocating, and raises a `CodecError` subclass for anything malformed.
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import zstandard
from pydantic import BaseModel, ConfigDict, Field

from refit_sidecar.codec import dtypes
from refit_sidecar.codec.errors import (
    BadMagic,
    CodecError,
    DecompressionError,
    DigestMismatch,
    HeaderMismatch,
    LocationError,
    MetaMismatch,
    SchemaError,
    SizeLimitExceeded,
    TruncatedPayload,
    UnsupportedVersion,
)
from refit_sidecar.codec.locations import (
    GAP_DTYPES,
    MAX_NUMEL,
    EncodedLocations,
    LocKind,
    decode_gaps,
    encode_positions,
    encode_run,
    unshuffle,
)
from refit_sidecar.codec.records import Item, Op, TensorMeta

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("the KubeRefit codec needs a little-endian host")

MAGIC = b"KRFP"
BODY_MAGIC = b"KRB1"
CODEC_VERSION = 1
DIGEST_SIZE = 16
MAX_ATTEMPT_BYTES = 1024
#: A zstd block of at most 128 KiB can be stored in 4 bytes (RLE), so no frame expands more.
ZSTD_MAX_RATIO = 32768
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

_PRE_ID = struct.Struct("<4sH")  # magic, codec version
_PRE_REST = struct.Struct("<HIQQQQ16sH")  # flags, producer, payload, order, raw, comp, digest, |a|
PREAMBLE_SIZE = _PRE_ID.size + _PRE_REST.size
_BODY_HEAD = struct.Struct("<4sHIQQIBBH")  # magic, |attempt|, producer, payload, order, items,
#                                            location groups, value groups, reserved
_GROUP = struct.Struct("<BB6xQ")  # width or dtype code, shuffled, element count
_ITEM = struct.Struct("<HBBBBBxQQQQ")  # |name|, dtype, op, loc kind, loc width, ndim, count,
#                                        start, location offset, value offset
_DIM = struct.Struct("<Q")
_ALIGN = 8


class CodecConfig(BaseModel):
    """Encoder settings. Decoding needs none: everything it needs is in the payload."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    zstd_level: int = Field(default=1, ge=1, le=22, description="zstd level; 1 as in the paper.")
    zstd_threads: int | None = Field(
        default=None,
        ge=0,
        description="zstd worker threads per payload; 0 compresses in the calling thread. None: "
        "0 for a single payload, and in the pipeline one per compare thread when there are "
        "several (on one core, extra zstd threads only contend). The bytes are the same for "
        "every value >= 1.",
    )
    shuffle: bool = Field(
        default=True,
        description="Byte-plane shuffle multi-byte location and value groups before zstd "
        "(smaller payloads, see docs/performance.md).",
    )


class DecodeLimits(BaseModel):
    """Upper bounds a receiver enforces on untrusted payloads before allocating anything."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_raw_bytes: int = Field(default=16 << 30, gt=0, description="Largest decompressed body.")
    max_items: int = Field(default=1 << 20, gt=0, description="Most items in one payload.")
    max_name_bytes: int = Field(default=4096, gt=0, description="Longest UTF-8 tensor name.")
    max_ndim: int = Field(default=16, ge=0, description="Most dimensions of a tensor.")


DEFAULT_CODEC = CodecConfig()
DEFAULT_LIMITS = DecodeLimits()


@dataclass(frozen=True)
class PayloadHeader:
    """Identity of a payload: dedup key (attempt, producer, payload_id) and application order."""

    codec_version: int
    attempt: str
    producer: int
    payload_id: int
    order: int

    def __post_init__(self) -> None:
        if len(self.attempt.encode()) > MAX_ATTEMPT_BYTES:
            raise ValueError(f"attempt id longer than {MAX_ATTEMPT_BYTES} bytes")
        if not 0 <= self.producer < 1 << 32:
            raise ValueError("producer must fit in 32 bits")
        if not (0 <= self.payload_id < 1 << 64 and 0 <= self.order < 1 << 64):
            raise ValueError("payload_id and order must fit in 64 bits")
        if not 0 <= self.codec_version < 1 << 16:
            raise ValueError("codec_version must fit in 16 bits")


@dataclass(frozen=True)
class EncodedPayload:
    """A payload ready to send: `body` is the full wire bytes, `digest` its compressed body's."""

    header: PayloadHeader
    body: bytes
    digest: bytes
    raw_size: int = 0  # decompressed body bytes, for metrics (0 when unknown)

    @property
    def size(self) -> int:
        return len(self.body)


@dataclass(frozen=True)
class DecodedPayload:
    """A validated payload: its identity and items in encoded order."""

    header: PayloadHeader
    items: list[Item]
    digest: bytes
    raw_size: int


# --------------------------------------------------------------------------------------- encode
@dataclass(frozen=True)
class PreparedItem:
    """An item with its wire-form locations, so producers can do that work in parallel."""

    item: Item
    locations: EncodedLocations


def prepare_item(item: Item) -> PreparedItem:
    """Check an item for encoding and compute its location encoding (run or gaps)."""
    meta = item.meta
    dtypes.dtype_code(meta.dtype)
    if item.count == 0:
        raise ValueError(f"{meta.name}: an item must carry at least one change")
    if item.range_start is not None:
        return PreparedItem(item, encode_run(item.range_start))
    assert item.locations is not None
    return PreparedItem(item, encode_positions(item.locations.numpy(), meta.numel))


def encode_payload(
    header: PayloadHeader,
    items: Sequence[Item | PreparedItem],
    *,
    config: CodecConfig | None = None,
) -> EncodedPayload:
    """Serialize and compress `items` (names unique, each with at least one change)."""
    cfg = config or DEFAULT_CODEC
    if header.codec_version != CODEC_VERSION:
        raise ValueError(f"this encoder writes codec version {CODEC_VERSION} only")
    rows: list[bytes] = []
    loc_parts: dict[int, list[npt.NDArray[np.generic]]] = {}
    val_parts: dict[int, list[npt.NDArray[np.generic]]] = {}
    loc_counts: dict[int, int] = {}
    val_counts: dict[int, int] = {}
    names: set[str] = set()
    for entry in items:
        prepared = entry if isinstance(entry, PreparedItem) else prepare_item(entry)
        item, loc = prepared.item, prepared.locations
        meta = item.meta
        code = dtypes.dtype_code(meta.dtype)
        name = meta.name.encode()
        if meta.name in names or not name or len(name) >= 1 << 16:
            raise ValueError(f"{meta.name!r}: tensor names must be unique and 1..65535 bytes")
        names.add(meta.name)
        loc_off = 0
        if loc.kind is LocKind.GAPS:
            assert loc.gaps is not None
            loc_off = loc_counts.get(loc.width, 0)
            loc_counts[loc.width] = loc_off + loc.gaps.size
            loc_parts.setdefault(loc.width, []).append(loc.gaps)
        val_off = val_counts.get(code, 0)
        val_counts[code] = val_off + item.count
        val_parts.setdefault(code, []).append(item.values.numpy())
        rows.append(
            _ITEM.pack(
                len(name),
                code,
                int(item.op),
                int(loc.kind),
                loc.width,
                len(meta.shape),
                item.count,
                loc.start,
                loc_off,
                val_off,
            )
            + b"".join(_DIM.pack(d) for d in meta.shape)
            + name
        )
    attempt = header.attempt.encode()
    parts: list[bytes] = [
        _BODY_HEAD.pack(
            BODY_MAGIC,
            len(attempt),
            header.producer,
            header.payload_id,
            header.order,
            len(rows),
            len(loc_counts),
            len(val_counts),
            0,
        ),
        attempt,
    ]
    loc_keys, val_keys = sorted(loc_counts), sorted(val_counts)
    shuffled = int(cfg.shuffle)
    parts += [_GROUP.pack(w, int(shuffled and w > 1), loc_counts[w]) for w in loc_keys]
    parts += [
        _GROUP.pack(c, int(shuffled and dtypes.width(dtypes.CODE_DTYPES[c]) > 1), val_counts[c])
        for c in val_keys
    ]
    head = b"".join(parts + rows)
    groups = [loc_parts[w] for w in loc_keys] + [val_parts[c] for c in val_keys]
    sizes = [_padded(sum(a.size for a in g) * g[0].dtype.itemsize) for g in groups]
    raw_len = _padded(len(head)) + sum(sizes)
    # The raw body is assembled in one reused buffer and compressed in one call: fresh memory
    # for it would cost a page fault per 4 KiB, and streaming zstd part by part is slower.
    with _SCRATCH.borrow(raw_len) as raw:
        raw[: len(head)] = np.frombuffer(head, np.uint8)
        off = len(head)
        raw[off : _padded(off)] = 0
        off = _padded(off)
        for arrays, size in zip(groups, sizes, strict=True):
            _pack_group(arrays, cfg.shuffle, raw[off : off + size])
            off += size
        return _seal(header, raw.data, level=cfg.zstd_level, threads=cfg.zstd_threads or 0)


def _padded(n: int) -> int:
    return n + (-n % _ALIGN)


def _pack_group(
    arrays: list[npt.NDArray[np.generic]], planes: bool, out: npt.NDArray[np.uint8]
) -> None:
    """Write a group's arrays into `out` (byte-plane shuffled if asked), zero-padded."""
    width = arrays[0].dtype.itemsize
    total = sum(a.size for a in arrays)
    nbytes = total * width
    out[nbytes:] = 0
    if planes and width > 1:
        grid = out[:nbytes].reshape(width, total)
        off = 0
        for a in arrays:
            grid[:, off : off + a.size] = (
                np.ascontiguousarray(a).view(np.uint8).reshape(-1, width).T
            )
            off += a.size
    else:
        off = 0
        for a in arrays:
            n = a.size * width
            out[off : off + n] = np.ascontiguousarray(a).view(np.uint8)
            off += n


class _ScratchPool:
    """Raw-body buffers kept for reuse: at most `keep` of them, each at most `max_bytes`
    (larger bodies, e.g. a dense overwrite bucket, get a buffer of their own)."""

    def __init__(self, keep: int, max_bytes: int) -> None:
        self._free: list[npt.NDArray[np.uint8]] = []
        self._lock = threading.Lock()
        self._keep = keep
        self._max_bytes = max_bytes

    @contextlib.contextmanager
    def borrow(self, nbytes: int) -> Iterator[npt.NDArray[np.uint8]]:
        with self._lock:  # the smallest that fits (the list is sorted by size)
            i = next((i for i, b in enumerate(self._free) if b.size >= nbytes), None)
            buf = self._free.pop(i) if i is not None else np.empty(nbytes, np.uint8)
        try:
            yield buf[:nbytes]
        finally:
            if buf.size <= self._max_bytes:
                with self._lock:
                    self._free.append(buf)
                    self._free.sort(key=lambda b: b.size)
                    del self._free[: max(len(self._free) - self._keep, 0)]  # keep the largest


#: Two buffers (one per concurrent encoder) of at most 128 MiB: a 512 MiB bucket at a few
#: percent of changes has a raw body of ~50 MB.
_SCRATCH = _ScratchPool(keep=2, max_bytes=128 << 20)


def seal_body(
    header: PayloadHeader,
    raw_parts: Sequence[bytes | memoryview],
    *,
    level: int = 1,
    threads: int = 0,
) -> EncodedPayload:
    """Compress raw body bytes (given in parts) and frame them with the preamble and digest.

    Tests use it to wrap deliberately malformed bodies in a valid frame so that the body parser
    itself gets fuzzed.
    """
    raw = b"".join(memoryview(p).cast("B") for p in raw_parts)
    return _seal(header, memoryview(raw), level=level, threads=threads)


def _seal(header: PayloadHeader, raw: memoryview, *, level: int, threads: int) -> EncodedPayload:
    raw_len = raw.nbytes
    comp = zstandard.ZstdCompressor(level=level, threads=threads).compress(raw)
    digest = hashlib.blake2b(comp, digest_size=DIGEST_SIZE).digest()
    attempt = header.attempt.encode()
    pre = _PRE_ID.pack(MAGIC, header.codec_version) + _PRE_REST.pack(
        0,
        header.producer,
        header.payload_id,
        header.order,
        raw_len,
        len(comp),
        digest,
        len(attempt),
    )
    return EncodedPayload(header=header, body=pre + attempt + comp, digest=digest, raw_size=raw_len)


# --------------------------------------------------------------------------------------- decode
class _Reader:
    """Bounds-checked cursor over untrusted bytes."""

    def __init__(self, buf: memoryview, what: str) -> None:
        self.buf = buf
        self.pos = 0
        self.what = what

    def unpack(self, st: struct.Struct) -> tuple[Any, ...]:
        return st.unpack(self.take(st.size))

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.buf):
            raise TruncatedPayload(
                f"{self.what}: needs {n} bytes at offset {self.pos}, "
                f"only {len(self.buf) - self.pos} left"
            )
        out = self.buf[self.pos : end]
        self.pos = end
        return out

    def align(self) -> None:
        self.take(-self.pos % _ALIGN)

    @property
    def left(self) -> int:
        return len(self.buf) - self.pos


@dataclass(frozen=True)
class _Preamble:
    header: PayloadHeader
    raw_len: int
    comp_len: int
    digest: bytes
    body_offset: int


def _read_preamble(mv: memoryview) -> _Preamble:
    r = _Reader(mv, "preamble")
    magic, version = r.unpack(_PRE_ID)
    if magic != MAGIC:
        raise BadMagic(f"not a KubeRefit payload (magic {bytes(mv[:4])!r})")
    if version != CODEC_VERSION:
        raise UnsupportedVersion(f"codec version {version}; this decoder reads {CODEC_VERSION}")
    flags, producer, payload_id, order, raw_len, comp_len, digest, alen = r.unpack(_PRE_REST)
    if flags != 0:
        raise SchemaError(f"unknown preamble flags {flags:#x}")
    if alen > MAX_ATTEMPT_BYTES:
        raise SizeLimitExceeded(f"attempt id of {alen} bytes")
    attempt = _utf8(r.take(alen), "attempt id")
    header = PayloadHeader(version, attempt, producer, payload_id, order)
    return _Preamble(header, raw_len, comp_len, bytes(digest), r.pos)


def peek_header(data: bytes | bytearray | memoryview) -> PayloadHeader:
    """The payload's identity from the plain preamble, without checking or decompressing."""
    return _read_preamble(memoryview(data).cast("B")).header


def decode_payload(
    data: bytes | bytearray | memoryview,
    *,
    expected_digest: bytes | None = None,
    body_hash: bytes | None = None,
    known: Mapping[str, TensorMeta] | None = None,
    limits: DecodeLimits | None = None,
) -> DecodedPayload:
    """Validate and decode untrusted payload bytes; raises a `CodecError` subclass if malformed.

    `expected_digest` is the digest announced out of band (manifest, frame metadata); `known`
    the receiver's canonical metadata, which every item must match. `body_hash` is for a caller
    that already computed the BLAKE2b-128 of exactly these compressed bytes (a relay node checks
    it on arrival): it is then compared instead of computed again.
    """
    lim = limits or DEFAULT_LIMITS
    mv = memoryview(data).cast("B")
    pre = _read_preamble(mv)
    comp = mv[pre.body_offset :]
    if len(comp) < pre.comp_len:
        raise TruncatedPayload(f"body has {len(comp)} of {pre.comp_len} declared bytes")
    if len(comp) > pre.comp_len:
        raise SchemaError(f"{len(comp) - pre.comp_len} bytes after the declared body")
    digest = (
        bytes(body_hash)
        if body_hash is not None
        else hashlib.blake2b(comp, digest_size=DIGEST_SIZE).digest()
    )
    if digest != pre.digest:
        raise DigestMismatch("compressed body does not match its BLAKE2b-128 digest")
    if expected_digest is not None and bytes(expected_digest) != digest:
        raise DigestMismatch("payload digest differs from the announced digest")
    if pre.raw_len > lim.max_raw_bytes:
        raise SizeLimitExceeded(f"raw body of {pre.raw_len} bytes > limit {lim.max_raw_bytes}")
    if pre.raw_len > pre.comp_len * ZSTD_MAX_RATIO:
        raise SizeLimitExceeded(
            f"raw body of {pre.raw_len} bytes cannot come from {pre.comp_len} compressed bytes"
        )
    raw = _decompress(comp, pre.raw_len)
    items = _parse_body(memoryview(raw), raw, pre.header, known, lim)
    return DecodedPayload(pre.header, items, digest, pre.raw_len)


def _decompress(comp: memoryview, raw_len: int) -> bytearray:
    """Exactly one zstd frame whose content size is `raw_len`, into a new writable buffer."""
    if bytes(comp[:4]) != _ZSTD_MAGIC:
        raise DecompressionError("body is not a zstd frame")
    try:
        declared = zstandard.frame_content_size(comp)
    except zstandard.ZstdError as exc:
        raise DecompressionError(f"bad zstd frame header: {exc}") from exc
    if declared != raw_len:
        raise DecompressionError(f"zstd frame declares {declared} bytes, preamble {raw_len}")
    if _zstd_frame_length(comp) != len(comp):
        raise DecompressionError("bytes after the zstd frame")
    out = bytearray(raw_len)
    view = memoryview(out)
    got = 0
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(comp, read_across_frames=False)
        while got < raw_len:
            n = reader.readinto(view[got:])
            if n == 0:
                raise DecompressionError(f"zstd frame ended after {got} of {raw_len} bytes")
            got += n
        if reader.read(1):
            raise DecompressionError("zstd frame is longer than declared")
    except zstandard.ZstdError as exc:
        raise DecompressionError(f"corrupt zstd frame: {exc}") from exc
    return out


def _zstd_frame_length(comp: memoryview) -> int:
    """Compressed length of the first zstd frame, by walking its block headers."""
    try:
        pos = zstandard.frame_header_size(comp)
        has_checksum = zstandard.get_frame_parameters(comp).has_checksum
    except zstandard.ZstdError as exc:
        raise DecompressionError(f"bad zstd frame header: {exc}") from exc
    while True:
        if pos + 3 > len(comp):
            raise TruncatedPayload("zstd frame is truncated")
        block = int.from_bytes(comp[pos : pos + 3], "little")
        pos += 3
        kind = (block >> 1) & 3
        if kind == 3:
            raise DecompressionError("reserved zstd block type")
        pos += 1 if kind == 1 else block >> 3
        if block & 1:
            break
    pos += 4 if has_checksum else 0
    if pos > len(comp):
        raise TruncatedPayload("zstd frame is truncated")
    return pos


@dataclass(frozen=True)
class _Row:
    meta: TensorMeta
    op: Op
    kind: LocKind
    width: int
    count: int
    start: int
    loc_offset: int
    value_offset: int


def _parse_body(
    mv: memoryview,
    raw: bytearray,
    header: PayloadHeader,
    known: Mapping[str, TensorMeta] | None,
    lim: DecodeLimits,
) -> list[Item]:
    r = _Reader(mv, "body")
    magic, alen, producer, payload_id, order, n_items, n_loc, n_val, reserved = r.unpack(_BODY_HEAD)
    if magic != BODY_MAGIC or reserved != 0:
        raise SchemaError("bad body magic or reserved field")
    if alen > MAX_ATTEMPT_BYTES:
        raise SizeLimitExceeded(f"attempt id of {alen} bytes")
    attempt = _utf8(r.take(alen), "attempt id")
    if (attempt, producer, payload_id, order) != (
        header.attempt,
        header.producer,
        header.payload_id,
        header.order,
    ):
        raise HeaderMismatch("plain header differs from the digested header copy")
    if n_items > lim.max_items:
        raise SizeLimitExceeded(f"{n_items} items > limit {lim.max_items}")
    loc_groups = _read_groups(r, n_loc, "location", _location_width)
    val_groups = _read_groups(r, n_val, "value", _value_width)
    rows = _read_rows(r, n_items, known, lim, loc_groups, val_groups)
    r.align()
    loc_bufs = {w: _read_group_data(r, w, GAP_DTYPES[w], g) for w, g in loc_groups.items()}
    val_bufs = {
        c: _read_group_data(r, g.width, dtypes.np_value_dtype(dtypes.CODE_DTYPES[c]), g)
        for c, g in val_groups.items()
    }
    if r.left:
        raise SchemaError(f"{r.left} unexplained bytes at the end of the body")
    return [_make_item(row, loc_bufs, val_bufs) for row in rows]


@dataclass
class _Group:
    width: int
    shuffled: bool
    count: int
    cursor: int = 0


def _location_width(key: int) -> int | None:
    return key if key in GAP_DTYPES else None


def _value_width(key: int) -> int | None:
    dtype = dtypes.CODE_DTYPES.get(key)
    return None if dtype is None else dtypes.width(dtype)


def _read_groups(
    r: _Reader, n: int, what: str, width_of: Callable[[int], int | None]
) -> dict[int, _Group]:
    groups: dict[int, _Group] = {}
    last = -1
    for _ in range(n):
        key, shuffled, count = r.unpack(_GROUP)
        w = width_of(key)
        if w is None:
            raise SchemaError(f"unknown {what} group key {key}")
        if key <= last:
            raise SchemaError(f"{what} groups must be sorted and unique")
        if shuffled not in (0, 1):
            raise SchemaError(f"bad shuffle flag {shuffled}")
        if count == 0:
            raise SchemaError(f"empty {what} group")
        last = key
        groups[key] = _Group(w, bool(shuffled), count)
    return groups


def _read_rows(
    r: _Reader,
    n_items: int,
    known: Mapping[str, TensorMeta] | None,
    lim: DecodeLimits,
    loc_groups: dict[int, _Group],
    val_groups: dict[int, _Group],
) -> list[_Row]:
    rows: list[_Row] = []
    names: set[str] = set()
    for _ in range(n_items):
        name_len, code, op, kind, width, ndim, count, start, loc_off, val_off = r.unpack(_ITEM)
        if ndim > lim.max_ndim:
            raise SizeLimitExceeded(f"{ndim} dimensions > limit {lim.max_ndim}")
        shape = tuple(int(r.unpack(_DIM)[0]) for _ in range(ndim))
        if name_len == 0 or name_len > lim.max_name_bytes:
            raise SchemaError(f"tensor name of {name_len} bytes")
        name = _utf8(r.take(name_len), "tensor name")
        if name in names:
            raise SchemaError(f"{name}: appears twice in one payload")
        names.add(name)
        meta = TensorMeta(name, shape, dtypes.dtype_from_code(code))
        numel = _checked_numel(meta)
        if known is not None:
            expected = known.get(name)
            if expected is None:
                raise MetaMismatch(f"{name}: not a known canonical tensor")
            if expected != meta:
                raise MetaMismatch(
                    f"{name}: payload says {meta.dtype}{meta.shape}, "
                    f"canonical is {expected.dtype}{expected.shape}"
                )
        if op not in (Op.XOR, Op.OVERWRITE):
            raise SchemaError(f"{name}: unknown op {op}")
        if not 1 <= count <= numel:
            raise SchemaError(f"{name}: {count} changes in a tensor of {numel} elements")
        vg = val_groups.get(code)
        if vg is None or val_off != vg.cursor or val_off + count > vg.count:
            raise SchemaError(f"{name}: value offset {val_off} does not tile its group")
        vg.cursor += count
        if kind == LocKind.RANGE:
            if width or loc_off:
                raise SchemaError(f"{name}: a range has no location bytes")
            if start + count > numel:
                raise LocationError(f"{name}: run [{start}, {start + count}) outside {numel}")
        elif kind == LocKind.GAPS:
            lg = loc_groups.get(width)
            if lg is None or loc_off != lg.cursor or loc_off + count - 1 > lg.count:
                raise SchemaError(f"{name}: location offset {loc_off} does not tile its group")
            lg.cursor += count - 1
        else:
            raise SchemaError(f"{name}: unknown location kind {kind}")
        rows.append(_Row(meta, Op(op), LocKind(kind), width, count, start, loc_off, val_off))
    for what, groups in (("location", loc_groups), ("value", val_groups)):
        for key, g in groups.items():
            if g.cursor != g.count:
                raise SchemaError(f"{what} group {key}: items use {g.cursor} of {g.count}")
    return rows


def _read_group_data(
    r: _Reader, width: int, dtype: np.dtype[np.generic], g: _Group
) -> npt.NDArray[np.generic]:
    nbytes = g.count * width
    if nbytes > r.left:
        raise TruncatedPayload(f"group declares {nbytes} bytes, {r.left} left")
    start = r.pos
    r.take(nbytes)
    r.align()
    planes = np.frombuffer(r.buf, dtype=np.uint8, count=nbytes, offset=start)
    if g.shuffled and width > 1:
        return unshuffle(planes, dtype)
    return planes.view(dtype)


def _make_item(
    row: _Row,
    loc_bufs: dict[int, npt.NDArray[np.generic]],
    val_bufs: dict[int, npt.NDArray[np.generic]],
) -> Item:
    meta = row.meta
    values = val_bufs[dtypes.dtype_code(meta.dtype)][
        row.value_offset : row.value_offset + row.count
    ]
    if meta.dtype == torch.bool and int(values.view(np.uint8).max()) > 1:
        raise SchemaError(f"{meta.name}: bool values must be 0 or 1")
    try:
        if row.kind is LocKind.RANGE:
            return Item(meta, row.op, row.start, None, torch.from_numpy(values))
        gaps = loc_bufs[row.width][row.loc_offset : row.loc_offset + row.count - 1]
        positions = decode_gaps(row.start, gaps, meta.numel)
        return Item(meta, row.op, None, torch.from_numpy(positions), torch.from_numpy(values))
    except LocationError as exc:
        raise LocationError(f"{meta.name}: {exc}") from exc
    except ValueError as exc:  # pragma: no cover - everything Item checks was checked above
        raise SchemaError(f"{meta.name}: {exc}") from exc


def _checked_numel(meta: TensorMeta) -> int:
    numel = 1
    for d in meta.shape:
        numel *= d
        if numel >= MAX_NUMEL:
            raise SizeLimitExceeded(f"{meta.name}: shape {meta.shape} is too large")
    return numel


def _utf8(buf: memoryview, what: str) -> str:
    try:
        return bytes(buf).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SchemaError(f"{what} is not valid UTF-8") from exc


__all__ = [
    "CODEC_VERSION",
    "CodecConfig",
    "CodecError",
    "DecodeLimits",
    "DecodedPayload",
    "EncodedPayload",
    "PayloadHeader",
    "PreparedItem",
    "decode_payload",
    "encode_payload",
    "peek_header",
    "prepare_item",
    "seal_body",
]
