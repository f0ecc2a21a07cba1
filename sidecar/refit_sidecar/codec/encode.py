"""❸ encode — items into one sealed payload of wire format v1 (`codec.wire`).

Items are checked and their locations encoded (`prepare_item`, done in parallel by the producer
pipeline), then serialized into one reused raw buffer, byte-plane shuffled, compressed with zstd
in one call and sealed with the preamble and the BLAKE2b-128 digest of the compressed body.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import zstandard

from refit_sidecar.codec import dtypes
from refit_sidecar.codec.locations import (
    EncodedLocations,
    LocKind,
    encode_positions,
    encode_run,
)
from refit_sidecar.codec.records import Item, check_limits
from refit_sidecar.codec.wire import (
    ALIGN,
    BODY_HEAD,
    BODY_MAGIC,
    CODEC_VERSION,
    DEFAULT_CODEC,
    DIGEST_SIZE,
    DIM,
    FLAG_MAC,
    GROUP_ROW,
    ITEM_ROW,
    MAGIC,
    PRE_ID,
    PRE_REST,
    CodecConfig,
    EncodedPayload,
    PayloadHeader,
    payload_mac,
)


@dataclass(frozen=True)
class PreparedItem:
    """An item with its wire-form locations, so producers can do that work in parallel."""

    item: Item
    locations: EncodedLocations


def prepare_item(item: Item) -> PreparedItem:
    """Check an item for encoding and compute its location encoding (run or gaps)."""
    meta = item.meta
    dtypes.dtype_code(meta.dtype)
    check_limits(meta)
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
    mac_key: bytes | None = None,
) -> EncodedPayload:
    """Serialize and compress `items` (names unique, each with at least one change); with
    `mac_key` (`refit_protocol.keys.payload_mac_key` of the policy's token) the payload also
    carries the keyed BLAKE3 MAC that keyed receivers require."""
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
        check_limits(meta)  # before anything is packed (a PreparedItem may be built by hand)
        name = meta.name.encode()
        if meta.name in names or not name:
            raise ValueError(f"{meta.name!r}: tensor names must be unique and not empty")
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
            ITEM_ROW.pack(
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
            + b"".join(DIM.pack(d) for d in meta.shape)
            + name
        )
    attempt = header.attempt.encode()
    parts: list[bytes] = [
        BODY_HEAD.pack(
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
    parts += [GROUP_ROW.pack(w, int(shuffled and w > 1), loc_counts[w]) for w in loc_keys]
    parts += [
        GROUP_ROW.pack(c, int(shuffled and dtypes.width(dtypes.CODE_DTYPES[c]) > 1), val_counts[c])
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
        return _seal(
            header, raw.data, level=cfg.zstd_level, threads=cfg.zstd_threads or 0, mac_key=mac_key
        )


def _padded(n: int) -> int:
    return n + (-n % ALIGN)


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
    mac_key: bytes | None = None,
) -> EncodedPayload:
    """Compress raw body bytes (given in parts) and frame them with the preamble, the digest
    and, with `mac_key`, the MAC.

    Tests use it to wrap deliberately malformed bodies in a valid frame so that the body parser
    itself gets fuzzed.
    """
    raw = b"".join(memoryview(p).cast("B") for p in raw_parts)
    return _seal(header, memoryview(raw), level=level, threads=threads, mac_key=mac_key)


def _seal(
    header: PayloadHeader,
    raw: memoryview,
    *,
    level: int,
    threads: int,
    mac_key: bytes | None = None,
) -> EncodedPayload:
    """Compress `raw` and prepend the preamble: BLAKE2b-128 digest of the compressed body and,
    with a key, flag bit 0 and the keyed BLAKE3 MAC of the preamble before it and the body."""
    raw_len = raw.nbytes
    comp = zstandard.ZstdCompressor(level=level, threads=threads).compress(raw)
    digest = hashlib.blake2b(comp, digest_size=DIGEST_SIZE).digest()
    attempt = header.attempt.encode()
    signed = (
        PRE_ID.pack(MAGIC, header.codec_version)
        + PRE_REST.pack(
            FLAG_MAC if mac_key is not None else 0,
            header.producer,
            header.payload_id,
            header.order,
            raw_len,
            len(comp),
            digest,
            len(attempt),
        )
        + attempt
    )
    mac = payload_mac(mac_key, signed, comp) if mac_key is not None else b""
    return EncodedPayload(header=header, body=signed + mac + comp, digest=digest, raw_size=raw_len)
