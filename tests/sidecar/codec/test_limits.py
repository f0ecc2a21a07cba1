"""One set of structural limits for producers and receivers (`refit_protocol.limits`): the
encoder refuses, with a typed error naming the tensor and the limit, every name, rank and size a
decoder would refuse, and the exact limits still round-trip bit for bit."""

from __future__ import annotations

import pytest
import torch

from refit_protocol.limits import MAX_NAME_BYTES, MAX_NDIM, MAX_NUMEL
from refit_sidecar.codec.decode import decode_payload
from refit_sidecar.codec.encode import PreparedItem, encode_payload, prepare_item
from refit_sidecar.codec.errors import CodecError, EncodeLimitError
from refit_sidecar.codec.locations import encode_run
from refit_sidecar.codec.records import Item, Op, TensorMeta, diff_item
from refit_sidecar.codec.wire import DEFAULT_LIMITS, PayloadHeader

HEADER = PayloadHeader(codec_version=1, attempt="limits", producer=0, payload_id=1, order=0)


def run_item(name: str, shape: tuple[int, ...], count: int = 3, at_end: bool = True) -> Item:
    """An overwrite of `count` int16 elements at the end (or start) of the tensor."""
    numel = 1
    for d in shape:
        numel *= d
    values = torch.tensor([-1, 0x7FC0, -32768, 1, 2][:count], dtype=torch.int16)
    start = numel - count if at_end else 0
    return Item(TensorMeta(name, shape, torch.bfloat16), Op.OVERWRITE, start, None, values)


def test_decoder_defaults_are_the_shared_limits() -> None:
    assert DEFAULT_LIMITS.max_name_bytes == MAX_NAME_BYTES == 4096
    assert DEFAULT_LIMITS.max_ndim == MAX_NDIM == 16
    assert MAX_NUMEL == 1 << 39


@pytest.mark.parametrize(
    ("name", "shape", "limit"),
    [
        ("n" * (MAX_NAME_BYTES + 1), (4,), "MAX_NAME_BYTES"),
        ("é" * (MAX_NAME_BYTES // 2) + "x", (4,), "MAX_NAME_BYTES"),  # bytes, not characters
        ("deep", (1,) * 16 + (4,), "MAX_NDIM"),
        ("deeper", (1,) * 255 + (4,), "MAX_NDIM"),
        ("deepest", (1,) * 256 + (4,), "MAX_NDIM"),  # was an untyped struct.error
        ("huge", (MAX_NUMEL + 1,), "MAX_NUMEL"),
        ("huger", (1 << 31, 1 << 31), "MAX_NUMEL"),
        ("hugest", (1 << 62,), "MAX_NUMEL"),
    ],
)
def test_over_limit_tensors_are_refused_at_encode_time(
    name: str, shape: tuple[int, ...], limit: str
) -> None:
    item = run_item(name, shape)
    for encode in (
        lambda: encode_payload(HEADER, [item]),
        lambda: prepare_item(item),
        # A hand-built PreparedItem skips prepare_item: encode_payload checks again.
        lambda: encode_payload(HEADER, [PreparedItem(item, encode_run(item.range_start or 0))]),
    ):
        with pytest.raises(EncodeLimitError, match=limit) as err:
            encode()
        assert isinstance(err.value, CodecError)
        assert name[:20] in str(err.value)  # names the tensor


def test_diff_item_refuses_what_no_receiver_accepts() -> None:
    t = torch.zeros((1,) * 17, dtype=torch.bfloat16)
    with pytest.raises(EncodeLimitError, match="MAX_NDIM"):
        diff_item("deep", t, t + 1, Op.OVERWRITE)


def test_exact_limits_round_trip() -> None:
    name = "é" * (MAX_NAME_BYTES // 2)  # exactly MAX_NAME_BYTES bytes of UTF-8
    assert len(name.encode()) == MAX_NAME_BYTES
    items = [
        run_item(name, (8,)),
        run_item("ndim", (1,) * (MAX_NDIM - 1) + (4,)),
        run_item("numel", (MAX_NUMEL,)),
        run_item("numel-dims", (1 << 20, 1 << 19)),
        Item(
            TensorMeta("gaps", (MAX_NUMEL,), torch.bfloat16),
            Op.OVERWRITE,
            None,
            torch.tensor([0, 1 << 38, MAX_NUMEL - 1], dtype=torch.int64),
            torch.tensor([5, -1, 0x7F80], dtype=torch.int16),
        ),
    ]
    payload = encode_payload(HEADER, items)
    decoded = decode_payload(payload.body, known={it.meta.name: it.meta for it in items})
    assert len(decoded.items) == len(items)
    for want, got in zip(items, decoded.items, strict=True):
        assert got.meta == want.meta
        assert got.op is want.op
        assert torch.equal(got.values, want.values)  # int16 views: bits, not floats
        w_idx, g_idx = want.index(), got.index()
        if isinstance(w_idx, slice):
            assert isinstance(g_idx, slice)
            assert (g_idx.start, g_idx.stop) == (w_idx.start, w_idx.stop)
        else:
            assert isinstance(g_idx, torch.Tensor)
            assert torch.equal(g_idx, w_idx)
