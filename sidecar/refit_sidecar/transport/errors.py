"""Errors a transport raises from `send` / `stop_and_wait`; each fails the attempt."""

from __future__ import annotations


class TransportError(RuntimeError):
    """Delivery of a payload failed; the message says where and why."""


class AttemptObsoleteError(TransportError):
    """A receiver answered that a later prepare replaced this attempt."""


class PayloadRejectedError(TransportError):
    """A receiver rejected the payload (digest, schema, id reuse); the attempt has failed."""


class DeliveryTimeoutError(TransportError):
    """No acknowledgment within the configured retries or waiting time (peer dead or stuck)."""


class TransportStoppedError(TransportError):
    """`stop_and_wait` or `cleanup` was called for this attempt; no more sends."""
