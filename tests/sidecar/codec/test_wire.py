"""Wire format v1 against malformed and hostile input: typed errors only, bounded work.

Raw bodies are built here with the struct layouts of docs/wire-format.md (an independent reading
of the spec) and sealed in a valid frame with `seal_body`, so the body parser is exercised behind
a correct digest.
"""

from __future__ import annotations

import hashlib
import struct
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refit_sidecar.codec import (
    BadMagic,
    CodecError,
    DecodeLimits,
    DecompressionError,
    DigestMismatch,
    HeaderMismatch,
    Item,
    LocationError,
    MetaMismatch,
    Op,
    PayloadHeader,
    SchemaError,
    SizeLimitExceeded,
    TensorMeta,
    TruncatedPayload,
    UnsupportedVersion,
    decode_payload,
    encode_payload,
    seal_body,
)
from refit_sidecar.codec.encode import _ScratchPool

HEADER = PayloadHeader(1, "att", 2, 9, 4)
BODY_HEAD = struct.Struct("<4sHIQQIBBH")
GROUP = struct.Struct("<BB6xQ")
ITEM = struct.Struct("<HBBBBBxQQQQ")
BF16, U8, BOOL = 8, 2, 1  # dtype codes
XOR, OVERWRITE = 1, 2
RANGE, GAPS = 0, 1


def _pad(b: bytes) -> bytes:
    return b + bytes(-len(b) % 8)


def body(
    items: list[bytes],
    loc_groups: tuple[tuple[int, int, int], ...] = (),
    val_groups: tuple[tuple[int, int, int], ...] = (),
    data: bytes = b"",
    header: PayloadHeader = HEADER,
) -> bytes:
    attempt = header.attempt.encode()
    out = (
        BODY_HEAD.pack(
            b"KRB1",
            len(attempt),
            header.producer,
            header.payload_id,
            header.order,
            len(items),
            len(loc_groups),
            len(val_groups),
            0,
        )
        + attempt
    )
    out += b"".join(GROUP.pack(*g) for g in loc_groups)
    out += b"".join(GROUP.pack(*g) for g in val_groups)
    out += b"".join(items)
    return _pad(out) + data


def item(
    name: str,
    shape: tuple[int, ...],
    count: int,
    start: int,
    *,
    dtype: int = BF16,
    op: int = XOR,
    kind: int = RANGE,
    width: int = 0,
    loc_off: int = 0,
    val_off: int = 0,
) -> bytes:
    n = name.encode()
    row = ITEM.pack(len(n), dtype, op, kind, width, len(shape), count, start, loc_off, val_off)
    return row + b"".join(struct.pack("<Q", d) for d in shape) + n


def sealed(raw: bytes, header: PayloadHeader = HEADER) -> bytes:
    return seal_body(header, [raw]).body


def _bf16(values: list[int]) -> bytes:
    return _pad(np.array(values, dtype="<u2").tobytes())


def _valid_payload() -> bytes:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(40, 30, generator=gen, dtype=torch.bfloat16)
    b = torch.randint(0, 255, (500,), generator=gen, dtype=torch.uint8)
    items = [
        Item(
            TensorMeta("a", (40, 30), torch.bfloat16),
            Op.XOR,
            None,
            torch.tensor([1, 7, 300, 1199]),
            a.view(torch.int16).reshape(-1)[:4].clone(),
        ),
        Item(TensorMeta("b", (500,), torch.uint8), Op.OVERWRITE, 10, None, b[:50].clone()),
        Item(
            TensorMeta("c", (70000,), torch.float32),
            Op.XOR,
            None,
            torch.tensor([0, 69999]),
            torch.tensor([1, 2], dtype=torch.int32),
        ),
    ]
    return encode_payload(HEADER, items).body


VALID = _valid_payload()


def test_valid_payload_decodes() -> None:
    decoded = decode_payload(VALID)
    assert [i.meta.name for i in decoded.items] == ["a", "b", "c"]


def test_every_truncation_raises_a_typed_error() -> None:
    for cut in range(len(VALID)):
        with pytest.raises(CodecError):
            decode_payload(VALID[:cut])


def test_every_single_bit_flip_raises_a_typed_error() -> None:
    data = bytearray(VALID)
    for pos in range(len(data)):
        for bit in range(8):
            data[pos] ^= 1 << bit
            with pytest.raises(CodecError):
                decode_payload(bytes(data))
            data[pos] ^= 1 << bit


def test_body_flip_is_a_digest_mismatch_and_announced_digest_is_checked() -> None:
    data = bytearray(VALID)
    data[-3] ^= 0x40
    with pytest.raises(DigestMismatch):
        decode_payload(bytes(data))
    with pytest.raises(DigestMismatch):
        decode_payload(VALID, expected_digest=b"\0" * 16)


def test_preamble_errors() -> None:
    with pytest.raises(BadMagic):
        decode_payload(b"NOPE" + VALID[4:])
    with pytest.raises(UnsupportedVersion):
        decode_payload(VALID[:4] + struct.pack("<H", 2) + VALID[6:])
    with pytest.raises(SchemaError):
        decode_payload(VALID + b"x")  # bytes after the declared body
    with pytest.raises(TruncatedPayload):
        decode_payload(b"")


def _with_preamble_field(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    return data[:offset] + struct.pack(fmt, value) + data[offset + struct.calcsize(fmt) :]


RAW_LEN_AT = 4 + 2 + 2 + 4 + 8 + 8  # magic, version, flags, producer, payload, order
PREAMBLE = 62 + len(HEADER.attempt)


def test_declared_raw_size_beyond_what_the_body_can_hold_is_refused_before_allocating() -> None:
    tracemalloc.start()
    try:
        for raw_len in (1 << 40, 1 << 62):
            with pytest.raises(SizeLimitExceeded):
                decode_payload(_with_preamble_field(VALID, RAW_LEN_AT, "<Q", raw_len))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    with pytest.raises(SizeLimitExceeded):
        decode_payload(VALID, limits=DecodeLimits(max_raw_bytes=64))


def test_raw_size_that_disagrees_with_the_zstd_frame_is_refused() -> None:
    raw_len = struct.unpack_from("<Q", VALID, RAW_LEN_AT)[0]
    with pytest.raises(DecompressionError):
        decode_payload(_with_preamble_field(VALID, RAW_LEN_AT, "<Q", raw_len + 1))


def test_a_second_zstd_frame_is_refused() -> None:
    raw = body([item("w", (8,), 2, 0)], val_groups=((BF16, 0, 2),), data=_bf16([1, 2]))
    comp = zstandard.ZstdCompressor(level=1).compress(raw) + zstandard.ZstdCompressor().compress(
        b"x"
    )
    digest = hashlib.blake2b(comp, digest_size=16).digest()
    pre = bytearray(sealed(raw)[:PREAMBLE])
    struct.pack_into("<Q", pre, RAW_LEN_AT + 8, len(comp))
    pre[RAW_LEN_AT + 16 : RAW_LEN_AT + 32] = digest
    with pytest.raises(DecompressionError):
        decode_payload(bytes(pre) + comp)


GOOD_RAW = body([item("w", (8,), 2, 3)], val_groups=((BF16, 0, 2),), data=_bf16([1, 2]))


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (GOOD_RAW, None),
        # a run past the end of the tensor
        (
            body([item("w", (8,), 2, 7)], val_groups=((BF16, 0, 2),), data=_bf16([1, 2])),
            LocationError,
        ),
        # gaps that walk past the end: 1, then 1 + 7 + 1 = 9 >= 8
        (
            body(
                [item("w", (8,), 2, 1, kind=GAPS, width=1)],
                loc_groups=((1, 0, 1),),
                val_groups=((BF16, 0, 2),),
                data=_pad(b"\x07") + _bf16([1, 2]),
            ),
            LocationError,
        ),
        # first location outside the tensor
        (
            body(
                [item("w", (8,), 2, 8, kind=GAPS, width=1)],
                loc_groups=((1, 0, 1),),
                val_groups=((BF16, 0, 2),),
                data=_pad(b"\x00") + _bf16([1, 2]),
            ),
            LocationError,
        ),
        # 8-byte gaps whose sum overflows 64 bits
        (
            body(
                [item("w", (2**62 - 1,), 6, 1, dtype=U8, kind=GAPS, width=8)],
                loc_groups=((8, 0, 5),),
                val_groups=((U8, 0, 6),),
                data=struct.pack("<5Q", *[2**62 - 2] * 5) + _pad(bytes(range(1, 7))),
            ),
            LocationError,
        ),
        # the same gaps without wrapping past 2**64 still end outside the tensor
        (
            body(
                [item("w", (2**62 - 1,), 3, 1, dtype=U8, kind=GAPS, width=8)],
                loc_groups=((8, 0, 2),),
                val_groups=((U8, 0, 3),),
                data=struct.pack("<2Q", *[2**62 - 2] * 2) + _pad(bytes(range(1, 4))),
            ),
            LocationError,
        ),
        (
            body([item("w", (8,), 2, 3, dtype=99)], val_groups=((BF16, 0, 2),), data=_bf16([1, 2])),
            SchemaError,
        ),
        (
            body([item("w", (8,), 2, 3, op=3)], val_groups=((BF16, 0, 2),), data=_bf16([1, 2])),
            SchemaError,
        ),
        (
            body([item("w", (8,), 2, 3, kind=5)], val_groups=((BF16, 0, 2),), data=_bf16([1, 2])),
            SchemaError,
        ),
        (
            body([item("w", (8,), 0, 3)], val_groups=((BF16, 0, 2),), data=_bf16([1, 2])),
            SchemaError,
        ),  # an item without changes
        (
            body(
                [item("w", (8,), 1, 3), item("w", (8,), 1, 5, val_off=1)],
                val_groups=((BF16, 0, 2),),
                data=_bf16([1, 2]),
            ),
            SchemaError,
        ),  # duplicate name
        (
            body(
                [item("w", (8,), 2, 3, val_off=1)],
                val_groups=((BF16, 0, 3),),
                data=_bf16([1, 2, 3]),
            ),
            SchemaError,
        ),  # values do not tile their group
        (
            body([item("w", (8,), 2, 3)], val_groups=((BF16, 0, 3),), data=_bf16([1, 2, 3])),
            SchemaError,
        ),  # group has unused values
        (
            body(
                [item("w", (8,), 2, 3)], val_groups=((BF16, 0, 2),), data=_bf16([1, 2]) + b"\0" * 8
            ),
            SchemaError,
        ),  # trailing bytes
        (
            body([item("w", (8,), 2, 3)], val_groups=((BF16, 0, 2**60),), data=_bf16([1, 2])),
            SchemaError,
        ),  # declared group far larger than the body
        (body([item("w", (8,), 2, 3)], val_groups=((BF16, 0, 2),), data=b"\1\0"), TruncatedPayload),
        (
            body(
                [item("w", (8,), 2, 3, dtype=BOOL)], val_groups=((BOOL, 0, 2),), data=_pad(b"\1\2")
            ),
            SchemaError,
        ),  # a bool byte that is not 0 or 1
        (
            body([item("w", (2**40, 2**40), 2, 3)], val_groups=((BF16, 0, 2),), data=_bf16([1, 2])),
            SizeLimitExceeded,
        ),
        (
            body(
                [item("w", (8,), 2, 3)],
                val_groups=((BF16, 0, 2),),
                data=_bf16([1, 2]),
                header=PayloadHeader(1, "att", 2, 10, 4),
            ),
            HeaderMismatch,
        ),
        (b"KRB0" + GOOD_RAW[4:], SchemaError),  # bad body magic
        (GOOD_RAW[:20], TruncatedPayload),
    ],
)
def test_crafted_bodies(raw: bytes, error: type[Exception] | None) -> None:
    data = sealed(raw)
    if error is None:
        [decoded] = decode_payload(data).items
        assert decoded.index() == slice(3, 5)
    else:
        with pytest.raises(error):
            decode_payload(data)


def test_known_metadata_is_enforced() -> None:
    data = sealed(GOOD_RAW)
    ok = {"w": TensorMeta("w", (8,), torch.bfloat16)}
    assert decode_payload(data, known=ok).items[0].meta == ok["w"]
    for known in (
        {"w": TensorMeta("w", (8,), torch.float16)},
        {"w": TensorMeta("w", (2, 4), torch.bfloat16)},
        {"other": TensorMeta("other", (8,), torch.bfloat16)},
    ):
        with pytest.raises(MetaMismatch):
            decode_payload(data, known=known)


def test_encoder_rejects_bad_locations() -> None:
    meta = TensorMeta("w", (10,), torch.int32)
    vals = torch.tensor([1, 2, 3], dtype=torch.int32)
    for locs in ([3, 2, 5], [1, 1, 5], [1, 4, 10], [-1, 2, 5]):
        bad = Item(meta, Op.XOR, None, torch.tensor(locs), vals)
        with pytest.raises(LocationError):
            encode_payload(HEADER, [bad])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_raw_bodies_raise_only_typed_errors(data: st.DataObject) -> None:
    raw = bytearray(zstandard.ZstdDecompressor().decompress(VALID[PREAMBLE:]))
    for _ in range(data.draw(st.integers(1, 6))):
        kind = data.draw(st.sampled_from(["flip", "set64", "cut", "insert"]))
        pos = data.draw(st.integers(0, max(len(raw) - 1, 0)))
        if kind == "flip" and raw:
            raw[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "set64" and len(raw) >= pos + 8:
            value = data.draw(st.sampled_from([0, 1, 2**31, 2**32 + 1, 2**62, 2**64 - 1]))
            raw[pos : pos + 8] = struct.pack("<Q", value)
        elif kind == "cut":
            del raw[pos:]
        else:
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
    try:
        decoded = decode_payload(sealed(bytes(raw)))
    except CodecError:
        return
    for it in decoded.items:  # whatever decodes is internally consistent
        if it.locations is not None:
            locs = it.locations.numpy()
            assert np.all(np.diff(locs) > 0)
            assert locs[0] >= 0
            assert locs[-1] < it.meta.numel
        else:
            assert it.range_start is not None
            assert it.range_start + it.count <= it.meta.numel


@settings(max_examples=200, deadline=None)
@given(blob=st.binary(max_size=200))
def test_arbitrary_bytes_raise_only_typed_errors(blob: bytes) -> None:
    for data in (blob, VALID[:30] + blob):
        with pytest.raises(CodecError):
            decode_payload(data)


def test_scratch_pool_hands_out_distinct_buffers_and_keeps_only_small_ones() -> None:
    pool = _ScratchPool(keep=2, max_bytes=1000)
    with pool.borrow(100) as a, pool.borrow(100) as b:
        assert a.size == b.size == 100
        assert not np.shares_memory(a, b)
        a[:] = 1
        b[:] = 2
        assert (a == 1).all()
    with pool.borrow(50) as c:  # a returned buffer is reused
        assert c.size == 50
        assert np.shares_memory(c, a) or np.shares_memory(c, b)
    with pool.borrow(5000) as big:  # over max_bytes: its own buffer, not kept afterwards
        assert big.size == 5000
    assert not any(np.shares_memory(big, kept) for kept in pool._free)
    assert len(pool._free) == 2


def test_concurrent_encodes_each_get_their_own_raw_body() -> None:
    """Encoders on several threads (the pipeline seals payloads side by side) assemble their
    raw bodies in the shared scratch pool: every payload still decodes to its own items."""
    gen = torch.Generator().manual_seed(5)

    def items(k: int) -> list[Item]:
        values = torch.randint(-(2**15), 2**15, (3000 + k,), generator=gen, dtype=torch.int16)
        meta = TensorMeta(f"t{k}", (100_000,), torch.bfloat16)
        return [Item(meta, Op.XOR, None, torch.arange(0, 3 * values.numel(), 3), values)]

    work = [items(k) for k in range(16)]

    def encode_and_check(k: int) -> bool:
        payload = encode_payload(PayloadHeader(1, "att", 0, k, k), work[k])
        [decoded] = decode_payload(payload.body, expected_digest=payload.digest).items
        original = work[k][0]
        return (
            decoded.meta == original.meta
            and torch.equal(decoded.values, original.values)
            and torch.equal(decoded.locations, original.locations)
        )

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(encode_and_check, list(range(16)) * 4))


def _header(**change: object) -> PayloadHeader:
    fields: dict[str, object] = {
        "codec_version": 1,
        "attempt": "a",
        "producer": 0,
        "payload_id": 0,
        "order": 0,
    }
    return PayloadHeader(**(fields | change))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "largest", "message"),
    [
        ("producer", 2**32 - 1, "producer must fit in 32 bits"),
        ("payload_id", 2**64 - 1, "payload_id and order must fit in 64 bits"),
        ("order", 2**64 - 1, "payload_id and order must fit in 64 bits"),
        ("codec_version", 2**16 - 1, "codec_version must fit in 16 bits"),
    ],
)
def test_header_fields_take_exactly_their_wire_width(
    field: str, largest: int, message: str
) -> None:
    """Every header field is accepted up to the largest value its wire width holds and refused
    one above it or below zero, with the field named."""
    assert getattr(_header(**{field: largest}), field) == largest
    assert getattr(_header(**{field: 0}), field) == 0
    for bad in (largest + 1, -1):
        with pytest.raises(ValueError, match=f"^{message}$"):
            _header(**{field: bad})


def test_attempt_ids_up_to_the_limit_in_utf8_bytes() -> None:
    from refit_sidecar.codec.wire import MAX_ATTEMPT_BYTES

    assert _header(attempt="a" * MAX_ATTEMPT_BYTES).attempt == "a" * MAX_ATTEMPT_BYTES
    with pytest.raises(ValueError, match=f"^attempt id longer than {MAX_ATTEMPT_BYTES} bytes$"):
        _header(attempt="a" * (MAX_ATTEMPT_BYTES + 1))
    with pytest.raises(ValueError, match=r"^attempt id longer than"):  # counted in bytes
        _header(attempt="é" * (MAX_ATTEMPT_BYTES // 2 + 1))


def _preamble(
    *, magic: bytes = b"KRFP", version: int | None = None, flags: int = 0, attempt: bytes = b"a"
) -> bytes:
    """A hand-built preamble (no MAC), as `read_preamble` parses it."""
    from refit_sidecar.codec.wire import CODEC_VERSION, PRE_ID, PRE_REST

    v = CODEC_VERSION if version is None else version
    rest = PRE_REST.pack(flags, 3, 4, 5, 0, 0, bytes(16), len(attempt))
    return PRE_ID.pack(magic, v) + rest + attempt


def test_preamble_refusals_say_what_is_wrong() -> None:
    """Each refusal of a hand-built preamble is the right typed error with a message naming
    the field and the offending value (these messages reach logs and the attempt's errors)."""
    from refit_sidecar.codec.errors import (
        BadMagic,
        SchemaError,
        SizeLimitExceeded,
        TruncatedPayload,
        UnsupportedVersion,
    )
    from refit_sidecar.codec.wire import CODEC_VERSION, MAX_ATTEMPT_BYTES, peek_header

    good = peek_header(_preamble(attempt=b"a" * MAX_ATTEMPT_BYTES))  # the longest id: accepted
    assert (good.attempt, good.producer, good.payload_id, good.order) == (
        "a" * MAX_ATTEMPT_BYTES,
        3,
        4,
        5,
    )
    with pytest.raises(BadMagic, match=r"^not a KubeRefit payload \(magic b'XXXX'\)$"):
        peek_header(_preamble(magic=b"XXXX"))
    with pytest.raises(
        UnsupportedVersion, match=rf"^codec version 999; this decoder reads {CODEC_VERSION}$"
    ):
        peek_header(_preamble(version=999))
    with pytest.raises(SchemaError, match=r"^unknown preamble flags 0x8$"):
        peek_header(_preamble(flags=0x8))
    too_long = MAX_ATTEMPT_BYTES + 1
    with pytest.raises(SizeLimitExceeded, match=rf"^attempt id of {too_long} bytes$"):
        peek_header(_preamble(attempt=b"a" * too_long))
    with pytest.raises(SchemaError, match=r"^attempt id is not valid UTF-8$"):
        peek_header(_preamble(attempt=b"\xff\xfe"))
    whole = _preamble(attempt=b"abcd")
    with pytest.raises(
        TruncatedPayload, match=r"^preamble: needs 4 bytes at offset 62, only 2 left$"
    ):
        peek_header(whole[:-2])
