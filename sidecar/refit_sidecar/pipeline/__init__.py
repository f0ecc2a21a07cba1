"""The producer pipeline: bounded, overlapping compare/encode/compress/send stages."""

from refit_sidecar.pipeline.bucket import Bucket, Bucketer
from refit_sidecar.pipeline.config import PipelineConfig
from refit_sidecar.pipeline.metrics import PipelineMetrics, StageStats
from refit_sidecar.pipeline.producer import PipelineError, ProducerPipeline

__all__ = [
    "Bucket",
    "Bucketer",
    "PipelineConfig",
    "PipelineError",
    "PipelineMetrics",
    "ProducerPipeline",
    "StageStats",
]
