"""The producer pipeline: bounded, overlapping stages of one owner, compare (❶), encode and
compress (❸), send (❹)."""

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
