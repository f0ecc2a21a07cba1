"""Errors `SourceBaseline` raises; after any of them the committed bits are unchanged, except
after `BaselinePoisonedError`."""

from __future__ import annotations


class BaselineError(RuntimeError):
    """Base class of baseline errors; the baseline's committed bits are unchanged."""


class ExportMismatchError(BaselineError):
    """A chunk does not match the export plan (names, shapes, dtypes, chunking or ownership)."""


class PendingStateError(BaselineError):
    """The call does not fit the pending-delta state (other attempt pending, incomplete, ...)."""


class BaselinePoisonedError(BaselineError):
    """A commit failed part way; the baseline must be rebuilt from a fresh first export."""
