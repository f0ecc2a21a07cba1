"""Property tests: decode(encode(old -> new)) applied to old gives new, bit for bit.

Old and new tensors are random bit patterns (so NaN payloads, subnormals, infinities and signed
zeros all occur) with explicitly injected special values, over every supported dtype and several
change patterns. Comparisons go through integer views, never float equality.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refit_sidecar.bits import int_view
from refit_sidecar.codec import (
    CodecConfig,
    Item,
    Mode,
    Op,
    PayloadHeader,
    TensorMeta,
    apply_item_,
    decode_payload,
    diff_item,
    diff_items,
    encode_payload,
    peek_header,
)

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]
# Stored-bit patterns that float equality gets wrong or that are easy to mishandle.
SPECIAL_BITS: dict[torch.dtype, list[int]] = {
    torch.bfloat16: [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFFF, 0x0001, 0x807F],
    torch.float16: [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7E01, 0xFFFF, 0x0001, 0x83FF],
    torch.float32: [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FC00001, 1, 0x807FFFFF],
    torch.float64: [0, 1 << 63, 0x7FF0 << 48, 0xFFF0 << 48, (0x7FF8 << 48) | 5, 1],
    torch.float8_e4m3fn: [0x00, 0x80, 0x7F, 0xFF, 0x01, 0x81],
    torch.float8_e5m2: [0x00, 0x80, 0x7C, 0xFC, 0x7E, 0x7F, 0x01, 0x83],
}
HEADER = PayloadHeader(codec_version=1, attempt="attempt-7", producer=3, payload_id=11, order=5)


def _width(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _from_bits(bits: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `dtype` whose stored bits are `bits` (unsigned integers of the same width)."""
    w = _width(dtype)
    raw = np.ascontiguousarray(bits.astype(f"<u{w}")).view(np.uint8)
    if dtype == torch.bool:
        raw = raw & 1
    return torch.from_numpy(raw.copy()).view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> np.ndarray:
    return int_view(t).numpy().copy()


def _random_bits(rng: np.random.Generator, dtype: torch.dtype, n: int) -> np.ndarray:
    w = _width(dtype)
    bits = rng.integers(0, 1 << (8 * w), size=n, dtype=np.uint64 if w == 8 else np.int64)
    specials = SPECIAL_BITS.get(dtype)
    if specials and n:
        k = rng.integers(0, n + 1)
        where = rng.choice(n, size=min(k, n), replace=False)
        bits[where] = rng.choice(np.array(specials, dtype=np.uint64), size=where.size)
    return bits


@st.composite
def cases(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, new) of one dtype and shape with a drawn change pattern."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(1, 24), min_size=1, max_size=3)))
    n = int(np.prod(shape))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    old_bits = _random_bits(rng, dtype, n)
    pattern = draw(st.sampled_from(["none", "all", "single", "run", "scattered", "specials"]))
    mask = np.zeros(n, dtype=bool)
    if pattern == "all":
        mask[:] = True
    elif pattern == "single":
        mask[rng.integers(0, n)] = True
    elif pattern == "run":
        a = int(rng.integers(0, n))
        mask[a : int(rng.integers(a, n)) + 1] = True
    elif pattern in ("scattered", "specials"):
        mask = rng.random(n) < draw(st.floats(0.01, 0.9))
    new_bits = old_bits.copy()
    replacement = _random_bits(rng, dtype, n)
    if pattern == "specials" and dtype in SPECIAL_BITS:
        replacement = rng.choice(np.array(SPECIAL_BITS[dtype], dtype=np.uint64), size=n)
    new_bits[mask] = replacement[mask]
    old = _from_bits(old_bits, dtype, shape)
    return old, _from_bits(new_bits, dtype, shape)


def _roundtrip(items: list[Item], config: CodecConfig | None = None) -> list[Item]:
    payload = encode_payload(HEADER, items, config=config)
    known = {i.meta.name: i.meta for i in items}
    decoded = decode_payload(payload.body, expected_digest=payload.digest, known=known)
    assert decoded.header == HEADER
    assert peek_header(payload.body) == HEADER
    return decoded.items


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), op=st.sampled_from(list(Op)), shuffle=st.booleans())
def test_decode_encode_apply_reproduces_new_bits(
    case: tuple[torch.Tensor, torch.Tensor], op: Op, shuffle: bool
) -> None:
    old, new = case
    item = diff_item("model.w", old, new, op)
    expected_changed = int(np.count_nonzero(_bits(old) != _bits(new)))
    if expected_changed == 0:
        assert item is None
        return
    assert item is not None
    assert item.count == expected_changed
    [decoded] = _roundtrip([item], CodecConfig(shuffle=shuffle))
    assert decoded.op is op
    assert decoded.meta == TensorMeta.of("model.w", new)
    target = old.clone()
    apply_item_(target, decoded)
    assert np.array_equal(_bits(target), _bits(new))
    if op is Op.XOR:  # a second application flips the bits back: why retries use overwrites
        apply_item_(target, decoded)
        assert np.array_equal(_bits(target), _bits(old))
    else:  # overwrites are idempotent
        apply_item_(target, decoded)
        assert np.array_equal(_bits(target), _bits(new))


@settings(max_examples=40, deadline=None)
@given(cases=st.lists(cases(), min_size=1, max_size=6), mode=st.sampled_from(list(Mode)))
def test_multi_item_payload_with_mixed_mode(
    cases: list[tuple[torch.Tensor, torch.Tensor]], mode: Mode
) -> None:
    old = {f"t{i}": o for i, (o, _) in enumerate(cases)}
    new = [(f"t{i}", n) for i, (_, n) in enumerate(cases)]
    incompatible = frozenset({"t0", "t3"})
    items = diff_items(old, new, mode=mode, xor_incompatible=incompatible)
    for item in items:
        want = Op.OVERWRITE if mode is Mode.OVERWRITE or item.meta.name in incompatible else Op.XOR
        assert item.op is want
    if not items:
        return
    target = {k: v.clone() for k, v in old.items()}
    for item in _roundtrip(items):
        apply_item_(target[item.meta.name], item)
    for name, t in new:
        assert np.array_equal(_bits(target[name]), _bits(t)), name


def test_signed_zero_and_nan_payload_count_as_changes() -> None:
    old = torch.tensor([0.0, float("nan"), 1.0], dtype=torch.float32)
    new = old.clone()
    new[0] = -0.0  # equal as floats
    new_bits = int_view(new)
    new_bits[1] = 0x7FC00001  # a NaN with another payload; NaN != NaN as floats anyway
    item = diff_item("w", old, new, Op.XOR)
    assert item is not None
    assert item.count == 2
    [decoded] = _roundtrip([item])
    target = old.clone()
    apply_item_(target, decoded)
    assert np.array_equal(_bits(target), _bits(new))


def test_gaps_above_65535_use_wider_words() -> None:
    old = torch.zeros(200_000, dtype=torch.bfloat16)
    new = old.clone()
    positions = [0, 70_000, 70_001, 199_999]
    int_view(new)[positions] = 0x3F80
    item = diff_item("w", old, new, Op.OVERWRITE)
    assert item is not None
    assert item.locations is not None
    [decoded] = _roundtrip([item])
    assert decoded.locations is not None
    assert decoded.locations.tolist() == positions
    target = old.clone()
    apply_item_(target, decoded)
    assert np.array_equal(_bits(target), _bits(new))


@pytest.mark.parametrize(
    "positions",
    [
        [5, 2**32 - 1, 2**32, 2**32 + 70_000, 2**33 + 4],  # 8-byte gaps
        [2**32 + 1, 2**32 + 3, 2**32 + 300, 2**32 + 100_000],  # start above 2**32, 4-byte gaps
    ],
)
def test_synthetic_locations_above_2_to_the_32(positions: list[int]) -> None:
    # Only metadata claims the huge tensor; items never need the tensor itself.
    meta = TensorMeta("huge", (2**33 + 5,), torch.uint8)
    values = torch.arange(1, len(positions) + 1, dtype=torch.uint8)
    item = Item(meta, Op.OVERWRITE, None, torch.tensor(positions, dtype=torch.int64), values)
    [decoded] = _roundtrip([item])
    assert decoded.locations is not None
    assert decoded.locations.tolist() == positions
    assert torch.equal(decoded.values, values)


def test_contiguous_run_is_a_range_without_location_bytes() -> None:
    old = torch.zeros(1000, dtype=torch.float16)
    new = old.clone()
    new[100:400] = 2.0
    item = diff_item("w", old, new, Op.XOR)
    assert item is not None
    assert item.range_start == 100
    assert item.locations is None
    [decoded] = _roundtrip([item])
    assert decoded.index() == slice(100, 400)


def test_large_bf16_tensor_exercises_block_boundaries() -> None:
    gen = torch.Generator().manual_seed(3)
    old = torch.randn(3 * (1 << 19) + 3, generator=gen, dtype=torch.bfloat16)  # odd tail
    new = old.clone()
    idx = torch.randperm(old.numel(), generator=gen)[:5000]
    int_view(new)[idx] ^= 1
    int_view(new)[-1] ^= 0x10  # the tail element past the last full word
    item = diff_item("w", old, new, Op.XOR)
    assert item is not None
    assert item.count == 5001
    [decoded] = _roundtrip([item])
    target = old.clone()
    apply_item_(target, decoded)
    assert np.array_equal(_bits(target), _bits(new))
