"""Typed failures of the apply path. Every one fails the attempt closed: the coordinator retries
with overwrites (which repair partial writes) or retires the receiver; none is ever ignored."""

from __future__ import annotations


class ApplyError(RuntimeError):
    """Base class: the item could not be applied with dense-refit semantics."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name


class UnsupportedWriteError(ApplyError):
    """The loader wrote into parameter/buffer storage with something other than `copy_`."""


class XorTransformError(ApplyError):
    """An XOR copy whose source is not an unmodified same-dtype view of scratch."""


class OverlappingXorError(ApplyError):
    """Two XOR copies of one item write overlapping destination bytes."""


class PlaceholderCollisionError(ApplyError):
    """An active value cannot be told apart from the placeholder on this loader path."""


class LoaderMismatchError(ApplyError):
    """The names the loader reported as loaded do not match the intercepted copies."""


class StorageReplacedError(ApplyError):
    """The loader swapped a parameter's storage instead of writing into it."""


class PostApplyCheckError(ApplyError):
    """An optional post-apply check found bits that differ from what the copy must produce."""


class ScratchAllocationError(ApplyError):
    """Scratch for a canonical tensor cannot be allocated on this device (declared too large)."""
