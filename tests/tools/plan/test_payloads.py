"""The planner's payloads are the producer's: for a tensor layout, `producer_regions` gives each
producer as many payloads as the real pipeline seals (every chunk changed), for producer counts,
chunk limits (a tensor above the limit is a chunk of its own), bucket sizes and split sizes
(a larger tensor travels in parts); and a Hugging Face config's estimated layout adds up to its
H."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from refit_sidecar.baseline import BaselineConfig, SourceBaseline, chunk_export
from refit_sidecar.baseline.chunks import chunk_bounds
from refit_sidecar.baseline.sizing import auto_split_bytes
from refit_sidecar.codec.wire import EncodedPayload
from refit_sidecar.pipeline import PipelineConfig, ProducerPipeline
from refit_sidecar.transport import TransportSummary
from refit_tools.plan import sizing
from refit_tools.plan.payloads import bucket_regions, payload_regions, producer_regions
from tests.harness.exports import flip_bits, random_export


class CapturingTransport:
    """Keeps what the pipeline sends (the planner test reads the payload count only)."""

    def __init__(self) -> None:
        self.sent: list[EncodedPayload] = []

    def send(self, attempt: str, payload: EncodedPayload) -> None:
        self.sent.append(payload)

    def stop_and_wait(self, attempt: str) -> TransportSummary:
        size = sum(p.size for p in self.sent)
        return TransportSummary(attempt, len(self.sent), size, len(self.sent))

    def cleanup(self, attempt: str) -> None:
        self.sent.clear()


def shape(i: int, _: torch.Generator) -> tuple[int, ...]:
    """A layout with a large first and last tensor (embedding, head) and small ones between."""
    return (64, 96) if i in (0, 19) else (8, 16 + 4 * (i % 5))


@pytest.mark.parametrize(
    ("producers", "chunk", "bucket", "split"),
    [
        (1, 4096, 4096, "auto"),
        (1, 2048, 9000, "auto"),
        (2, 4096, 6000, "auto"),
        (3, 1024, 1, "auto"),
        (2, 1 << 20, 1 << 30, "auto"),
        (1, 4096, 4096, 1 << 30),  # every tensor whole
        (2, 2048, 2048, 5000),
        (1, 4096, 65536, 5000),  # parts far below the bucket: one payload each
        (2, 2048, 30000, 3000),
    ],
)
def test_regions_count_the_payloads_the_pipeline_seals(
    producers: int, chunk: int, bucket: int, split: int | str
) -> None:
    v0 = random_export(20, 0, (torch.bfloat16, torch.float32), shape)
    v1 = flip_bits(v0, 1, 0.5)  # every tensor, so every chunk, changes
    sizes = [t.numel() * t.element_size() for _, t in v0]
    split_bytes = split if isinstance(split, int) else auto_split_bytes(chunk, bucket)
    expected = producer_regions(sizes, producers, chunk, bucket, split_bytes)
    if split == "auto" and max(sizes) > split_bytes:
        assert sum(map(len, expected)) > sum(
            map(len, producer_regions(sizes, producers, chunk, bucket))
        )
    config = BaselineConfig(export_chunk_bytes=chunk, in_memory=True)
    for p in range(producers):
        baseline = SourceBaseline(producer=p, producers=producers, config=config)
        baseline.load_initial(chunk_export(v0, chunk))
        sink = CapturingTransport()
        config_p = PipelineConfig(bucket_bytes=bucket, split_bytes=split)
        pipeline = ProducerPipeline(baseline, sink, config_p)
        sealed = pipeline.run("a1", chunk_export(v1, chunk))
        assert sealed.payloads == len(expected[p]), (p, expected[p])
        owned = [chunk_bounds(sizes, chunk)[i] for i in baseline.owned_chunks]
        assert sum(expected[p]) == sum(sum(sizes[a:b]) for a, b in owned)
    assert payload_regions(sizes, producers, chunk, bucket, split_bytes) == max(expected, key=sum)


def test_bucket_regions_close_as_the_bucketer_does() -> None:
    assert bucket_regions([3, 3, 3], 6) == (6, 3)
    assert bucket_regions([5, 3], 6) == (5, 3)  # 5 + 3 would pass the target: closed first
    assert bucket_regions([10, 1], 6) == (10, 1)  # a chunk over the target is a payload alone
    assert bucket_regions([], 6) == ()


def test_an_hf_config_layout_adds_up_to_its_h(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "hidden_size": 256,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 1000,
                "num_experts": 4,
                "moe_intermediate_size": 64,
                "torch_dtype": "bfloat16",
            }
        )
    )
    size = sizing.from_hf_config(config)
    assert size.tensor_bytes is not None
    assert sum(size.tensor_bytes) == size.model_bytes
    assert size.tensor_bytes[0] == size.first_tensor_bytes == 1000 * 256 * 2
    assert size.tensor_bytes[-1] == size.last_tensor_bytes == 1000 * 256 * 2
    # per layer: 2 norms, q, k, v, o, the router and 4 experts x 3
    assert len(size.tensor_bytes) == 2 + 3 * (6 + 1 + 12) + 1
