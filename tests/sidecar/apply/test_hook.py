"""The storage-write hook (apply/hook.py) driven directly, one intercepted `copy_` at a time:
the geometry of a destination's bytes, which copies XOR accepts and the exact reason it gives
for each one it refuses, overlap between copies of one item, an XOR narrowed to the rows its
item's reach meets (checked by brute force over views), the post-apply check's sample and
budget, the active mask an overwrite fixes at its first copy, COMPARE's mismatch records, and
fills (taken only where they change no bit).

Bits are compared through integer views. The one fake here, `DroppedModelWritesFake`, injects
a fault no real part produces on demand (memory that drops the hook's own writes), so that the
post-apply check has something to catch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from refit_sidecar.apply import hook as hook_module
from refit_sidecar.apply.errors import (
    OverlappingXorError,
    PlaceholderCollisionError,
    PostApplyCheckError,
    UnsupportedWriteError,
    XorTransformError,
)
from refit_sidecar.apply.hook import (
    CopyTrace,
    ItemTrace,
    Mismatch,
    Mode,
    StorageWriteHook,
    _Geometry,
    _rows_reaching,
)
from refit_sidecar.apply.placeholders import COVERS_ALL, Placeholder
from refit_sidecar.apply.storage import ModelStorages, storage_key
from refit_sidecar.bits import int_view

OVERLAP = "destination bytes overlap another copy of the same item"


class Rig:
    """Two model tensors `p` (4, 4) and `q` (8,), both BF16, and 256 bytes of scratch."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.p = torch.randn(4, 4, generator=g).to(torch.bfloat16)
        self.q = torch.randn(8, generator=g).to(torch.bfloat16)
        self.scratch = torch.zeros(256, dtype=torch.uint8)
        self.hook = StorageWriteHook(ModelStorages.of([("p", self.p), ("q", self.q)]), self.scratch)

    def view(self, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        return self.scratch[:nbytes].view(dtype).view(shape)

    def fill(self, *shape: int, seed: int = 1) -> torch.Tensor:
        """A scratch view holding random non-zero bits (an XOR mask with every bit used)."""
        v = self.view(*shape)
        g = torch.Generator().manual_seed(seed)
        v.view(torch.int16).copy_(
            torch.randint(1, 1 << 15, v.shape, generator=g, dtype=torch.int16)
        )
        return v

    @contextlib.contextmanager
    def item(
        self,
        mode: Mode,
        placeholder: Placeholder | None = None,
        reach: tuple[int, int] | None = None,
    ) -> Iterator[list[ItemTrace]]:
        """Run the body under the hook for item "w"; the list receives the item's trace."""
        out: list[ItemTrace] = []
        self.hook.begin_item("w", mode, placeholder, reach)
        try:
            with self.hook:
                yield out
        finally:
            out.append(self.hook.end_item())


def bits(t: torch.Tensor) -> torch.Tensor:
    return int_view(t.detach()).clone()


# -- where a destination's bytes lie ----------------------------------------------------------


@pytest.mark.parametrize(
    ("geometry", "span"),
    [
        (_Geometry(0, (4,), (1,), 2), (0, 8)),
        (_Geometry(3, (2, 4), (4, 1), 2), (6, 22)),
        (_Geometry(0, (2, 3), (3, 1), 2), (0, 12)),
        (_Geometry(5, (1, 4), (99, 1), 4), (20, 36)),  # a size-1 dimension's stride is free
        (_Geometry(0, (3, 1), (1, 1), 2), (0, 6)),
        (_Geometry(0, (2, 1, 3), (3, 7, 1), 1), (0, 6)),
        (_Geometry(2, (), (), 8), (16, 24)),  # a scalar
        (_Geometry(0, (4, 2), (1, 4), 2), None),  # transposed
        (_Geometry(0, (2, 2), (4, 1), 2), None),  # rows with a gap between them
        (_Geometry(0, (4,), (2,), 2), None),  # every other element
    ],
)
def test_contiguous_span_in_bytes(geometry: _Geometry, span: tuple[int, int] | None) -> None:
    assert geometry.contiguous_span() == span


# -- what XOR accepts, and why it refuses ---------------------------------------------------------


def test_a_fresh_hook_discovers_and_writes_nothing() -> None:
    rig = Rig()
    assert rig.hook.check_budget == 0
    before = bits(rig.q)
    w = rig.fill(8)
    with rig.hook:  # no begin_item: a hook starts out discovering
        rig.q.copy_(w)
    assert torch.equal(bits(rig.q), before)
    trace = rig.hook.end_item()
    assert trace.copies == [CopyTrace(("q",), xor_compatible=True, reason="")]
    assert (trace.checked, trace.compared, trace.mismatches) == (0, 0, [])
    assert trace.written_storages == {"q"}


def _transformed(rig: Rig) -> None:
    rig.q.copy_(rig.view(8) * 2)


def _scratch_edited(rig: Rig) -> None:
    w = rig.view(8)
    w.mul_(2)
    rig.q.copy_(w)


def _cast(rig: Rig) -> None:
    rig.q.copy_(rig.view(8, dtype=torch.float16))


def _broadcast(rig: Rig) -> None:
    rig.p.copy_(rig.view(4))


REFUSALS = [
    (_transformed, "q", "source is not a view of scratch (the loader transformed the values)"),
    (_scratch_edited, "q", "the loader modified scratch in place before copying"),
    (_cast, "q", "dtype changes from torch.float16 to torch.bfloat16"),
    (_broadcast, "p", "source shape (4,) is broadcast to (4, 4)"),
]


@pytest.mark.parametrize(("loader", "dest", "reason"), REFUSALS)
def test_each_xor_refusal_names_its_reason(
    loader: Callable[[Rig], None], dest: str, reason: str
) -> None:
    rig = Rig()
    rig.fill(8)
    with rig.item(Mode.DISCOVER) as out:
        loader(rig)
    (trace,) = out
    assert trace.copies == [CopyTrace((dest,), xor_compatible=False, reason=reason)]

    rig = Rig()
    rig.fill(8)
    before = bits(getattr(rig, dest))
    with pytest.raises(XorTransformError) as info, rig.item(Mode.XOR):
        loader(rig)
    assert str(info.value) == f"w: XOR copy into ['{dest}'] rejected: {reason}"
    assert info.type is XorTransformError
    assert torch.equal(bits(getattr(rig, dest)), before)


def test_scratch_edited_in_place_is_noticed_only_for_scratch() -> None:
    rig = Rig()
    w = rig.fill(8)
    with rig.item(Mode.DISCOVER) as out:
        other = torch.zeros(8, dtype=torch.bfloat16)
        other.add_(1)  # a write into a tensor that is neither model storage nor scratch
        rig.q.copy_(w)
    (trace,) = out
    assert not trace.scratch_written
    assert trace.copies[0].xor_compatible


# -- overlap between the copies of one item ---------------------------------------------------


def _reasons(rig: Rig, dests: list[torch.Tensor]) -> list[str]:
    with rig.item(Mode.DISCOVER) as out:
        for d in dests:
            src = rig.view(*d.shape)
            d.copy_(src)
    (trace,) = out
    return [c.reason for c in trace.copies]


def test_adjacent_contiguous_copies_do_not_overlap() -> None:
    rig = Rig()
    flat = rig.p.view(-1)
    assert _reasons(rig, [flat[4:8], flat[0:4], flat[8:16], rig.q]) == ["", "", "", ""]


def test_contiguous_copies_sharing_one_element_overlap() -> None:
    rig = Rig()
    flat = rig.p.view(-1)
    assert _reasons(rig, [flat[0:4], flat[3:7]]) == ["", OVERLAP]
    assert _reasons(rig, [flat[3:7], flat[0:4]]) == ["", OVERLAP]
    assert _reasons(rig, [flat[0:4], flat[0:4]]) == ["", OVERLAP]


def test_strided_copies_overlap_by_element() -> None:
    rig = Rig()
    # Columns 0 and 1 interleave without sharing a byte; row 1 shares (1, 0) with column 0.
    assert _reasons(rig, [rig.p[:, 0], rig.p[:, 1], rig.p[1]]) == ["", "", OVERLAP]
    assert _reasons(rig, [rig.p[1], rig.p[:, 2]]) == ["", OVERLAP]
    assert _reasons(rig, [rig.p[:, 3], rig.p[0, 0:3]]) == ["", ""]
    # A refused copy is not remembered: a later copy may use its bytes.
    assert _reasons(rig, [rig.p[:, 0], rig.p[0], rig.p[0, 1:]]) == ["", OVERLAP, ""]


def test_element_sizes_cannot_be_compared() -> None:
    rig = Rig()
    wide = rig.p.view(torch.int32)  # (4, 2): the same storage in 4-byte elements
    with rig.item(Mode.DISCOVER) as out:
        rig.p[:, 0].copy_(rig.view(4))
        wide[3].copy_(rig.view(2, dtype=torch.int32))
    (trace,) = out
    assert [c.reason for c in trace.copies] == [
        "",
        "copies of different element sizes into one storage",
    ]


def test_an_overlapping_xor_copy_fails_with_its_own_error() -> None:
    rig = Rig()
    flat = rig.p.view(-1)
    with rig.item(Mode.XOR):
        flat[0:4].copy_(rig.view(4))
        with pytest.raises(OverlappingXorError) as info:
            flat[2:6].copy_(rig.view(4))
    assert str(info.value) == f"w: XOR copy into ['p'] rejected: {OVERLAP}"


def test_each_item_starts_with_no_spans() -> None:
    rig = Rig()
    flat = rig.p.view(-1)
    assert _reasons(rig, [flat[0:4]]) == [""]
    assert _reasons(rig, [flat[0:4]]) == [""]  # the next item's copy: no overlap


# -- what XOR and overwrite write ---------------------------------------------------------------


def test_xor_writes_old_xor_mask() -> None:
    rig = Rig()
    before = bits(rig.p)
    mask = rig.fill(4, 4)
    with rig.item(Mode.XOR):
        rig.p.copy_(mask)
    assert torch.equal(bits(rig.p), before ^ int_view(mask))


def test_xor_with_a_reach_writes_only_the_rows_that_meet_it() -> None:
    """Masks in rows 0 and 3, a reach over row 3's bytes only: the XOR is narrowed to row 3,
    so row 0's mask is not applied (the apply context's reach always covers every mask it
    scattered, and scratch is zero elsewhere: that is what makes the narrowing exact)."""
    rig = Rig()
    before = bits(rig.p)
    mask = rig.view(4, 4)
    mask.view(torch.int16)[0].fill_(0x0101)
    mask.view(torch.int16)[3].fill_(0x0202)
    with rig.item(Mode.XOR, reach=(3 * 8 + 2, 3 * 8 + 4)):
        rig.p.copy_(mask)
    want = before.clone()
    want.view(4, 4)[3] ^= 0x0202
    assert torch.equal(bits(rig.p), want)
    with rig.item(Mode.XOR, reach=(200, 256)):  # beyond the copy's source: nothing to do
        rig.p.copy_(mask)
    assert torch.equal(bits(rig.p), want)


def _views(scratch: torch.Tensor) -> Iterator[torch.Tensor]:
    """Views a loader takes of a (6, 5, 4) int16 scratch view: whole, narrowed along each
    dimension (a fused row offset, a column-parallel shard), transposed and permuted."""
    v = scratch[: 6 * 5 * 4 * 2].view(torch.int16).view(6, 5, 4)
    yield v
    yield v.narrow(0, 2, 3)
    yield v.narrow(1, 1, 3)
    yield v.narrow(2, 1, 2)
    yield v.transpose(0, 1)
    yield v.permute(2, 0, 1)
    yield v.reshape(30, 4).narrow(0, 7, 11)
    yield v.reshape(-1).narrow(0, 13, 50)
    yield v[1]


@pytest.mark.parametrize("reach", [(0, 2), (10, 11), (37, 90), (100, 240), (0, 240)])
def test_the_rows_kept_hold_every_element_within_the_reach(reach: tuple[int, int]) -> None:
    """Brute force: an element of the view whose bytes meet [lo, hi) lies in a kept row."""
    scratch = torch.zeros(256, dtype=torch.uint8)
    lo, hi = reach
    for view in _views(scratch):
        rows = _rows_reaching(view, reach)
        assert rows is not None
        first, count = rows
        assert first >= 0
        assert first + count <= view.shape[0]
        offsets = torch.zeros(view.shape, dtype=torch.int64)
        for dim, (size, stride) in enumerate(zip(view.shape, view.stride(), strict=True)):
            shape = [1] * view.dim()
            shape[dim] = size
            offsets += (torch.arange(size) * stride).view(shape)
        start = (offsets + view.storage_offset()) * view.element_size()
        meets = (start + view.element_size() > lo) & (start < hi)
        row_meets = meets.reshape(view.shape[0], -1).any(dim=1)
        kept = torch.zeros(view.shape[0], dtype=torch.bool)
        kept[first : first + count] = True
        assert not (row_meets & ~kept).any(), (tuple(view.shape), view.stride(), rows)
        if view.is_contiguous():  # rows follow each other in memory: exactly those rows
            assert count == int(row_meets.sum())


def test_rows_for_no_values_a_scalar_and_a_zero_stride() -> None:
    scratch = torch.zeros(64, dtype=torch.uint8)
    assert _rows_reaching(scratch[:8].view(torch.int16), (4, 4)) == (0, 0)  # no values
    assert _rows_reaching(scratch[:2].view(torch.int16)[0], (0, 2)) is None
    assert _rows_reaching(scratch[:2].view(torch.int16).expand(4), (0, 2)) is None


def test_an_overwrite_keeps_the_mask_of_its_first_copy() -> None:
    """The active positions of a destination view are fixed when it is first written: a second
    copy into it writes the same positions (here zeros), not every non-NaN one."""
    rig = Rig()
    before = bits(rig.q)
    w = rig.view(8)
    w.fill_(float("nan"))
    w[2] = 5.0
    w[6] = -1.0
    with rig.item(Mode.OVERWRITE, Placeholder(None)):
        rig.q.copy_(w)
        rig.q.copy_(torch.zeros(8, dtype=torch.bfloat16))
    want = before.clone()
    want[[2, 6]] = 0
    assert torch.equal(bits(rig.q), want)


def test_an_overwrite_writes_only_active_positions_converted() -> None:
    rig = Rig()
    w = rig.view(8)
    w.fill_(float("nan"))
    w[1] = 3.0
    q32 = torch.zeros(8, dtype=torch.float32)
    rig32 = StorageWriteHook(ModelStorages.of([("q32", q32)]), rig.scratch)
    rig32.begin_item("w", Mode.OVERWRITE, Placeholder(None))
    with rig32:
        q32.copy_(w)  # a cast: the mask is formed from the NaN placeholder after it
    rig32.end_item()
    want = torch.tensor([0.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert torch.equal(int_view(q32), int_view(want))


def test_an_overwrite_of_the_whole_tensor_writes_every_position() -> None:
    rig = Rig()
    w = rig.fill(4, 4, seed=7)
    with rig.item(Mode.OVERWRITE, COVERS_ALL):
        rig.p.copy_(w)
    assert torch.equal(bits(rig.p), int_view(w))


def test_an_overwrite_broadcast_is_refused_before_writing() -> None:
    rig = Rig()
    before = bits(rig.p)
    with pytest.raises(PlaceholderCollisionError) as info, rig.item(Mode.OVERWRITE, COVERS_ALL):
        rig.p.copy_(rig.view(4))
    assert str(info.value) == "w: overwrite source (4,) is broadcast into ('p',)"
    assert torch.equal(bits(rig.p), before)


def test_an_exact_bit_placeholder_refusal_names_the_destination() -> None:
    rig = Rig()
    with (
        pytest.raises(PlaceholderCollisionError) as info,
        rig.item(Mode.OVERWRITE, Placeholder(-1)),
    ):
        rig.q.copy_(rig.view(8) + 0)
    assert str(info.value) == ("w: exact-bit placeholder needs an untransformed copy into ['q']")


# -- the optional post-apply check ----------------------------------------------------------------


def test_sample_sizes_and_budget() -> None:
    hook = Rig().hook
    assert hook._sample(100, torch.device("cpu")) is None  # checks off
    hook.check_budget = 5
    assert hook._sample(0, torch.device("cpu")) is None
    assert hook.check_budget == 5
    hook.check_budget = -1  # every element, every time
    assert torch.equal(hook._sample(6, torch.device("cpu")), torch.arange(6))
    assert hook.check_budget == -1
    hook.check_budget = 10
    assert torch.equal(hook._sample(4, torch.device("cpu")), torch.arange(4))
    assert hook.check_budget == 6
    picked = hook._sample(100, torch.device("cpu"))
    want = torch.randint(0, 100, (6,), generator=torch.Generator().manual_seed(0))
    assert picked is not None
    assert torch.equal(picked, want)  # seeded: a rerun checks the same positions
    assert hook.check_budget == 0
    assert hook._sample(100, torch.device("cpu")) is None


class DroppedModelWritesFake:
    """A fault: memory that silently drops the hook's own writes into model storage (the
    integer-view `bitwise_xor_`, `index_put_` and `copy_` it issues). Nothing real does this on
    demand; the post-apply check exists to catch it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *model: torch.Tensor) -> None:
        keys = {storage_key(t) for t in model}
        for method in ("bitwise_xor_", "index_put_", "copy_"):
            real = getattr(torch.Tensor, method)

            def dropped(
                self: torch.Tensor, *args: object, _real: Any = real, **kw: object
            ) -> object:
                if not self.is_floating_point() and storage_key(self) in keys:
                    return self
                return _real(self, *args, **kw)

            monkeypatch.setattr(torch.Tensor, method, dropped)


@pytest.mark.parametrize(
    ("mode", "placeholder", "what"),
    [
        (Mode.XOR, None, "XOR mask does not restore bits"),
        (Mode.OVERWRITE, Placeholder(None), "overwrite bits differ"),
        (Mode.OVERWRITE, COVERS_ALL, "overwrite bits differ"),
    ],
)
def test_the_post_apply_check_catches_a_dropped_write(
    monkeypatch: pytest.MonkeyPatch, mode: Mode, placeholder: Placeholder | None, what: str
) -> None:
    rig = Rig()
    rig.hook.check_budget = -1
    w = rig.fill(4, 4, seed=3)
    with rig.item(mode, placeholder) as out:
        rig.p.copy_(w)  # written: the check passes
    assert out[0].checked == 1
    w = rig.fill(4, 4, seed=4)  # other bits than p holds now
    before = bits(rig.p)
    DroppedModelWritesFake(monkeypatch, rig.p)
    with pytest.raises(PostApplyCheckError) as info, rig.item(mode, placeholder):
        rig.p.copy_(w)
    assert torch.equal(bits(rig.p), before)  # the fault did drop the write
    assert str(info.value) == f"w: {what}"


def test_checks_count_one_per_sampled_copy() -> None:
    rig = Rig()
    rig.hook.check_budget = -1
    flat = rig.p.view(-1)
    with rig.item(Mode.XOR) as out:
        flat[0:8].copy_(rig.view(8))
        flat[8:16].copy_(rig.view(8))
    assert out[0].checked == 2
    rig.hook.check_budget = 0
    with rig.item(Mode.XOR) as out:
        rig.q.copy_(rig.view(8))
    assert out[0].checked == 0


# -- COMPARE: what a copy would write, against what the destination holds -------------------------


def test_compare_records_exact_counts_first_positions_and_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hook_module, "COMPARE_BLOCK_BYTES", 32)  # four rows of (4,) per block
    rig = Rig()
    big = torch.zeros(12, 4, dtype=torch.bfloat16)
    hook = StorageWriteHook(ModelStorages.of([("big", big)]), rig.scratch)
    src = rig.view(12, 4)
    src.zero_()
    # One mismatch in the first block, twelve in the second, two in the third: the samples
    # stop at eight, the count does not.
    changed = [1, *range(16, 28), 40, 47]
    int_view(src).view(-1)[changed] = torch.arange(1, 16, dtype=torch.int16)
    before = bits(big)
    hook.begin_item("w", Mode.COMPARE)
    with hook:
        big.copy_(src)
    trace = hook.end_item()
    assert torch.equal(bits(big), before)  # nothing written
    assert trace.compared == 48
    assert trace.mismatches == [
        Mismatch(("big",), 15, changed[:8], [0] * 8, list(range(1, 9))),
    ]


def test_compare_of_a_broadcast_copy_and_of_a_match() -> None:
    rig = Rig()
    src = rig.view(4)
    int_view(src).copy_(torch.tensor([1, 2, 3, 4], dtype=torch.int16))
    rig.p.copy_(src.expand(4, 4))  # p now holds what the broadcast copy writes, outside the hook
    held = bits(rig.p)
    held_q = bits(rig.q)
    with rig.item(Mode.COMPARE) as out:
        rig.p.copy_(src)
        rig.q.copy_(rig.view(8))
    (trace,) = out
    assert trace.compared == 24
    (m,) = trace.mismatches
    assert m.storages == ("q",)
    expect = [i for i in range(8) if int(held_q[i]) != int(int_view(rig.view(8))[i])]
    assert m.count == len(expect)
    assert m.positions == expect
    assert torch.equal(bits(rig.p), held)


def test_compare_follows_a_broadcast_copy_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy that broadcasts is compared in one piece: its source has no rows to block by."""
    monkeypatch.setattr(hook_module, "COMPARE_BLOCK_BYTES", 8)  # one row of p per block
    rig = Rig()
    src = rig.view(4)
    int_view(src).copy_(torch.tensor([1, 2, 3, 4], dtype=torch.int16))
    rig.p.copy_(src.expand(4, 4))
    with rig.item(Mode.COMPARE) as out:
        rig.p.copy_(src)  # what it holds: no mismatch
        rig.p[1:3].copy_(src[:1])  # (1,) into (2, 4): all but the 1s differ
    (trace,) = out
    assert trace.compared == 24
    (m,) = trace.mismatches
    assert (m.count, m.positions) == (6, [1, 2, 3, 5, 6, 7])


def test_compare_of_a_single_row(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hook_module, "COMPARE_BLOCK_BYTES", 8)
    rig = Rig()
    row = rig.p[2:3]  # (1, 4)
    before = bits(row)
    src = rig.view(1, 4)
    src.view(torch.int16).copy_(before.reshape(1, 4))
    src.view(torch.int16)[0, 3] ^= 1
    with rig.item(Mode.COMPARE) as out:
        row.copy_(src)
    (m,) = out[0].mismatches
    assert (m.count, m.positions, m.held_bits) == (1, [3], [int(before[3])])


# -- writes the hook refuses ------------------------------------------------------------------


def test_a_non_copy_write_names_the_op_and_storages() -> None:
    rig = Rig()
    before = bits(rig.q)
    with pytest.raises(UnsupportedWriteError) as info, rig.item(Mode.XOR):
        rig.q.add_(1)
    assert str(info.value) == (
        "w: loader wrote into ['q'] with aten.add_.Tensor; only copy_, and fills that change "
        "no bit, are supported"
    )
    assert torch.equal(bits(rig.q), before)


# -- fills (vLLM zeroes the rows it pads a vocabulary with) -------------------------------------


@pytest.mark.parametrize("mode", [Mode.DISCOVER, Mode.XOR, Mode.OVERWRITE, Mode.COMPARE])
@pytest.mark.parametrize(
    ("fill", "value"),
    [
        (lambda t: t.fill_(0), 0.0),
        (lambda t: t.zero_(), 0.0),
        (lambda t: t.fill_(torch.tensor(-0.0)), -0.0),  # fill_.Tensor; signed zero is its bits
        (lambda t: t.fill_(float("nan")), float("nan")),
    ],
)
def test_a_fill_that_changes_no_bit_is_taken_in_every_mode(
    mode: Mode, fill: Callable[[torch.Tensor], object], value: float
) -> None:
    """The padded rows already hold the fill (every dense load wrote it): skipping the fill is
    exactly the dense load, and it is neither a copy nor a write the item made."""
    rig = Rig()
    rig.p[2:].fill_(value)
    before = bits(rig.p)
    with rig.item(mode, COVERS_ALL if mode is Mode.OVERWRITE else None) as out:
        fill(rig.p[2:])
    (trace,) = out
    assert trace.copies == []
    assert trace.mismatches == []
    assert trace.compared == 0
    assert torch.equal(bits(rig.p), before)


@pytest.mark.parametrize("mode", list(Mode))
def test_a_fill_that_would_change_bits_fails_closed(mode: Mode) -> None:
    """+0.0 into rows holding -0.0 differs in one bit: refused, and nothing is written (the
    audit too: it cannot tell whether a later copy covers what the fill would write)."""
    rig = Rig()
    rig.p[2:].fill_(-0.0)
    before = bits(rig.p)
    with pytest.raises(UnsupportedWriteError) as info, rig.item(mode):
        rig.p[2:].fill_(0)
    assert str(info.value) == (
        "w: loader fills ['p'] with 0 where they hold other bits: a dense load would write "
        "values no payload carries"
    )
    assert torch.equal(bits(rig.p), before)


@pytest.mark.parametrize(
    ("write", "op"),
    [
        (lambda w, q: torch.add(w, 1, out=q), "aten.add.out"),
        (lambda w, q: torch.neg(w, out=q), "aten.neg.out"),  # right after the positionals
    ],
)
def test_a_write_through_an_out_argument_is_refused(
    write: Callable[[torch.Tensor, torch.Tensor], object], op: str
) -> None:
    """`out=` is a written argument after read-only ones, passed by keyword."""
    rig = Rig()
    before = bits(rig.q)
    w = rig.view(8)
    with pytest.raises(UnsupportedWriteError) as info, rig.item(Mode.OVERWRITE, COVERS_ALL):
        write(w, rig.q)
    assert str(info.value) == (
        f"w: loader wrote into ['q'] with {op}; only copy_, and fills that change no bit, are "
        "supported"
    )
    assert torch.equal(bits(rig.q), before)


def test_a_write_into_a_list_of_tensors_is_refused_past_an_empty_one() -> None:
    rig = Rig()
    before = bits(rig.q)
    with pytest.raises(UnsupportedWriteError, match=r"\['q'\]"), rig.item(Mode.XOR):
        torch._foreach_add_([torch.empty(0), torch.zeros(2), rig.q], 1.0)
    assert torch.equal(bits(rig.q), before)


def test_a_fresh_hook_refuses_without_an_item_name() -> None:
    rig = Rig()
    with pytest.raises(UnsupportedWriteError) as info, rig.hook:
        rig.q.add_(1)
    assert str(info.value).startswith(": loader wrote into ['q']")


def test_a_nan_placeholder_refusal_names_the_source_dtype() -> None:
    rig = Rig()
    q16 = torch.zeros(8, dtype=torch.int16)
    hook = StorageWriteHook(ModelStorages.of([("q16", q16)]), rig.scratch)
    hook.begin_item("w", Mode.OVERWRITE, Placeholder(None))
    with pytest.raises(PlaceholderCollisionError) as info, hook:
        q16.copy_(rig.view(8, dtype=torch.int16))
    assert str(info.value) == (
        "w: copy into ['q16'] has a torch.int16 source: the NaN placeholder cannot form the "
        "active mask"
    )


def test_spans_are_recorded_only_for_copies_xor_accepts() -> None:
    rig = Rig()
    flat = rig.p.view(-1)
    with rig.item(Mode.DISCOVER) as out:
        flat[0:4].copy_(rig.view(4) * 2)  # transformed: not an XOR copy, its span not kept
        flat[0:4].copy_(rig.view(4))
    assert [c.reason for c in out[0].copies] == [
        "source is not a view of scratch (the loader transformed the values)",
        "",
    ]


def test_contiguous_copies_of_different_element_sizes_compare_bytes() -> None:
    rig = Rig()
    wide = rig.p.view(-1).view(torch.int32)  # (8,): the same 32 bytes in 4-byte elements
    with rig.item(Mode.DISCOVER) as out:
        rig.p.view(-1)[0:4].copy_(rig.view(4))  # bytes 0-8
        wide[2:4].copy_(rig.view(2, dtype=torch.int32))  # bytes 8-16: adjacent
        wide[1:2].copy_(rig.view(1, dtype=torch.int32))  # bytes 4-8: inside the first
    assert [c.reason for c in out[0].copies] == ["", "", OVERLAP]


def test_a_budget_of_one_checks_one_element() -> None:
    hook = Rig().hook
    hook.check_budget = 1
    picked = hook._sample(100, torch.device("cpu"))
    assert picked is not None
    assert picked.shape == (1,)
    assert hook.check_budget == 0
