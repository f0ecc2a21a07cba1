"""Errors every control-plane endpoint can raise, whichever side implements it, and the one
JSON error body every HTTP plane answers with (`ErrorBody`)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class EndpointError(RuntimeError):
    """A sidecar could not be reached or answered with an error (the attempt fails)."""


class PeerAuthenticationError(EndpointError):
    """A peer refused this component's token (HTTP 401/403): the two hold different tokens.
    Retrying cannot help, so callers fail fast and name the peer instead of waiting for it."""


class ConfigurationError(ValueError):
    """A setting that cannot work, found at any time (e.g. a peer refusing the token): the
    command exits 2 with one line, even after its start-up (`refit_protocol.kit.cli`)."""


class ListenError(ConfigurationError):
    """A service cannot listen where its settings say (address in use, not this host's, no
    permission): a configuration error, so it names the setting to change."""

    def __init__(self, setting: str, address: str, reason: str) -> None:
        super().__init__(f"cannot listen on {address} (setting `{setting}`): {reason}")
        self.setting, self.address = setting, address


def listen_error(setting: str, address: str, exc: BaseException) -> ListenError:
    """The ListenError for a failed bind of `address`, with the OS's reason in lower case."""
    reason = getattr(exc, "strerror", None) or str(exc)
    # asyncio: "error while attempting to bind on address ('host', port): reason"
    reason = reason.rpartition("): ")[2] if reason.startswith("error while") else reason
    reason = reason.split(" (addr=", 1)[0]  # pyzmq repeats the address
    return ListenError(setting, address, reason[:1].lower() + reason[1:])


#: Machine codes every HTTP plane uses for its own refusals (services add their own, e.g. the
#: receiver's `obsolete` or the trainer handoff's `export_mismatch`).
BAD_REQUEST = "bad_request"
UNAUTHORIZED = "unauthorized"
FORBIDDEN = "forbidden"
NOT_FOUND = "not_found"
METHOD_NOT_ALLOWED = "method_not_allowed"
TOO_LARGE = "too_large"
CONFLICT = "conflict"
INTERNAL = "internal"
UNAVAILABLE = "unavailable"

#: The code of an HTTP status when a plane has no more specific one.
CODE_OF_STATUS = {
    400: BAD_REQUEST,
    401: UNAUTHORIZED,
    403: FORBIDDEN,
    404: NOT_FOUND,
    405: METHOD_NOT_ALLOWED,
    409: CONFLICT,
    413: TOO_LARGE,
    500: INTERNAL,
    503: UNAVAILABLE,
}


class ErrorBody(BaseModel):
    """The one error body of every KubeRefit HTTP plane (receiver, producer, coordinator,
    operator health/metrics and webhook, and the refit control path inside vLLM):
    `{"error": <one line for people>, "code": <machine code>, "details": {...}}`.

    `error` stays the human message (what every client has always printed), `code` is what
    programs branch on (`CODE_OF_STATUS`, or a service's own: the receiver's `obsolete`, the
    trainer handoff's `export_mismatch`), `details` is optional structure (e.g. the field
    errors of a malformed body under `errors`)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    error: str
    code: str
    details: dict[str, Any] = Field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def of(cls, status: int, message: str, code: str | None = None, **details: Any) -> ErrorBody:
        """The body for an answer of HTTP `status` (`code` defaults to the status's)."""
        return cls(error=message, code=code or CODE_OF_STATUS.get(status, "error"), details=details)

    @classmethod
    def parse(cls, raw: bytes | str, status: int = 0) -> ErrorBody:
        """What a client makes of an error answer: never raises. A body that is not this
        schema (a proxy's page, an older peer's `{"error", "status"}`) keeps its text as the
        message."""
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            return cls.of(status, " ".join(text[:300].split()) or f"HTTP {status}")
        code = data.get("code") or data.get("status")  # `status`: receivers before the schema
        details = data.get("details")
        return cls(
            error=str(data.get("error") or data.get("message") or data.get("detail") or data),
            code=str(code) if code else CODE_OF_STATUS.get(status, "error"),
            details=details if isinstance(details, dict) else {},
        )
