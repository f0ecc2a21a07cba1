"""Who coordinates a policy: a coordination.k8s.io Lease per policy.

kopf's peering pauses operators but does not fence them, and the commit record's epoch fences
but does not decide: two live operators would take the record from each other at every step.
So the operator that holds policy P's Lease (`kuberefit.<namespace>.P`, in the operator's own
namespace, where its Role allows Lease writes: never cluster-wide) runs P's coordinator; the
others wait until it expires. A restarted operator with the same identity (its pod name) takes its
Lease back at once. The epoch still fences the rare case of a paused holder whose Lease
expired: its next compare-and-set fails and it backs off.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import time
from collections.abc import Callable
from typing import Any

import structlog

from refit_operator.kube.api import ConflictError, KubeApi, NotFoundError

log = structlog.get_logger("kuberefit.lease")


def lease_name(policy: str, policy_namespace: str = "") -> str:
    """`kuberefit.<namespace>.<policy>` (a DNS subdomain: namespaces are labels, policy names
    subdomains); over 253 characters, cut and made unique with a hash of the whole. Without a
    namespace, `kuberefit-<policy>` (a Lease beside its policy)."""
    if not policy_namespace:
        return f"kuberefit-{policy}"[:253]
    name = f"kuberefit.{policy_namespace}.{policy}"
    if len(name) <= 253:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    return f"{name[:236].rstrip('.-')}-{digest}"


class PolicyLease:
    """The Lease of one policy, held by `identity` while it renews in time.

    Expiry is judged as client-go does: by how long this process has seen the Lease unchanged
    (holder, renew time, resourceVersion) on its own monotonic clock, never by comparing its
    clock with the holder's. And `held` lapses by itself two thirds of a duration after the
    last successful renewal, before any other replica can take the Lease: an operator whose
    renewals hang (a half-open connection) stops coordinating on time.
    """

    def __init__(
        self,
        api: KubeApi,
        namespace: str,
        policy: str,
        identity: str,
        duration_s: int = 15,
        *,
        policy_namespace: str = "",
    ) -> None:
        self.api = api
        self.namespace = namespace  # where the Lease lives: the operator's own namespace
        self.policy = policy
        self.name = lease_name(policy, policy_namespace)
        self.identity = identity
        self.duration_s = duration_s
        self.holder = ""
        self._renewed_at: float | None = None
        self._seen: tuple[str, str, str] | None = None
        self._seen_at = 0.0

    @property
    def held(self) -> bool:
        renewed = self._renewed_at
        return renewed is not None and time.monotonic() - renewed < self.duration_s * 2 / 3

    def lost(self) -> None:
        """Stop holding at once (e.g. the renewal failed)."""
        self._set(False, self.holder)

    async def keep(self, on_result: Callable[[bool], None]) -> None:
        """Acquire or renew every third of a duration until cancelled; `on_result(held)`
        after each try. A failed try (the API server briefly unreachable) counts as lost."""
        while True:
            try:
                held = await self.acquire_or_renew()
            except Exception as exc:
                log.warning(
                    "lease.renew_failed", policy=self.policy, lease=self.name, error=str(exc)
                )
                held = False
                self.lost()
            on_result(held)
            await asyncio.sleep(self.duration_s / 3)

    async def acquire_or_renew(self) -> bool:
        """Take or renew the Lease; True while this identity holds it."""
        started = time.monotonic()
        now = dt.datetime.now(dt.timezone.utc)
        spec = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.duration_s,
            "renewTime": _micro(now),
        }
        try:
            lease = await self.api.read_lease(self.namespace, self.name)
        except NotFoundError:
            body = {"metadata": {"name": self.name}, "spec": {**spec, "acquireTime": _micro(now)}}
            try:
                await self.api.create_lease(self.namespace, body)
            except ConflictError:
                return self._set(False, "")
            return self._set(True, self.identity, started)
        holder = lease.spec.holder_identity or ""
        if holder != self.identity and not self._expired(lease, holder):
            return self._set(False, holder)
        transitions = int(lease.spec.lease_transitions or 0) + (holder != self.identity)
        acquired = lease.spec.acquire_time if holder == self.identity else now
        body = {
            "metadata": {
                "name": self.name,
                "resourceVersion": lease.metadata.resource_version,
            },
            "spec": {
                **spec,
                "acquireTime": _micro(acquired or now),
                "leaseTransitions": transitions,
            },
        }
        try:
            await self.api.replace_lease(self.namespace, self.name, body)
        except (ConflictError, NotFoundError):
            return self._set(False, holder)
        return self._set(True, self.identity, started)

    def _expired(self, lease: Any, holder: str) -> bool:
        """True once this process has seen the Lease unchanged for a whole duration."""
        seen = (holder, str(lease.spec.renew_time), str(lease.metadata.resource_version))
        now = time.monotonic()
        if seen != self._seen:
            self._seen, self._seen_at = seen, now
            return not holder
        duration = int(lease.spec.lease_duration_seconds or self.duration_s)
        return now - self._seen_at > duration

    def _set(self, held: bool, holder: str, renewed_at: float | None = None) -> bool:
        if held != self.held:
            log.info("lease.changed", lease=self.name, held=held, holder=holder or None)
        self._renewed_at = renewed_at if held else None
        self.holder = holder
        return held


def _micro(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
