"""Chunks given as changes (`producer.changes`), sent to a real producer service over HTTP: a
hostile or broken file is refused with a typed error that names the tensor, the inbox is left
empty and nothing is staged; the right publish of the same version then goes through."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from refit_protocol.producer_api import CandidateChunkAck, CandidateChunkRequest
from refit_sidecar.baseline.chunks import plan_chunks
from refit_sidecar.trainer.chunk_files import change_keys, write_chunk_file
from refit_sidecar.trainer.errors import ChunkFileError
from refit_sidecar.trainer.publisher import Publisher
from refit_sidecar.trainer.state_dict import StateDictSource
from refit_sidecar.trainer.synthetic import SyntheticTrainer
from tests.harness.s3 import S3Server
from tests.sidecar.trainer.sidecars import ChangesOf, run_transition, serve_sidecars
from tests.sidecar.trainer.test_publisher import (
    CHUNK,
    assert_bits_equal,
    inbox_files,
    replay,
    weights,
)

#: (what is wrong, the file's two entries for the first tensor, the error's words)
BROKEN = {
    "unsorted": (torch.tensor([5, 3]), None, "increase strictly"),
    "repeated": (torch.tensor([3, 3]), None, "increase strictly"),
    "outside": (torch.tensor([64 * 64]), None, "outside its 4096 elements"),
    "negative": (torch.tensor([-1]), None, "outside its 4096 elements"),
    "positions dtype": (torch.tensor([1], dtype=torch.int32), None, "1-D int64 vector"),
    "values dtype": (torch.tensor([1]), torch.ones(1), "values must be 1 torch.bfloat16"),
    "values length": (torch.tensor([1, 2]), torch.ones(3, dtype=torch.bfloat16), "values must"),
    "too many": (torch.arange(5000), torch.ones(5000, dtype=torch.bfloat16), "more changes"),
}


@pytest.mark.parametrize(
    "broken", [*BROKEN, "entry missing", "first export", "not listed", "name collides"]
)
async def test_a_broken_change_is_refused_and_leaves_nothing_staged(
    tmp_path: Path, payload_s3: S3Server, broken: str
) -> None:
    v0 = weights()
    async with serve_sidecars(tmp_path, 1, payload_s3, chunk_bytes=CHUNK) as sidecars:
        side = sidecars[0]
        pub = Publisher(side.publisher_config())
        await asyncio.to_thread(pub.initialize, StateDictSource(v0))
        layout = list(side.service.baseline.metadata.values())
        metas = plan_chunks(layout, CHUNK)[0]
        names = [m.name for m in metas]
        first = names[0]
        entries: list[tuple[str, torch.Tensor]] = [(n, v0[n]) for n in names[1:]]
        purpose, changed = "next", [first]
        positions, values = torch.tensor([1, 2]), torch.ones(2, dtype=torch.bfloat16)
        words = ""
        if broken in BROKEN:
            positions, given, words = BROKEN[broken]
            values = given if given is not None else torch.ones(positions.numel()).bfloat16()
        keys = change_keys(first)
        entries += [(keys[0], positions), (keys[1], values)]
        if broken == "entry missing":
            entries.pop()
            words = "the file holds"
        elif broken == "first export":
            purpose, words = "initial", "whole tensors, not changes"
        elif broken == "not listed":
            changed, words = [], "the file holds"
        elif broken == "name collides":
            names[1] = keys[0]  # a whole tensor named like the first one's positions
            words = "collides"
        write_chunk_file(side.inbox, "c0.safetensors", entries)
        request = CandidateChunkRequest(
            version=0 if purpose == "initial" else 1,
            purpose=purpose,
            index=0,
            file="c0.safetensors",
            names=names,
            changed=changed,
        )
        with pytest.raises(ChunkFileError, match=words.replace("[", r"\[")):
            await asyncio.to_thread(
                pub._call, "POST", "/candidate/chunk", request, CandidateChunkAck
            )
        assert inbox_files(side) == []
        assert side.service.candidate_version is None
        assert side.service._staging is not None
        assert side.service._staging.chunks(1) == {}
        # Nothing stuck, the baseline untouched: the right changes of v1 go through.
        v1 = SyntheticTrainer(v0, relative_step=1e-3, seed=4).step()
        coordinator = asyncio.create_task(run_transition(sidecars, 1))
        await asyncio.to_thread(pub.publish, 1, ChangesOf(v0, v1))
        attempt, _ = await coordinator
        assert_bits_equal(replay(v0, sidecars, attempt), v1)
