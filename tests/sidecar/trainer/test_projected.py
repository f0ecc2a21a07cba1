"""`ProjectedSource`'s pure parts: the shard baseline advances only with the commit, and the
pieces of one tensor from several shards merge into one sorted change. The collective path runs
on real Megatron Bridge ranks in test_megatron.py (published through real sidecars)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from refit_sidecar.bits import int_view
from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.trainer.errors import CandidateMismatchError, StagingStateError
from refit_sidecar.trainer.projected import ShardBaseline, _merged


def _bits(*values: int) -> np.ndarray:
    return np.array(values, np.int16)


def test_a_staged_version_is_folded_in_once_it_commits() -> None:
    base = ShardBaseline()
    base.reset(0, {7: _bits(1, 2, 3, 4)})
    base.stage(1, {7: (np.array([1, 3]), _bits(20, 40))})
    assert base.settle(1)[7].tolist() == [1, 20, 3, 40]
    assert base.version == 1
    base.stage(2, {7: (np.array([0]), _bits(10))})
    assert base.settle(2)[7].tolist() == [10, 20, 3, 40]


def test_a_version_that_did_not_commit_is_compared_again_from_the_same_baseline() -> None:
    base = ShardBaseline()
    base.reset(3, {0: _bits(1, 2)})
    base.stage(4, {0: (np.array([0]), _bits(9))})
    assert base.settle(3)[0].tolist() == [1, 2]  # v4 dropped: published again
    base.stage(4, {0: (np.array([1]), _bits(8))})
    assert base.settle(4)[0].tolist() == [1, 8]  # only the second try's changes


def test_a_baseline_that_cannot_match_the_sidecars_is_refused() -> None:
    base = ShardBaseline()
    with pytest.raises(StagingStateError, match=r"Publisher\.initialize"):
        base.settle(0)
    base.reset(0, {0: _bits(1)})
    with pytest.raises(StagingStateError, match="holds v0, the sidecars committed v2"):
        base.settle(2)


def test_pieces_from_several_shards_merge_sorted_in_the_tensors_dtype() -> None:
    meta = TensorMeta("w", (2, 4), torch.bfloat16)
    new = torch.randn(8).to(torch.bfloat16)
    lanes = int_view(new).numpy()
    # two row-parallel shards: columns 0-1 and 2-3 of each row, interleaved in flat order
    left, right = np.array([0, 5]), np.array([2, 7])
    change = _merged(meta, [(right, lanes[right]), (left, lanes[left])])
    assert change.positions.tolist() == [0, 2, 5, 7]
    assert change.values.dtype == torch.bfloat16
    assert torch.equal(int_view(change.values), int_view(new[[0, 2, 5, 7]]))
    assert _merged(meta, []).positions.numel() == 0
    with pytest.raises(CandidateMismatchError, match="two shards projected the same element"):
        _merged(meta, [(left, lanes[left]), (left, lanes[left])])
