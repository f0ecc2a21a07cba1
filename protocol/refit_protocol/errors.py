"""Errors every control-plane endpoint can raise, whichever side implements it."""

from __future__ import annotations


class EndpointError(RuntimeError):
    """A sidecar could not be reached or answered with an error (the attempt fails)."""
