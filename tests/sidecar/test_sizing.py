"""Automatic export chunk and bucket sizes (`baseline/sizing.py`): enough units per producer
for the pipeline to overlap, within the size bounds, the same on every producer, and what a
sidecar started on a reference checkpoint actually uses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import SecretStr, ValidationError
from safetensors.torch import save_file

from refit_protocol.sizes import AUTO
from refit_sidecar.baseline.config import BaselineConfig
from refit_sidecar.baseline.sizing import (
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    TARGET_UNITS,
    auto_chunk_bytes,
    resolve_sizes,
)
from refit_sidecar.baseline.source import SourceBaseline
from refit_sidecar.pipeline.config import PipelineConfig
from refit_sidecar.pipeline.producer import ProducerPipeline
from refit_sidecar.producer.main import ProducerProcessConfig, build
from refit_sidecar.producer.resume import checkpoint_nbytes
from tests.harness.procs import free_port

MIB, GB = 1 << 20, 10**9


@pytest.mark.parametrize(
    ("total", "producers", "chunk"),
    [
        (622_891_008, 1, 32 * MIB),  # the bench's H = 594 MiB: 18 units (the hand-tuned size)
        (155_731_968, 1, 8 * MIB),  # --quick: 148.5 MiB -> 19 units
        (60 * GB, 8, 256 * MIB),  # 7.5 GB per producer: 28 units of the largest size
        (1000 * GB, 64, 256 * MIB),  # 1T over 64 producers: ~58 units each
        (8 * GB, 1, 256 * MIB),  # 500 MB units would exceed the bound
        (10 * MIB, 1, MIN_CHUNK_BYTES),  # a tiny model: never below 4 MiB
        (1, 1, MIN_CHUNK_BYTES),
    ],
)
def test_auto_chunk_gives_every_producer_enough_units(
    total: int, producers: int, chunk: int
) -> None:
    got = auto_chunk_bytes(total, producers)
    assert got == chunk
    assert got & (got - 1) == 0  # a power of two
    share = total / producers
    if MIN_CHUNK_BYTES < got < MAX_CHUNK_BYTES:
        assert TARGET_UNITS <= share / got < 2 * TARGET_UNITS


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="0 producers"):
        auto_chunk_bytes(GB, 0)
    with pytest.raises(ValueError, match="0 bytes"):
        auto_chunk_bytes(0, 1)


def test_resolution_keeps_configured_sizes_and_says_how_it_chose() -> None:
    fixed = resolve_sizes(64 * MIB, 128 * MIB, total_bytes=GB, producers=1)
    assert (fixed.chunk_bytes, fixed.bucket_bytes) == (64 * MIB, 128 * MIB)
    auto = resolve_sizes(AUTO, AUTO, total_bytes=622_891_008, producers=1)
    assert (auto.chunk_bytes, auto.bucket_bytes) == (32 * MIB, 32 * MIB)
    assert "about 19 chunk(s)" in auto.rule
    assert "a bucket is one chunk" in auto.rule
    unknown = resolve_sizes(AUTO, 7, total_bytes=None, producers=3)
    assert (unknown.chunk_bytes, unknown.bucket_bytes) == (MAX_CHUNK_BYTES, 7)
    assert "staging.reference_checkpoint" in unknown.rule


@pytest.mark.parametrize("bad", [0, -1, "lots", True, 1.5])
def test_size_settings_refuse_what_is_neither_a_size_nor_auto(bad: object) -> None:
    with pytest.raises(ValidationError, match="export_chunk_bytes"):
        BaselineConfig(export_chunk_bytes=bad)
    with pytest.raises(ValidationError, match="bucket_bytes"):
        PipelineConfig(bucket_bytes=bad)


def test_every_producer_derives_the_same_chunk_and_the_pipeline_one_bucket(
    tmp_path: Path,
) -> None:
    baselines = [
        SourceBaseline(
            producer=p, producers=3, config=BaselineConfig(in_memory=True), total_bytes=GB
        )
        for p in range(3)
    ]
    assert {b.chunk_bytes for b in baselines} == {auto_chunk_bytes(GB, 3)} == {16 * MIB}
    pipeline = ProducerPipeline(baselines[0], transport=None)  # type: ignore[arg-type]
    assert pipeline.bucket_bytes == 16 * MIB
    fixed = ProducerPipeline(baselines[0], None, PipelineConfig(bucket_bytes="3MiB"))  # type: ignore[arg-type]
    assert fixed.bucket_bytes == 3 * MIB


def test_a_sidecar_sizes_from_its_reference_checkpoint(tmp_path: Path) -> None:
    """The trainer chunks with what the sidecar's status reports: the size derived from the
    reference checkpoint's headers (every producer reads the same one), not the fallback."""
    reference = tmp_path / "ckpt"
    reference.mkdir()
    tensors = {
        "a": torch.zeros(1024, 1024, dtype=torch.bfloat16),
        "b": torch.zeros(3, dtype=torch.float32),
    }
    save_file(tensors, str(reference / "model.safetensors"))
    assert checkpoint_nbytes(reference) == 2 * 1024 * 1024 + 12

    def sidecar(with_reference: bool) -> int:
        staging = {"inbox": str(tmp_path / "inbox"), "candidate_dir": str(tmp_path / "cand")}
        if with_reference:
            staging["reference_checkpoint"] = str(reference)
        process = build(
            ProducerProcessConfig(
                port=free_port(),
                token=SecretStr("t" * 32),
                baseline={"in_memory": True},
                staging=staging,
            )
        )
        try:
            return process.baseline.chunk_bytes
        finally:
            process.close()

    (tmp_path / "inbox").mkdir()
    assert sidecar(True) == MIN_CHUNK_BYTES
    assert sidecar(False) == MAX_CHUNK_BYTES
