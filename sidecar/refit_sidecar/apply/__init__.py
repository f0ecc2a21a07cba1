"""❻ apply: place each decoded change through the serving runtime's own `load_weights()`.

A storage-scoped dispatch hook turns the loader's final copies into parameter/buffer storage into
XOR or masked-overwrite writes; no model-family or tensor-layout rule exists anywhere here.
"""

from refit_sidecar.apply.context import ApplyContext, ApplyStats, NativeModel
from refit_sidecar.apply.errors import (
    ApplyError,
    LoaderMismatchError,
    OverlappingXorError,
    PlaceholderCollisionError,
    PostApplyCheckError,
    StorageReplacedError,
    UnsupportedWriteError,
    XorTransformError,
)
from refit_sidecar.apply.prewarm import PrewarmReport, prewarm

__all__ = [
    "ApplyContext",
    "ApplyError",
    "ApplyStats",
    "LoaderMismatchError",
    "NativeModel",
    "OverlappingXorError",
    "PlaceholderCollisionError",
    "PostApplyCheckError",
    "PrewarmReport",
    "StorageReplacedError",
    "UnsupportedWriteError",
    "XorTransformError",
    "prewarm",
]
