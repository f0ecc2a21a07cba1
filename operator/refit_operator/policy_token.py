"""The token the operator sends to one policy's sidecars, read from the policy's Secret.

The Secret is re-read every `TOKEN_REFRESH_S` and followed by a `TokenRing`: after a rotation
the previous token is sent for the grace period, so pods whose mounted copy is not updated yet
keep accepting the operator's calls. A Secret that is missing, unmarked, keyless or empty is a
reason for the policy's Ready condition (`PolicyToken.error`), not an exception; other API
errors propagate to the loop, which reports them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from refit_operator.kube.api import KubeApi, NotFoundError, SecretRefusedError
from refit_operator.policy_spec import PolicySpec
from refit_protocol.kit.tokens import TokenRing

#: How long a token read from the policy's Secret is used before it is read again.
TOKEN_REFRESH_S = 60.0


class PolicyToken:
    """One policy's token source (see the module docstring)."""

    def __init__(
        self, api: KubeApi, namespace: str, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.clock = clock
        #: (reason, message) of the last read that found no usable token; None after a good one.
        self.error: tuple[str, str] | None = None
        self._ring: tuple[tuple[str, str, str], TokenRing] | None = None
        self._read_at = 0.0

    @property
    def ring(self) -> TokenRing | None:
        """The tokens being followed (None before the first good read)."""
        return self._ring[1] if self._ring is not None else None

    async def current(self, spec: PolicySpec) -> str | None:
        """The token to send now; None (and `error` says why) when there is none."""
        ref = (self.namespace, spec.token_secret.name, spec.token_secret.key)
        now = self.clock()
        ring = self._ring[1] if self._ring is not None and self._ring[0] == ref else None
        if ring is not None and now - self._read_at < TOKEN_REFRESH_S:
            return ring.sending()
        try:
            value = await self.api.read_secret_key(*ref)
        except NotFoundError:
            self.error = (
                "TokenSecretMissing",
                f"Secret {ref[0]}/{ref[1]} (spec.tokenSecret) does not exist",
            )
            return None
        except SecretRefusedError as exc:
            self.error = ("TokenSecretRefused", f"spec.tokenSecret: {exc}")
            return None
        try:
            if ring is None:
                ring = TokenRing(value, grace_s=float(spec.token_rotation_grace_seconds))
            else:
                ring.update(value)
        except ValueError:
            self.error = ("TokenSecretRefused", f"spec.tokenSecret: {ref[1]} is empty")
            return None
        self._ring, self._read_at, self.error = (ref, ring), now, None
        return ring.sending()
