"""Transports that carry payloads from producers to receivers (see `base.Transport`)."""

from refit_sidecar.transport.base import Transport, TransportSummary

__all__ = ["Transport", "TransportSummary"]
