"""Issue 15 (hostile input), part C: seeded, bounded fuzzing of `decode_payload`.

Whatever the bytes — mutated, truncated or spliced valid payloads, random bodies behind a valid
preamble (with a correct digest and MAC, so they reach decompression), random zstd frames — the
decoder raises a `CodecError` subclass and nothing else (no struct.error, IndexError,
OverflowError, MemoryError, plain ValueError...), and each decode is bounded in time. Valid
payloads round-trip bit-exactly, with and without a key. In CI the "ci" hypothesis profile
(tests/conftest.py) makes every run draw the same examples.
"""

from __future__ import annotations

import contextlib
import struct
import time

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refit_sidecar.codec import (
    CodecConfig,
    CodecError,
    Item,
    Op,
    PayloadHeader,
    TensorMeta,
    decode_payload,
    encode_payload,
)
from refit_sidecar.codec import dtypes as codec_dtypes
from tests.sidecar.codec.craft import (
    HEADER,
    KEY,
    ZSTD_MAGIC,
    body_offset,
    frame_header,
    payload,
    raw_block,
    rle_block,
)
from tests.sidecar.codec.items import same_bits

#: Per-decode CPU-time bound: the payloads here are a few KiB, a real decode takes milliseconds.
DECODE_S = 2.0
FUZZ = settings(
    max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.int32,
    torch.int64,
    torch.float64,
    torch.float8_e4m3fn,
]


def _values(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, n, dtype=np.uint8))
    np_dtype = codec_dtypes.np_value_dtype(dtype)
    raw = rng.integers(0, 256, n * np_dtype.itemsize, dtype=np.uint8)
    return torch.from_numpy(raw.view(np_dtype).copy())


@st.composite
def items(draw: st.DrawFn) -> list[Item]:
    out = []
    for k in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(DTYPES))
        if draw(st.integers(0, 5)) == 0:  # sparse in a huge tensor: 4- and 8-byte gaps
            shape: tuple[int, ...] = (draw(st.sampled_from([70_000, 2**33 + 5])),)
        else:
            shape = tuple(draw(st.lists(st.integers(1, 12), min_size=1, max_size=3)))
        meta = TensorMeta(f"layer.{k}.w", shape, dtype)
        numel = meta.numel
        op = draw(st.sampled_from([Op.XOR, Op.OVERWRITE]))
        seed = draw(st.integers(0, 2**32 - 1))
        if draw(st.booleans()):
            start = draw(st.integers(0, numel - 1))
            count = draw(st.integers(1, min(numel - start, 2000)))
            out.append(Item(meta, op, start, None, _values(dtype, count, seed)))
        else:
            most = min(numel, 40)
            chosen = sorted(draw(st.sets(st.integers(0, numel - 1), min_size=1, max_size=most)))
            locs = torch.tensor(chosen, dtype=torch.int64)
            out.append(Item(meta, op, None, locs, _values(dtype, len(chosen), seed)))
    return out


def _decode_typed(data: bytes, key: bytes | None) -> None:
    """Decode; only a CodecError may come out, and quickly."""
    t0 = time.thread_time()  # CPU time: what the decode costs, however loaded the machine
    with contextlib.suppress(CodecError):
        decode_payload(data, mac_key=key)
    elapsed = time.thread_time() - t0
    assert elapsed < DECODE_S, f"decode took {elapsed:.2f} s"


def _valid(key: bytes | None, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    metas = [
        TensorMeta("a", (40, 30), torch.bfloat16),
        TensorMeta("b", (500,), torch.uint8),
        TensorMeta("c", (7000,), torch.float32),
        TensorMeta("d", (64,), torch.bool),
    ]
    it = [
        Item(
            metas[0], Op.XOR, None, torch.tensor([1, 7, 300, 1199]), _values(metas[0].dtype, 4, 1)
        ),
        Item(metas[1], Op.OVERWRITE, 10, None, _values(metas[1].dtype, 50, 2)),
        Item(
            metas[2],
            Op.XOR,
            None,
            torch.sort(torch.randperm(7000, generator=g)[:300]).values,
            _values(metas[2].dtype, 300, 3),
        ),
        Item(metas[3], Op.OVERWRITE, None, torch.tensor([0, 5, 63]), _values(torch.bool, 3, 4)),
    ]
    return encode_payload(HEADER, it, mac_key=key).body


VALID = {None: _valid(None), KEY: _valid(KEY)}
OTHER = _valid(KEY, seed=1)
INTERESTING = [0, 1, 7, 8, 255, 2**16 - 1, 2**31, 2**32 - 1, 2**32 + 1, 2**62, 2**63, 2**64 - 1]


@st.composite
def mutated(draw: st.DrawFn, base: bytes) -> bytes:
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["flip", "byte", "int", "cut", "insert", "delete", "splice"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "byte" and data:
            data[pos] = draw(st.integers(0, 255))
        elif kind == "int":
            fmt = draw(st.sampled_from(["<H", "<I", "<Q"]))
            size = struct.calcsize(fmt)
            value = draw(st.sampled_from(INTERESTING)) % (1 << (8 * size))
            if pos + size <= len(data):
                struct.pack_into(fmt, data, pos, value)
        elif kind == "cut":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=32))
        elif kind == "delete":
            del data[pos : pos + draw(st.integers(1, 64))]
        else:
            start = draw(st.integers(0, len(OTHER) - 1))
            data[pos:] = OTHER[start:]
    return bytes(data)


@FUZZ
@given(data=st.data(), keyed=st.booleans(), check_key=st.booleans())
def test_mutated_payloads_raise_only_typed_errors(
    data: st.DataObject, keyed: bool, check_key: bool
) -> None:
    base = VALID[KEY if keyed else None]
    _decode_typed(data.draw(mutated(base)), KEY if check_key else None)


@FUZZ
@given(data=st.data(), keyed=st.booleans(), raw_delta=st.sampled_from([0, 0, 0, 1, -1]))
def test_mutated_frames_behind_a_valid_digest_and_mac_raise_only_typed_errors(
    data: st.DataObject, keyed: bool, raw_delta: int
) -> None:
    """The compressed body of a valid payload mutated, then sealed again (digest and MAC
    recomputed): zstd and the body parser see the damage, not the integrity checks."""
    base = VALID[None]
    (raw_len,) = struct.unpack_from("<Q", base, 28)
    comp = base[body_offset(base) :]
    keep = data.draw(st.sampled_from([0, 4, 13, 13]))  # often leave the frame header alone
    comp = comp[:keep] + data.draw(mutated(comp[keep:]))
    key = KEY if keyed else None
    _decode_typed(payload(comp, max(raw_len + raw_delta, 0), key=key), key)


@FUZZ
@given(
    body=st.binary(max_size=600),
    magic=st.booleans(),
    raw_len=st.one_of(st.integers(0, 4096), st.sampled_from(INTERESTING)),
    keyed=st.booleans(),
)
def test_random_bodies_behind_a_valid_preamble_raise_only_typed_errors(
    body: bytes, magic: bool, raw_len: int, keyed: bool
) -> None:
    """A correct digest (and MAC): the decoder gets past every preamble check into the frame."""
    comp = (ZSTD_MAGIC + body) if magic else body
    key = KEY if keyed else None
    _decode_typed(payload(comp, raw_len, key=key), key)


@st.composite
def frames(draw: st.DrawFn) -> tuple[bytes, int]:
    """Hand-built zstd frames from random blocks: raw, RLE, compressed (random content),
    reserved, with random sizes, content size, checksum flag and trailing bytes."""
    content = draw(st.one_of(st.integers(0, 1 << 20), st.sampled_from(INTERESTING)))
    checksum = draw(st.booleans())
    out = frame_header(content, checksum=checksum)
    for i in range(n := draw(st.integers(0, 8))):
        last = i == n - 1 and draw(st.integers(0, 9)) > 0
        kind = draw(st.sampled_from(["raw", "rle", "compressed", "reserved", "empty"]))
        if kind == "raw":
            out += raw_block(draw(st.binary(max_size=300)), last=last)
        elif kind == "rle":
            out += rle_block(draw(st.integers(0, 255)), draw(st.integers(0, 1 << 17)), last=last)
        elif kind == "empty":
            out += raw_block(b"", last=last)
        else:
            blob = draw(st.binary(max_size=300))
            block_type = 2 if kind == "compressed" else 3
            size = draw(st.sampled_from([len(blob), draw(st.integers(0, (1 << 21) - 1))]))
            out += (int(last) | (block_type << 1) | (size << 3)).to_bytes(3, "little") + blob
    if checksum:
        out += draw(st.binary(min_size=0, max_size=4))
    out += draw(st.sampled_from([b"", b"\0", ZSTD_MAGIC]))
    raw_len = draw(st.sampled_from([content, min(content + 1, 2**64 - 1), max(content - 1, 0)]))
    return out, raw_len


@FUZZ
@given(frame=frames(), keyed=st.booleans())
def test_random_zstd_frames_raise_only_typed_errors(frame: tuple[bytes, int], keyed: bool) -> None:
    comp, raw_len = frame
    key = KEY if keyed else None
    _decode_typed(payload(comp, raw_len, key=key), key)


@settings(max_examples=300, deadline=None, database=None)
@given(
    its=items(),
    keyed=st.booleans(),
    shuffle=st.booleans(),
    level=st.sampled_from([1, 3, 19]),
    threads=st.sampled_from([0, 2]),
)
def test_valid_payloads_round_trip_bit_exactly(
    its: list[Item], keyed: bool, shuffle: bool, level: int, threads: int
) -> None:
    key = KEY if keyed else None
    cfg = CodecConfig(shuffle=shuffle, zstd_level=level, zstd_threads=threads)
    header = PayloadHeader(1, "fuzz-attempt", 3, 17, 5)
    p = encode_payload(header, its, config=cfg, mac_key=key)
    known = {i.meta.name: i.meta for i in its}
    decoded = decode_payload(p.body, expected_digest=p.digest, known=known, mac_key=key)
    assert decoded.header == header
    assert same_bits(decoded.items, its)
    for d in decoded.items:
        assert d.values.numpy().flags.writeable  # tensors of their own, not views of bytes
    if keyed:  # a keyless decoder (tests, benches) reads it too
        assert same_bits(decode_payload(p.body).items, its)
