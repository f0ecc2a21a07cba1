"""❺ validate — decode untrusted payload bytes of wire format v1 (`codec.wire`).

Parses with `struct` and `numpy.frombuffer` only (never pickle or torch.load). With a key, the
MAC is checked first (`verify_mac`), before anything else is trusted. Every declared size is
checked against the bytes actually present, the configured limits and what the receiver's
canonical tensors can need before anything is decompressed; decompression then allocates only
as output arrives and stops as soon as the frame produces more than it declared. The digest and
the identity copy are checked, every item against the receiver's canonical metadata, every
location against its tensor, and anything malformed raises a `CodecError` subclass.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import zstandard

from refit_sidecar.codec import dtypes
from refit_sidecar.codec.errors import (
    AuthenticationError,
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
    ALIGN,
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
    Preamble,
    Reader,
    payload_mac,
    read_preamble,
    utf8,
)

#: The most one zstd block can decode to (the format's Block_Maximum_Size).
ZSTD_BLOCK_MAX = 128 << 10
#: A frame may have at most `decoded bytes // ZSTD_MIN_BLOCK_AVG + ZSTD_BLOCK_SLACK` blocks at
#: any point of its decoding. zstd cuts a frame into blocks of 128 KiB and, with block
#: splitting (high levels), a block into at most 196 pieces of at least ~450 bytes, so a real
#: frame stays far below this; a frame of empty blocks is refused after a few of them, and
#: walking block headers costs at most one step per 256 decoded bytes.
ZSTD_MIN_BLOCK_AVG = 256
ZSTD_BLOCK_SLACK = 16


def decode_payload(
    data: bytes | bytearray | memoryview,
    *,
    expected_digest: bytes | None = None,
    body_hash: bytes | None = None,
    known: Mapping[str, TensorMeta] | None = None,
    limits: DecodeLimits | None = None,
    mac_key: MacKeys = None,
    raw_limit: int | None = None,
) -> DecodedPayload:
    """Validate and decode untrusted payload bytes; raises a `CodecError` subclass if malformed.

    `raw_limit`: `raw_bound(known)` computed once by a caller that decodes many payloads
    against the same `known` (it is a pass over every known tensor).

    `mac_key` (`refit_protocol.keys.payload_mac_key` of the policy's token, or several during a
    token rotation): the payload must carry a MAC made with one of them (`AuthenticationError`
    otherwise, before the body is hashed or decompressed); without a key a MAC is skipped,
    unchecked. `expected_digest` is the digest
    announced out of band (manifest, frame metadata); `known` the receiver's canonical metadata,
    which every item must match and which bounds the raw body's size. `body_hash` is for a
    caller that already checked these compressed bytes against their digest (a relay node on
    arrival): it is then compared instead of computed again. A verified MAC covers the
    preamble's digest and every compressed byte, so with a key the digest is not recomputed
    either (a BLAKE2b pass, ~1 GB/s per core, would prove nothing the MAC has not).
    """
    lim = limits or DEFAULT_LIMITS
    mv = memoryview(data).cast("B")
    pre = read_preamble(mv)
    keys = mac_keys(mac_key)
    if keys:
        _check_mac(mv, pre, keys)
    comp = mv[pre.body_offset :]
    if len(comp) < pre.comp_len:
        raise TruncatedPayload(f"body has {len(comp)} of {pre.comp_len} declared bytes")
    if len(comp) > pre.comp_len:
        raise SchemaError(f"{len(comp) - pre.comp_len} bytes after the declared body")
    if body_hash is not None:
        digest = bytes(body_hash)
    elif keys:  # the MAC covers the preamble's digest and every compressed byte
        digest = pre.digest
    else:
        digest = hashlib.blake2b(comp, digest_size=DIGEST_SIZE).digest()
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
    if known is not None:
        bound = raw_limit if raw_limit is not None else raw_bound(known)
        if pre.raw_len > bound:
            raise SizeLimitExceeded(
                f"raw body of {pre.raw_len} bytes > {bound}, the most the canonical tensors allow"
            )
    raw = _decompress(comp, pre.raw_len)
    items = _parse_body(memoryview(raw), pre.header, known, lim)
    return DecodedPayload(pre.header, items, digest, pre.raw_len)


#: One MAC key, the keys accepted during a token rotation (the sending one first), or none.
MacKeys = bytes | Sequence[bytes] | None


def mac_keys(keys: MacKeys) -> tuple[bytes, ...]:
    """`keys` as a tuple (empty: no MAC is required)."""
    if keys is None:
        return ()
    if isinstance(keys, bytes | bytearray):
        return (bytes(keys),)
    return tuple(keys)


def verify_mac(data: bytes | bytearray | memoryview, key: bytes | Sequence[bytes]) -> None:
    """Check a payload's MAC with `key` (or any of several) without decoding it (a relay node
    on arrival).

    Reads only the plain preamble and hashes the rest; raises `AuthenticationError` when the
    payload has no MAC or one that no key made (any altered byte of the preamble before the MAC
    or of the compressed body), another `CodecError` for an unreadable preamble, and ValueError
    for a key that is not 32 bytes.
    """
    mv = memoryview(data).cast("B")
    _check_mac(mv, read_preamble(mv), mac_keys(key))


def _check_mac(mv: memoryview, pre: Preamble, keys: tuple[bytes, ...]) -> None:
    if pre.mac is None:
        raise AuthenticationError("payload carries no MAC and this receiver requires one")
    for key in keys:  # at most two during a rotation; the sending key is tried first
        expected = payload_mac(key, mv[: pre.signed_len], mv[pre.body_offset :])
        if hmac.compare_digest(expected, pre.mac):
            return
    raise AuthenticationError("payload MAC does not verify: another key, or altered bytes")


def raw_bound(known: Mapping[str, TensorMeta], attempt_len: int = MAX_ATTEMPT_BYTES) -> int:
    """The largest raw body a valid payload of tensors from `known` can have.

    Every item names a distinct known tensor (names are unique in a payload and must be known),
    so a payload holds each tensor at most once. An item of `numel` elements of width `w` has at
    most `numel` values (`numel * w` bytes) and `numel - 1` gaps of at most 8 bytes, and its row
    takes `ITEM_ROW + 8 * ndim + len(name)` bytes. Add the body header, the attempt id, one
    table row per possible group (4 gap widths, every dtype code) and the padding of the table
    and of every group to 8 bytes.
    """
    n_groups = len(GAP_DTYPES) + len(dtypes.CODE_DTYPES)
    total = BODY_HEAD.size + attempt_len + n_groups * GROUP_ROW.size + (n_groups + 1) * (ALIGN - 1)
    for meta in known.values():
        total += ITEM_ROW.size + DIM.size * len(meta.shape) + len(meta.name.encode())
        total += meta.numel * (dtypes.width(meta.dtype) + 8)
    return total


def _decompress(comp: memoryview, raw_len: int) -> bytes:
    """Exactly one zstd frame that decodes to exactly `raw_len` bytes, and nothing after it.

    The frame's block headers are walked to feed the decoder a few whole blocks at a time: at
    most as many as can still be needed (each decodes to at most 128 KiB), so output never
    runs more than one block past `raw_len` before it is refused, memory grows only with the
    bytes actually decoded, and the number of blocks is held to what the decoded bytes justify.
    The walk also finds where the frame ends, which must be the end of the body.
    """
    if bytes(comp[:4]) != ZSTD_MAGIC:
        raise DecompressionError("body is not a zstd frame")
    try:
        params = zstandard.get_frame_parameters(comp)
        pos = zstandard.frame_header_size(comp)
    except zstandard.ZstdError as exc:
        raise DecompressionError(f"bad zstd frame header: {exc}") from exc
    if params.content_size != raw_len:
        raise DecompressionError(
            f"zstd frame declares {params.content_size} bytes, preamble {raw_len}"
        )
    end = len(comp)
    dobj = zstandard.ZstdDecompressor().decompressobj()
    chunks: list[bytes] = []
    got = blocks = fed = 0
    last = False
    while not last:
        for _ in range(max(1, -(-(raw_len - got) // ZSTD_BLOCK_MAX))):
            if pos + 3 > end:
                raise TruncatedPayload("zstd frame is truncated")
            block = int.from_bytes(comp[pos : pos + 3], "little")
            kind = (block >> 1) & 3
            if kind == 3:
                raise DecompressionError("reserved zstd block type")
            pos += 3 + (1 if kind == 1 else block >> 3)
            blocks += 1
            last = bool(block & 1)
            if last:
                pos += 4 if params.has_checksum else 0
                break
        if pos > end:
            raise TruncatedPayload("zstd frame is truncated")
        try:
            out = dobj.decompress(comp[fed:pos])
        except zstandard.ZstdError as exc:
            raise DecompressionError(f"corrupt zstd frame: {exc}") from exc
        fed = pos
        got += len(out)
        if got > raw_len:
            raise DecompressionError(f"zstd frame decodes to more than {raw_len} bytes")
        if out:
            chunks.append(out)
        if blocks > got // ZSTD_MIN_BLOCK_AVG + ZSTD_BLOCK_SLACK:
            raise DecompressionError(f"{blocks} zstd blocks for {got} decoded bytes")
    if pos != end:
        raise DecompressionError(f"{end - pos} bytes after the zstd frame")
    if got != raw_len or not dobj.eof:
        raise DecompressionError(f"zstd frame ended after {got} of {raw_len} bytes")
    return b"".join(chunks)


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
    # Gaps are only read (positions are new arrays); values become the items' tensors, so a
    # group that is a view of the (read-only) raw body is copied.
    loc_bufs = {w: _read_group_data(r, w, GAP_DTYPES[w], g) for w, g in loc_groups.items()}
    val_bufs = {
        c: _writable(_read_group_data(r, g.width, dtypes.np_value_dtype(dtypes.CODE_DTYPES[c]), g))
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


def _writable(a: npt.NDArray[np.generic]) -> npt.NDArray[np.generic]:
    return a if a.flags.writeable else a.copy()


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
        # The structural bound of the location arithmetic (2**62); the shared, much lower
        # limit (refit_protocol.limits) holds through `known`: every item must match a tensor
        # the receiver holds, whose meta was checked against it.
        if numel >= MAX_NUMEL:
            raise SizeLimitExceeded(f"{meta.name}: shape {meta.shape} is too large")
    return numel
