"""The audit (apply/audit.py): the native loader runs over a checkpoint in COMPARE mode and
proves each destination holds exactly what a dense load would write, writing nothing.

Over the loader matrix (split, fused, transposed, transformed, cast, padded, skipped, FP8,
buffers): after refits through XOR and overwrite retries the audit passes; one flipped bit on one
element is reported with its tensor, count, position and both bit patterns; weights are never
modified (checked by fingerprint), whatever the audit finds."""

from __future__ import annotations

import pytest
import torch

from refit_sidecar.apply import ApplyContext, UnsupportedWriteError, prewarm
from refit_sidecar.apply import hook as hook_module
from refit_sidecar.apply.audit import audit
from refit_sidecar.bits import int_view
from refit_sidecar.codec.records import Op, TensorMeta
from refit_sidecar.fingerprint import module_fingerprint
from tests.sidecar.apply.loader_matrix import CANONICAL, FillingModel, MatrixModel, canonical_random
from tests.sidecar.apply.test_context import items, mixed, perturb, special_old

METAS = {n: TensorMeta(n, shape, dtype) for n, (shape, dtype) in CANONICAL.items()}


def dense(state: dict[str, torch.Tensor], cls: type[MatrixModel] = MatrixModel) -> MatrixModel:
    m = cls()
    m.load_weights((n, t.clone()) for n, t in state.items())
    return m


def context(model: MatrixModel) -> ApplyContext:
    ctx = ApplyContext(model, METAS)
    assert not prewarm(ctx).unsupported
    return ctx


def test_after_xor_and_overwrite_retries_the_audit_passes_and_writes_nothing() -> None:
    v0 = special_old(canonical_random(50))
    v1, v2 = perturb(v0, 0.05, seed=51), perturb(v0, 0.2, seed=52)
    model = dense(v0)
    ctx = context(model)
    ctx.apply(items(v0, v1, mixed))  # XOR where the loader allows it
    first = items(v1, v2, mixed)
    ctx.apply(first[: len(first) // 2])  # a failed attempt's partial writes
    ctx.apply(items(v1, v2, lambda _n: Op.OVERWRITE))  # the overwrite retry
    before = module_fingerprint(model)
    report = audit(ctx, v2.items())
    assert report.ok, report.mismatches
    assert report.skipped == ["skip.weight"]  # held by another rank: nothing to compare
    assert report.tensors == len(CANONICAL) - 1
    assert report.elements >= sum(t.numel() for n, t in v2.items() if n != "skip.weight")
    assert module_fingerprint(model) == before
    # Against the previous version instead: every changed tensor is reported, nothing written.
    stale = audit(ctx, v1.items())
    assert not stale.ok
    assert {m.name for m in stale.mismatches} >= {"plain.weight", "q.weight", "fp8.weight"}
    assert module_fingerprint(model) == before


#: Where a copy writes a same-dtype, same-layout view of the canonical tensor: the reported
#: position is the canonical flat position, and the two patterns differ by the flipped bit.
_PLAIN_LAYOUT = {"plain.weight", "fp8.weight", "scale", "count", "split.weight"}


@pytest.mark.parametrize("name", sorted(set(CANONICAL) - {"skip.weight"}))
def test_one_flipped_bit_is_found_with_its_position_and_patterns(name: str) -> None:
    """Every loader shape of the matrix (split, fused at offsets, transposed, transformed, cast,
    padded, overlapping, FP8, buffers): one bit of one element changed through a legitimate path
    (a dense load of a checkpoint with that value altered) is found on that tensor only, and
    the audit writes nothing."""
    state = canonical_random(53)
    model = dense(state)
    ctx = context(model)
    dtype = state[name].dtype
    bit = 22 if dtype.itemsize == 4 else 1  # fp32: a mantissa bit that bf16 storage keeps
    bits = int_view(state[name]).clone().reshape(-1)
    at = min(3, bits.numel() - 1)
    bits[at] ^= 1 << bit
    flipped = dict(state)
    flipped[name] = bits.view(dtype).reshape(state[name].shape)
    model.load_weights([(name, flipped[name].clone())])
    before = module_fingerprint(model)
    report = audit(ctx, state.items())
    assert module_fingerprint(model) == before
    assert {m.name for m in report.mismatches} == {name}
    for m in report.mismatches:
        assert all(h != e for h, e in zip(m.held_bits, m.expected_bits, strict=True))
    if name == "overlap.weight":  # element 3 lies where both copies write: seen by each
        assert report.mismatched_elements == 2
    else:
        assert report.mismatched_elements == 1
    if name in _PLAIN_LAYOUT:
        (m,) = report.mismatches
        assert m.positions == [at]
        assert m.held_bits[0] ^ m.expected_bits[0] == 1 << bit  # exactly the flipped bit
    assert audit(ctx, flipped.items()).ok  # the flipped checkpoint is exactly what it holds


def test_a_non_copy_write_fails_closed_midway_and_writes_nothing() -> None:
    state = canonical_random(54)
    model = dense(state, FillingModel)
    ctx = ApplyContext(model, METAS)
    before = module_fingerprint(model)
    assert list(state)[-1] == "plain.weight"  # midway: every other tensor was compared first
    with pytest.raises(UnsupportedWriteError):
        audit(ctx, state.items())
    assert module_fingerprint(model) == before


def test_blocks_of_rows_report_exact_counts_and_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison runs in blocks of rows (bounded temporaries): mismatches in later blocks
    keep their flat positions in the destination view and the count stays exact."""
    monkeypatch.setattr(hook_module, "COMPARE_BLOCK_BYTES", 64)  # 2 rows of 16 bf16 per block
    state = canonical_random(55)
    model = dense(state)
    ctx = context(model)
    name = "fp8.weight"  # (16, 16) FP8: 4 rows per 64-byte block
    bits = int_view(state[name]).clone().reshape(-1)
    changed = [5, 70, 200, 255]
    for i in changed:
        bits[i] ^= 0x01
    model.load_weights([(name, bits.view(state[name].dtype).reshape(16, 16).clone())])
    report = audit(ctx, state.items())
    (m,) = report.mismatches
    assert m.name == name
    assert m.count == len(changed)
    assert m.positions == changed
    assert m.held_bits == [int(b) for b in bits[changed]]
