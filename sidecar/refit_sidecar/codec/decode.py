"""❺ validate — decode untrusted payload bytes of wire format v1 (`codec.wire`).

Parses with `struct` and `numpy.frombuffer` only (never pickle or torch.load), checks every
declared size against the bytes actually present and the configured limits before allocating
or decompressing, checks the digest and the identity copy, every item against the receiver's
canonical metadata, every location against its tensor, and raises a `CodecError` subclass for
anything malformed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import zstandard

from refit_sidecar.codec import dtypes
from refit_sidecar.codec.errors import (
    DecompressionError,
    DigestMismatch,
    HeaderMismatch,
    LocationError,
    MetaMismatch,
    SchemaError,
    SizeLimitExceeded,
    TruncatedPayload,
)
from refit_sidecar.codec.locations import (
    GAP_DTYPES,
    MAX_NUMEL,
    LocKind,
    decode_gaps,
    unshuffle,
)
from refit_sidecar.codec.records import Item, Op, TensorMeta
from refit_sidecar.codec.wire import (
    BODY_HEAD,
    BODY_MAGIC,
    DEFAULT_LIMITS,
    DIGEST_SIZE,
    DIM,
    GROUP_ROW,
    ITEM_ROW,
    MAX_ATTEMPT_BYTES,
    ZSTD_MAGIC,
    ZSTD_MAX_RATIO,
    DecodedPayload,
    DecodeLimits,
    PayloadHeader,
    Reader,
    read_preamble,
    utf8,
)


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
    pre = read_preamble(mv)
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
    if bytes(comp[:4]) != ZSTD_MAGIC:
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
    r = Reader(mv, "body")
    magic, alen, producer, payload_id, order, n_items, n_loc, n_val, reserved = r.unpack(BODY_HEAD)
    if magic != BODY_MAGIC or reserved != 0:
        raise SchemaError("bad body magic or reserved field")
    if alen > MAX_ATTEMPT_BYTES:
        raise SizeLimitExceeded(f"attempt id of {alen} bytes")
    attempt = utf8(r.take(alen), "attempt id")
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
    r: Reader, n: int, what: str, width_of: Callable[[int], int | None]
) -> dict[int, _Group]:
    groups: dict[int, _Group] = {}
    last = -1
    for _ in range(n):
        key, shuffled, count = r.unpack(GROUP_ROW)
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
    r: Reader,
    n_items: int,
    known: Mapping[str, TensorMeta] | None,
    lim: DecodeLimits,
    loc_groups: dict[int, _Group],
    val_groups: dict[int, _Group],
) -> list[_Row]:
    rows: list[_Row] = []
    names: set[str] = set()
    for _ in range(n_items):
        name_len, code, op, kind, width, ndim, count, start, loc_off, val_off = r.unpack(ITEM_ROW)
        if ndim > lim.max_ndim:
            raise SizeLimitExceeded(f"{ndim} dimensions > limit {lim.max_ndim}")
        shape = tuple(int(r.unpack(DIM)[0]) for _ in range(ndim))
        if name_len == 0 or name_len > lim.max_name_bytes:
            raise SchemaError(f"tensor name of {name_len} bytes")
        name = utf8(r.take(name_len), "tensor name")
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
    r: Reader, width: int, dtype: np.dtype[np.generic], g: _Group
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
