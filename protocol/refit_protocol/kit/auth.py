"""Shared-token authentication for every delivery endpoint (HTTP bearer, ZeroMQ frame metadata).

One comparison function, constant-time, so no endpoint can leak the token through timing.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import SecretStr

from refit_protocol.kit.tokens import (
    DEFAULT_ROTATION_GRACE_S,
    FileTokenRing,
    TokenRing,
    read_token_file,
    ring_accepts,
)
from refit_protocol.pod_contract import TOKEN_FILE_ENV

#: Environment variable read when neither a token nor a token file is configured.
TOKEN_ENV = "KUBEREFIT_TOKEN"  # noqa: S105 - the name of a variable, not a secret


def tokens_equal(expected: str | None, given: str | None) -> bool:
    """True when no token is required, or `given` equals `expected` (constant time)."""
    if not expected:
        return True
    if given is None:
        return False
    return hmac.compare_digest(expected.encode(), given.encode())


def http_bearer(token: str) -> str:
    """What KubeRefit's HTTP clients send instead of the token: a one-way derivation of it.

    The control planes are plain HTTP, and some calls cross clusters (S3 manifests, the operator);
    a captured bearer then reveals nothing the relay's Curve keys or the payload MAC key are
    derived from (docs/security.md)."""
    digest = hashlib.blake2b(token.encode(), digest_size=32, person=b"kr-http-bearer").hexdigest()
    return f"kr1.{digest}"


def bearer_header(token: str | None) -> dict[str, str]:
    """The Authorization header of a call to a KubeRefit endpoint ({} without a token)."""
    return {"Authorization": f"Bearer {http_bearer(token)}"} if token else {}


def bearer_ok(expected: str | None, authorization: str) -> bool:
    """Check an HTTP `Authorization` header against the expected token: the derived bearer
    (`http_bearer`) that KubeRefit's clients send, or the token itself (curl, scripts)."""
    given = authorization[7:] if authorization.startswith("Bearer ") else None
    if not expected:
        return True
    return tokens_equal(http_bearer(expected), given) or tokens_equal(expected, given)


def ring_accepts_bearer(ring: TokenRing, authorization: str) -> bool:
    """`bearer_ok` against every token `ring` accepts now (a rotation accepts two)."""
    given = authorization[7:] if authorization.startswith("Bearer ") else None
    return ring_accepts(ring, given, forms=lambda token: (http_bearer(token), token))


def open_ring(
    token: SecretStr | None,
    token_file: Path | None,
    *,
    grace_s: float = DEFAULT_ROTATION_GRACE_S,
) -> TokenRing:
    """The token ring of a component, resolved as `resolve_token`; a token file (a mounted
    Secret) is followed, so a rotated token is taken without a restart."""
    if token is not None and token.get_secret_value():
        return TokenRing(token.get_secret_value(), grace_s=grace_s)
    if token_file is None and os.environ.get(TOKEN_FILE_ENV):
        token_file = Path(os.environ[TOKEN_FILE_ENV])
    if token_file is not None:
        return FileTokenRing(token_file, grace_s=grace_s)
    return TokenRing(os.environ.get(TOKEN_ENV) or None, grace_s=grace_s)


def resolve_token(token: SecretStr | None, token_file: Path | None) -> str | None:
    """The token: explicit value, else a file (a mounted Secret, read by `read_token_file`: its
    newest token), else the file named by $KUBEREFIT_TOKEN_FILE (what injection sets), else
    $KUBEREFIT_TOKEN."""
    if token is not None and token.get_secret_value():
        return token.get_secret_value()
    if token_file is None and os.environ.get(TOKEN_FILE_ENV):
        token_file = Path(os.environ[TOKEN_FILE_ENV])
    if token_file is not None:
        return read_token_file(token_file)[0]  # the newest listed; refusals are ValueErrors
    return os.environ.get(TOKEN_ENV) or None


def is_loopback_host(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and "localhost"; anything else (incl. 0.0.0.0) is not."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def endpoint_host(endpoint: str) -> str:
    """The host part of a ZeroMQ tcp:// endpoint or an HTTP URL."""
    host = urlsplit(endpoint).hostname
    return host or ""


def require_token_or_loopback(
    what: str, hosts: list[str], token: str | None, *, allow_insecure: bool
) -> None:
    """Refuse to serve unauthenticated on anything but loopback unless explicitly allowed."""
    exposed = [h for h in hosts if not is_loopback_host(h)]
    if exposed and not token and not allow_insecure:
        raise ValueError(
            f"{what}: refusing to listen on {exposed} without a token; configure one "
            f"(token, token_file or ${TOKEN_ENV}) or set allow_insecure=true explicitly"
        )
