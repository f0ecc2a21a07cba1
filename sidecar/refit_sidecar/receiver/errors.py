"""Typed receiver errors; the HTTP layer answers each with its HTTP status and the error body
of every plane (`refit_protocol.errors.ErrorBody`) whose `code` is the class's `code`."""

from __future__ import annotations


class ReceiverError(Exception):
    """A control call cannot be served in the current state (HTTP 409 unless said otherwise)."""

    http_status = 409
    code = "conflict"


class BadRequestError(ReceiverError):
    """The request is well-formed JSON but semantically invalid (HTTP 400)."""

    http_status = 400
    code = "bad_request"


class BadCheckpointError(ReceiverError):
    """The checkpoint a restore or an audit names cannot be read: a file that is not a regular
    file, or not a valid safetensors file (HTTP 422; the message names the file and why)."""

    http_status = 422
    code = "bad_checkpoint"


class ObsoleteAttemptError(ReceiverError):
    """A later prepare replaced this attempt: the call is ignored (HTTP 409)."""

    code = "obsolete"


class UnknownAttemptError(ReceiverError):
    """This node was never prepared for the attempt (HTTP 409)."""

    code = "unknown_attempt"


class ReceptionError(ValueError):
    """A payload failed a reception check that is not a codec error (loader classification,
    identity, producer set); the attempt fails before the payload is applied."""
