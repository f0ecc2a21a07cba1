"""Errors every control-plane endpoint can raise, whichever side implements it."""

from __future__ import annotations


class EndpointError(RuntimeError):
    """A sidecar could not be reached or answered with an error (the attempt fails)."""


class PeerAuthenticationError(EndpointError):
    """A peer refused this component's token (HTTP 401/403): the two hold different tokens.
    Retrying cannot help, so callers fail fast and name the peer instead of waiting for it."""
