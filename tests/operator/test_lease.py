"""Per-policy Leases on the real API server: one holder at a time, expiry judged on the
observer's own clock (as client-go does), a holder whose renewals stop stops holding before
anyone else may take over, and a restarted holder (same identity) takes its Lease back at once."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid

from refit_operator.kube.api import KubeApi
from refit_operator.kube.lease import PolicyLease, lease_name


async def test_one_holder_expiry_and_restart(api: KubeApi, namespace: str) -> None:
    a = PolicyLease(api, namespace, "p", "op-a", duration_s=3)
    b = PolicyLease(api, namespace, "p", "op-b", duration_s=3)
    assert await a.acquire_or_renew()
    assert a.held
    assert not await b.acquire_or_renew()
    assert b.holder == "op-a"
    # While op-a renews, op-b never takes over, however long it watches.
    t0 = time.monotonic()
    while time.monotonic() - t0 < 4:
        assert await a.acquire_or_renew()
        assert not await b.acquire_or_renew()
        last_seen = time.monotonic()  # op-b has just seen op-a's renewal (no await since)
        await asyncio.sleep(0.5)
    # op-a stops renewing (frozen): it stops holding after 2/3 of the duration on its own
    # clock, before op-b may take over: a whole unchanged duration on op-b's clock after it
    # last saw a renewal, however late the loop's sleeps and polls run on a loaded machine.
    while await b.acquire_or_renew() is False:
        await asyncio.sleep(0.2)
    taken_after = time.monotonic() - last_seen
    assert not a.held
    assert 3 - 0.05 < taken_after < 3 + 15, taken_after
    # A restarted op-b (new process, same identity) takes its Lease back at once.
    again = PolicyLease(api, namespace, "p", "op-b", duration_s=3)
    assert await again.acquire_or_renew()
    lease = await api.read_lease(namespace, "kuberefit-p")
    assert lease.spec.holder_identity == "op-b"
    assert lease.spec.lease_transitions == 1


def test_lease_names_in_the_operators_namespace_are_unique_dns_subdomains() -> None:
    """`kuberefit.<namespace>.<policy>`: policies of the same name in two namespaces get two
    Leases; a name over 253 characters is cut and kept unique by a hash."""
    assert lease_name("alpha", "team-a") == "kuberefit.team-a.alpha"
    assert lease_name("alpha", "team-a") != lease_name("alpha", "team-b")
    assert lease_name("alpha") == "kuberefit-alpha"  # beside the policy (no operator namespace)
    subdomain = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
    long_a, long_b, dotted = "p" * 250 + ".a", "p" * 250 + ".b", "x." * 125 + "x"
    for name in (lease_name(long_a, "ns"), lease_name(long_b, "ns"), lease_name(dotted, "n")):
        assert len(name) <= 253, name
        assert subdomain.fullmatch(name), name
    assert lease_name(long_a, "ns") != lease_name(long_b, "ns")


async def test_keep_reports_each_try_and_counts_a_failed_one_as_lost(
    api: KubeApi, namespace: str
) -> None:
    lease = PolicyLease(api, namespace, "kept", "op-a", duration_s=3)
    results: list[bool] = []
    task = asyncio.create_task(lease.keep(results.append))
    try:
        for _ in range(50):
            if len(results) >= 2:
                break
            await asyncio.sleep(0.1)
        assert results[:2] == [True, True]  # acquired, then renewed a third of 3 s later
        assert lease.held
        # The API server refuses (a namespace that does not exist): the try counts as lost.
        lease.namespace = f"gone-{uuid.uuid4().hex[:6]}"
        seen = len(results)
        for _ in range(30):
            if len(results) > seen:
                break
            await asyncio.sleep(0.1)
        assert results[-1] is False
        assert not lease.held
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
