"""The storage-write hook's rarer paths, each reached by a real loader shape (issue 18): the
three placeholder collisions, overlap of non-contiguous destinations, copies of different element
sizes into one storage, and a 0-dim parameter. An overwrite refusal comes before anything is
written; an XOR refusal may follow a first copy's write, and the overwrite retry (what the
coordinator sends next) then ends at the dense load's bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
import torch
from torch import nn

from refit_sidecar.apply import (
    ApplyContext,
    OverlappingXorError,
    PlaceholderCollisionError,
    prewarm,
)
from refit_sidecar.bits import int_view
from refit_sidecar.codec.records import Item, Op, TensorMeta, diff_item

Loader = Callable[[nn.Module, torch.Tensor], None]


class OneTensorModel(nn.Module):
    """One parameter `p` and a loader for the canonical tensor "w" given by the test."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, loader: Loader) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
        self._loader = loader

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, w in weights:
            if name != "w":
                raise KeyError(name)
            self._loader(self, w)
        return {"p"}


def _context(model: OneTensorModel, meta: TensorMeta) -> ApplyContext:
    ctx = ApplyContext(model, {"w": meta})
    assert not prewarm(ctx).unsupported
    return ctx


def _partial(meta: TensorMeta, old: torch.Tensor, new: torch.Tensor, op: Op) -> Item:
    """An item for every other element: never a whole-tensor item (those need no placeholder)."""
    target = old.clone()
    target.view(-1)[::2] = new.view(-1)[::2]
    item = diff_item(meta.name, old, target, op)
    assert item is not None
    assert item.count < meta.numel
    return item


def _assert_unchanged(model: OneTensorModel, before: torch.Tensor) -> None:
    assert torch.equal(int_view(model.p.detach()), int_view(before))


def test_a_nan_placeholder_through_a_cast_to_integers_is_refused() -> None:
    """bf16 values without NaN use the NaN placeholder; a loader that casts them to integers
    loses it, so the active positions cannot be formed: refused before anything is written."""
    meta = TensorMeta("w", (8,), torch.bfloat16)

    def to_int(m: nn.Module, w: torch.Tensor) -> None:
        m.p.data.copy_(w.to(torch.int16))

    model = OneTensorModel((8,), torch.int16, to_int)
    ctx = _context(model, meta)
    old = torch.arange(8, dtype=torch.bfloat16)
    model.load_weights([("w", old)])
    before = model.p.detach().clone()
    item = _partial(meta, old, old + 8, Op.OVERWRITE)
    with pytest.raises(PlaceholderCollisionError, match="NaN placeholder"):
        ctx.apply([item])
    _assert_unchanged(model, before)


def test_an_exact_bit_placeholder_through_a_transform_is_refused() -> None:
    """Integers use an exact-bit sentinel, which no transform preserves (`2 * w`)."""
    meta = TensorMeta("w", (8,), torch.int16)

    def doubled(m: nn.Module, w: torch.Tensor) -> None:
        m.p.data.copy_(w * 2)

    model = OneTensorModel((8,), torch.int16, doubled)
    ctx = _context(model, meta)
    old = torch.arange(8, dtype=torch.int16)
    model.load_weights([("w", old)])
    before = model.p.detach().clone()
    item = _partial(meta, old, old + 100, Op.OVERWRITE)
    with pytest.raises(PlaceholderCollisionError, match="untransformed copy"):
        ctx.apply([item])
    _assert_unchanged(model, before)


def test_an_overwrite_broadcast_into_a_larger_destination_is_refused() -> None:
    """A (1, 4) canonical tensor broadcast into every row of a (3, 4) parameter: the active
    mask of the source cannot be placed on the destination."""
    meta = TensorMeta("w", (1, 4), torch.bfloat16)

    def broadcast(m: nn.Module, w: torch.Tensor) -> None:
        m.p.data.copy_(w)

    model = OneTensorModel((3, 4), torch.bfloat16, broadcast)
    ctx = _context(model, meta)
    old = torch.ones(1, 4, dtype=torch.bfloat16)
    model.load_weights([("w", old)])
    before = model.p.detach().clone()
    item = _partial(meta, old, old * 3, Op.OVERWRITE)
    with pytest.raises(PlaceholderCollisionError, match="broadcast"):
        ctx.apply([item])
    _assert_unchanged(model, before)


def _dense(loader: Loader, shape: tuple[int, ...], w: torch.Tensor) -> torch.Tensor:
    """The parameter's bits after a dense load of `w` by the same loader."""
    reference = OneTensorModel(shape, w.dtype, loader)
    reference.load_weights([("w", w.clone())])
    return int_view(reference.p.detach())


def test_overlapping_strided_destinations_refuse_xor_and_take_overwrite() -> None:
    """Columns 0-1 and 1-2 of a (4, 4) parameter: non-contiguous views that share column 1.
    XOR there would apply the mask twice; prewarm says so, XOR fails closed, and the overwrite
    retry ends at a dense load's bits."""
    meta = TensorMeta("w", (4, 2), torch.bfloat16)

    def twice(m: nn.Module, w: torch.Tensor) -> None:
        m.p.data[:, 0:2].copy_(w)
        m.p.data[:, 1:3].copy_(w)

    model = OneTensorModel((4, 4), torch.bfloat16, twice)
    report = prewarm(ApplyContext(model, {"w": meta}))
    assert "overlap" in report.xor_incompatible["w"]
    ctx = _context(model, meta)
    g = torch.Generator().manual_seed(40)
    old = torch.randn(4, 2, generator=g).to(torch.bfloat16)
    new = torch.randn(4, 2, generator=g).to(torch.bfloat16)
    model.load_weights([("w", old)])
    xor = diff_item("w", old, new, Op.XOR)
    assert xor is not None
    with pytest.raises(OverlappingXorError, match="overlap"):
        ctx.apply([xor])
    retry = diff_item("w", old, new, Op.OVERWRITE)
    assert retry is not None
    ctx.apply([retry], check_samples=-1)
    assert torch.equal(int_view(model.p.detach()), _dense(twice, (4, 4), new))


def test_copies_of_different_element_sizes_into_one_storage_refuse_xor() -> None:
    """One canonical tensor copied as bf16 into a strided column and as raw bytes into row 0 of
    the same storage: the two spans cannot be compared element-wise, so XOR is refused."""
    meta = TensorMeta("w", (4,), torch.bfloat16)

    def two_views(m: nn.Module, w: torch.Tensor) -> None:
        m.p.data[:, 3].copy_(w)
        m.p.data.view(torch.int8)[0, 0:8].copy_(w.view(torch.int8))

    model = OneTensorModel((4, 4), torch.bfloat16, two_views)
    report = prewarm(ApplyContext(model, {"w": meta}))
    assert "different element sizes" in report.xor_incompatible["w"]
    ctx = _context(model, meta)
    old = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)
    new = torch.tensor([1.0, -2.0, 3.5, 4.0], dtype=torch.bfloat16)
    model.load_weights([("w", old)])
    xor = diff_item("w", old, new, Op.XOR)
    assert xor is not None
    with pytest.raises(OverlappingXorError, match="different element sizes"):
        ctx.apply([xor])
    # A partial overwrite cannot form its mask through the raw-byte copy either: refused...
    retry = diff_item("w", old, new, Op.OVERWRITE)
    assert retry is not None
    assert retry.count < meta.numel
    with pytest.raises(PlaceholderCollisionError, match="NaN placeholder"):
        ctx.apply([retry])
    # ...while an item carrying every element needs no mask: a dense write of the tensor.
    whole = Item(meta, Op.OVERWRITE, 0, None, int_view(new).clone())
    ctx.apply([whole], check_samples=-1)
    assert torch.equal(int_view(model.p.detach()), _dense(two_views, (4, 4), new))


@pytest.mark.parametrize("value", [2.5, float("nan"), -0.0])
def test_a_zero_dim_parameter_is_overwritten_exactly(value: float) -> None:
    """A scalar parameter (e.g. a learned temperature): overwrite indexes it as one element;
    a NaN value or a signed zero ends with exactly its bits."""
    meta = TensorMeta("w", (), torch.float32)

    def plain(m: nn.Module, w: torch.Tensor) -> None:
        m.p.data.copy_(w)

    model = OneTensorModel((), torch.float32, plain)
    ctx = _context(model, meta)
    model.load_weights([("w", torch.tensor(1.0))])
    new = torch.tensor(value, dtype=torch.float32)
    item = diff_item("w", torch.tensor(1.0), new, Op.OVERWRITE)
    assert item is not None
    ctx.apply([item], check_samples=-1)
    assert int_view(model.p.detach()).item() == int_view(new).item()
    # The same change as a location list (what a decoder may hand over): the placeholder path.
    model.load_weights([("w", torch.tensor(1.0))])
    listed = Item(meta, Op.OVERWRITE, None, torch.zeros(1, dtype=torch.int64), item.values)
    ctx.apply([listed], check_samples=-1)
    assert int_view(model.p.detach()).item() == int_view(new).item()
