"""Operator absence (`receiver.absence`): a request gate closed by an attempt that wrote nothing
reopens once no coordinator has called for `gate_release_s`, and says so; a node holding
partial writes stays out of service until a coordinator repairs it. Over the real HTTP plane
(the coordinator's calls are what the silence is measured from) and on the core."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from pydantic import SecretStr

from refit_operator.receiver_client import ReceiverHttpClient
from refit_protocol.receiver_api import CommitNotice, GateRequest, PrepareRequest, PrewarmRequest
from refit_sidecar.codec.records import Op
from refit_sidecar.fingerprint import module_fingerprint
from refit_sidecar.receiver.absence import CoordinatorContact, Held, may_release, stranded
from refit_sidecar.receiver.config import ReceiverConfig
from refit_sidecar.receiver.node import ReceiverNode
from refit_sidecar.receiver.state import EntryState
from tests.harness.operator_env import wait_for
from tests.sidecar.receiver.models import (
    NODE_TOKEN,
    RecordingApplier,
    TinyModel,
    canonical,
    fingerprint,
    metas,
    payloads,
    perturb,
)
from tests.sidecar.receiver.test_core import entries_in, flush, make_core, offer, prep

pytestmark = pytest.mark.timeout(120)
AUTH = {"Authorization": f"Bearer {NODE_TOKEN}"}
LIMIT_S = 0.8
V0 = canonical(0)
V1 = perturb(V0, 1)


def test_contact_counts_calls_in_flight_and_the_time_since_the_last() -> None:
    now = [100.0]
    contact = CoordinatorContact(clock=lambda: now[0])
    now[0] = 130.0
    assert contact.silent_for() == 30.0
    contact.begin()
    now[0] = 1000.0
    assert contact.silent_for() == 0.0  # a flush may wait for minutes: still in contact
    contact.end()
    now[0] = 1010.0
    assert contact.silent_for() == 10.0


def test_only_a_gate_over_the_committed_bits_reopens() -> None:
    clean = Held(gate_closed=True, held_version=3, dirty=False, attempt="a")
    assert may_release(clean, 601, 600)
    assert not may_release(clean, 599, 600)
    assert not may_release(clean, 10**6, 0)  # 0: never
    assert not may_release(Held(True, 3, True, "a"), 601, 600)  # partial writes
    assert not may_release(Held(True, None, False, None), 601, 600)  # unknown bits
    assert not may_release(Held(False, 3, False, None), 601, 600)  # open already
    assert stranded(clean, 601, 600) is None
    why = stranded(Held(True, 3, True, "a"), 601, 600)
    assert why is not None
    assert "partial writes of attempt a over v3" in why
    assert stranded(Held(True, 3, True, "a"), 599, 600) is None


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[ReceiverNode]:
    cfg = ReceiverConfig(
        node="n0", port=0, token=SecretStr(NODE_TOKEN), held_version=0, gate_release_s=LIMIT_S
    )
    n = ReceiverNode(cfg, RecordingApplier(TinyModel(V0), str(tmp_path / "log")))
    await n.start()
    try:
        yield n
    finally:
        await n.close()


async def test_a_gate_left_closed_by_a_vanished_coordinator_reopens(node: ReceiverNode) -> None:
    base = f"http://127.0.0.1:{node.port}"
    async with aiohttp.ClientSession() as session:
        c = ReceiverHttpClient("n0", base, token=NODE_TOKEN, session=session)
        await c.prewarm(PrewarmRequest(metas=metas(V0)))
        req = PrepareRequest(
            attempt="a1", from_version=0, target_version=1, mode="mixed", producers=[0]
        )
        assert (await c.prepare(req)).accepted
        await c.gate(GateRequest(attempt="a1", closed=True))
        # A live coordinator polls: however long, the gate stays closed.
        t_end = time.monotonic() + 3 * LIMIT_S
        while time.monotonic() < t_end:
            status = await c.status()
            assert status.gate_closed
            assert status.gate_released is None
            await asyncio.sleep(LIMIT_S / 4)
        # It vanishes: the node reopens its gate (the attempt wrote nothing) and says so.
        # (watched through the in-process runtime's gate: a status call is a coordinator's)
        deadline = time.monotonic() + 30
        while node.applier.gate_closed and time.monotonic() < deadline:  # type: ignore[attr-defined]
            await asyncio.sleep(0.1)
        assert node.applier.gate_closed is False  # type: ignore[attr-defined]
        status = await c.status()
        assert not status.gate_closed
        assert status.phase == "stopped"  # retired: a returning coordinator retries it
        assert status.held_version == 0
        assert status.gate_released is not None
        assert "had written nothing" in status.gate_released
        async with session.get(f"{base}/readyz") as resp:
            assert resp.status == 200
            ready = await resp.json()
        line = ready["checks"]["coordinator"]
        assert line["ok"] is True
        assert "request gate reopened" in line["detail"]
        async with session.get(f"{base}/metrics", headers=AUTH) as resp:
            assert "kuberefit_receiver_gate_releases_total 1.0" in await resp.text()
        # The next coordinator's prepare is accepted (the node holds v0) and clears the note.
        again = req.model_copy(update={"attempt": "a2", "mode": "overwrite"})
        assert (await c.prepare(again)).accepted
        assert (await c.status()).gate_released is None


def test_a_node_with_partial_writes_stays_out_of_service(tmp_path: Path) -> None:
    core = make_core(tmp_path, gate_release_s=LIMIT_S)
    prep(core, "a1")
    for p in payloads("a1", 0, V0, V1)[:3]:
        offer(core, p)
    wait_for("partial writes", lambda: entries_in(core, EntryState.APPLIED) >= 1)
    core.control.stop("a1")  # the coordinator's last call before it vanished
    core.control.contact.end()  # what the HTTP plane marks after each coordinator call
    assert core.control.absence() is None
    time.sleep(LIMIT_S + 0.1)
    assert core.control.release_stale_gate() is None  # never with partial writes
    assert core.state.gate_closed
    ready = {name: (ok, why) for name, ok, why in core.readiness()}
    ok, why = ready["coordinator"]
    assert not ok
    assert "partial writes of attempt a1" in why
    # A coordinator returns: the overwrite retry repairs the node; it is back in service.
    core.control.contact.begin()
    prep(core, "a2", mode="overwrite")
    for p in payloads("a2", 0, V0, V1, op=Op.OVERWRITE):
        offer(core, p)
    assert flush(core, "a2", {0: 8}).ok
    core.control.commit(CommitNotice(attempt="a2", version=1))
    core.control.contact.end()
    assert "coordinator" not in {name for name, _, _ in core.readiness()}
    assert module_fingerprint(core.applier.model) == fingerprint(V1)  # type: ignore[attr-defined]
