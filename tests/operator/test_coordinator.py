"""Every failure branch of Algorithm B.2, against a real SQLite commit store and fault-injecting
fakes. The happy path runs on real parts: `test_coordinator_on_real_parts.py`."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from refit_operator.commit_store import ActiveAttempt, CommitUnknownError
from refit_operator.commit_store.sqlite import SqliteCommitStore
from refit_operator.coordinator import Coordinator
from refit_operator.transition_types import CoordinatorConfig
from refit_protocol.commit import CommitRecord
from refit_protocol.errors import PeerAuthenticationError
from tests.operator.fakes import FakeMembership, FakeProducer, FakeReceiver, RecordingSink

K0 = CommitRecord(0, "b0")


class CommitReplyLostFake(SqliteCommitStore):
    """A store whose commit reply is lost: the commit is applied (or not), the caller sees
    CommitUnknownError — a fault the real SQLite file cannot produce on demand."""

    apply_before_losing: bool = True
    lose_next: int = 1

    async def commit(self, epoch, attempt, expected, new, now):  # type: ignore[no-untyped-def]
        if self.lose_next:
            self.lose_next -= 1
            if self.apply_before_losing:
                await super().commit(epoch, attempt, expected, new, now)
            raise CommitUnknownError("reply lost")
        return await super().commit(epoch, attempt, expected, new, now)


def world(tmp_path: Path, n: int = 3, store_cls: type[SqliteCommitStore] = SqliteCommitStore):
    store = store_cls(tmp_path / "commit.db", "p")
    receivers = [FakeReceiver(f"r{i}") for i in range(n)]
    producers = [FakeProducer(0), FakeProducer(1)]
    membership = FakeMembership(receivers)
    sink = RecordingSink()
    return store, receivers, producers, membership, sink


async def coordinator(store, producers, membership, sink, **cfg) -> Coordinator:  # type: ignore[no-untyped-def]
    await store.initialize(K0)
    c = Coordinator(
        "p", store, producers, membership, sink, CoordinatorConfig(control_timeout_s=2, **cfg)
    )
    await c.start()
    return c


def assert_all_at(receivers: list[FakeReceiver], version: int) -> None:
    assert [r.bits for r in receivers if not r.dead] == [f"v{version}"] * sum(
        not r.dead for r in receivers
    )


async def test_rejected_first_prepare_ends_transition(tmp_path: Path) -> None:
    store, receivers, producers, membership, sink = world(tmp_path)
    receivers[1].reject_prepare = "unsupported loader for model.x"
    c = await coordinator(store, producers, membership, sink)
    result = await c.run_transition()
    assert result.outcome == "rejected"
    assert "unsupported loader" in result.message
    assert (await store.read()).record == K0
    assert all(not p.started for p in producers)
    assert_all_at(receivers, 0)


@pytest.mark.parametrize("links", ["mac", "encrypted"])
async def test_the_prepare_names_the_mac_only_links_the_policy_asks_for(
    tmp_path: Path, links: str
) -> None:
    store, receivers, producers, membership, sink = world(tmp_path)
    c = await coordinator(store, producers, membership, sink, intra_cluster=links)
    assert (await c.run_transition()).outcome == "committed"
    req = receivers[0].prepares[-1]
    assert req.relay_tree == ["tcp://r0", "tcp://r1", "tcp://r2"]
    want = ["tcp://r0-mac", "tcp://r1-mac", "tcp://r2-mac"] if links == "mac" else []
    assert req.relay_mac_tree == want


async def test_failure_after_admission_retries_with_overwrite(tmp_path: Path) -> None:
    store, receivers, producers, membership, sink = world(tmp_path)
    receivers[0].fail_flush_times = 1  # partial writes, then a failed ACK
    c = await coordinator(store, producers, membership, sink)
    result = await c.run_transition()
    assert (result.outcome, result.modes) == ("committed", ["mixed", "overwrite"])
    assert_all_at(receivers, 1)  # the overwrite retry repaired the partial writes
    assert [p.mode for p in producers[0].started] == ["mixed", "overwrite"]
    assert producers[0].updates[-1][1] == (await store.read()).record


async def test_receiver_dies_mid_attempt_is_retired(tmp_path: Path) -> None:
    store, receivers, producers, membership, sink = world(tmp_path)
    receivers[2].die_on_flush = True
    membership.confirmed.add("r2")
    c = await coordinator(store, producers, membership, sink)
    result = await c.run_transition()
    assert (result.outcome, result.retired, result.modes) == (
        "committed",
        ["r2"],
        ["mixed", "overwrite"],
    )
    assert_all_at(receivers[:2], 1)
    # It restarts: it joins the next transition only after a dense restore.
    receivers[2].dead, receivers[2].held_version = False, None
    result2 = await c.run_transition()
    assert result2.outcome == "committed"
    assert membership.restored == ["r2"]
    assert_all_at(receivers, 2)


async def test_a_dead_receiver_fails_the_attempt_without_waiting_for_the_others(
    tmp_path: Path,
) -> None:
    """r0 waits (for payloads a dead peer would have relayed) while r2 is dead: the attempt fails
    as soon as r2's call fails, not after r0's flush timeout."""
    store, receivers, producers, membership, sink = world(tmp_path)
    receivers[0].hang_flush_times = 1
    receivers[2].die_on_flush = True
    membership.confirmed.add("r2")
    c = await coordinator(store, producers, membership, sink, flush_timeout_s=60)
    t0 = time.monotonic()
    result = await c.run_transition()
    assert time.monotonic() - t0 < 10
    assert (result.outcome, result.retired, result.modes) == (
        "committed",
        ["r2"],
        ["mixed", "overwrite"],
    )
    assert_all_at(receivers[:2], 1)


async def test_a_receiver_dying_while_producers_stream_fails_the_attempt_at_once(
    tmp_path: Path,
) -> None:
    """The relay root dies mid-stream, so the producers' sends would only end at their ACK
    timeouts: the liveness probe retires it within about one probe interval."""
    store, receivers, producers, membership, sink = world(tmp_path)
    producers[0].stall_sends, producers[0].kill_on_stall = 1, receivers[1]
    membership.confirmed.add("r1")
    c = await coordinator(store, producers, membership, sink, liveness_probe_s=0.2)
    t0 = time.monotonic()
    result = await c.run_transition()
    assert time.monotonic() - t0 < 5
    assert (result.outcome, result.retired, result.modes) == (
        "committed",
        ["r1"],
        ["mixed", "overwrite"],
    )
    assert_all_at([receivers[0], receivers[2]], 1)


async def test_a_receiver_dying_after_the_commit_does_not_stop_the_others(tmp_path: Path) -> None:
    """r1 dies between its flush and the commit notice: the version is committed, the others
    get the notice and their gates reopen, and the coordinator does not fail."""
    store, receivers, producers, membership, sink = world(tmp_path)
    receivers[1].die_on_notice = True
    c = await coordinator(store, producers, membership, sink)
    result = await c.run_transition()
    assert result.outcome == "committed"
    assert [r.held_version for r in (receivers[0], receivers[2])] == [1, 1]
    assert not receivers[0].gate_closed
    assert not receivers[2].gate_closed


async def test_a_receiver_rejecting_the_overwrite_retry_leaves_the_transition(
    tmp_path: Path,
) -> None:
    """r2 restarted between attempts and no longer holds the base: it rejects the overwrite
    retry; instead of burning every attempt, it leaves this transition (restored next time)."""
    store, receivers, producers, membership, sink = world(tmp_path)
    receivers[0].fail_flush_times = 1
    receivers[2].reject_overwrite = "holds no known version (a dense restore is needed)"
    c = await coordinator(store, producers, membership, sink)
    result = await c.run_transition()
    assert (result.outcome, result.modes, result.retired) == (
        "committed",
        ["mixed", "overwrite", "overwrite"],
        ["r2"],
    )
    assert_all_at(receivers[:2], 1)


async def test_a_server_host_restarted_between_attempts_rejoins_for_the_retry(
    tmp_path: Path,
) -> None:
    """r1 is the other host of r0's multi-host vLLM server and its receiver restarted: it holds
    no weights of its own, so the coordinator restores it at once instead of retiring it, and
    the server (which cannot apply without it) stays in the transition."""
    store, receivers, producers, membership, sink = world(tmp_path)
    receivers[0].server, receivers[0].server_role = "s", "leader"
    receivers[1].server, receivers[1].server_role = "s", "host"
    receivers[0].fail_flush_times = 1
    receivers[1].reject_overwrite = "not prewarmed: call /v1/prewarm first"
    c = await coordinator(store, producers, membership, sink)
    result = await c.run_transition()
    assert (result.outcome, result.modes, result.retired) == (
        "committed",
        ["mixed", "overwrite", "overwrite"],
        [],
    )
    assert membership.restored == ["r1"]
    assert_all_at(receivers, 1)


async def test_a_server_host_whose_receiver_restarts_mid_attempt_rejoins(tmp_path: Path) -> None:
    """r1, the other host of r0's server, loses its receiver mid-flush; the container restarts
    in its pod (a new incarnation: confirmed dead, but its pod and vLLM ranks stay). The
    coordinator waits for it to answer and restores it (it holds no weights) instead of
    retiring the server; the overwrite retry commits with both nodes."""
    store, receivers, producers, membership, sink = world(tmp_path)
    receivers[0].server, receivers[0].server_role = "s", "leader"
    receivers[1].server, receivers[1].server_role = "s", "host"
    receivers[1].die_on_flush = True
    receivers[1].restarts_after = 3
    membership.confirmed.add("r1")
    c = await coordinator(store, producers, membership, sink)
    result = await c.run_transition()
    assert (result.outcome, result.modes, result.retired) == (
        "committed",
        ["mixed", "overwrite"],
        [],
    )
    assert membership.restored == ["r1"]
    assert_all_at(receivers, 1)


async def test_a_server_leaves_a_transition_with_any_of_its_nodes(tmp_path: Path) -> None:
    """Servers a = (r0 leader, r1 host) and b = (r2 leader, r3 host), and a one-host r4: a's
    host dies (a's leader leaves with it), then b's leader restarts (b's host leaves with it,
    whose ranks it drives); r4 commits alone."""
    store, receivers, producers, membership, sink = world(tmp_path, n=5)
    for r, (server, role) in zip(
        receivers, [("a", "leader"), ("a", "host"), ("b", "leader"), ("b", "host")], strict=False
    ):
        r.server, r.server_role = server, role  # type: ignore[assignment]
    receivers[1].die_on_flush = True
    membership.confirmed.add("r1")
    membership.hosts_gone.add("r1")  # its pod was deleted: its ranks went with it
    receivers[2].reject_overwrite = "holds no known version (a dense restore is needed)"
    c = await coordinator(store, producers, membership, sink)
    result = await c.run_transition()
    assert (result.outcome, result.modes, result.retired) == (
        "committed",
        ["mixed", "overwrite", "overwrite"],
        ["r1", "r0", "r2", "r3"],
    )
    assert_all_at(receivers[4:], 1)


async def test_a_receiver_that_was_never_prewarmed_is_restored_before_joining(
    tmp_path: Path,
) -> None:
    store, receivers, producers, membership, sink = world(tmp_path)
    receivers[1].prewarmed = False  # a restarted receiver process (its server kept v0 bits)
    receivers[1].gate_closed = True  # ... which holds its gate closed until restored
    c = await coordinator(store, producers, membership, sink)
    assert (await c.run_transition()).outcome == "committed"
    assert membership.restored == ["r1"]
    assert_all_at(receivers, 1)


async def test_a_gate_a_node_reopened_without_a_coordinator_is_announced(tmp_path: Path) -> None:
    """A node that reopened its gate while no coordinator called (receiver.absence) says so;
    the next transition's sink gets it once, to post as an Event, and the node takes part."""
    store, receivers, producers, membership, sink = world(tmp_path)
    receivers[2].gate_released = "request gate reopened at T after 600 s ..."
    c = await coordinator(store, producers, membership, sink)
    assert (await c.run_transition()).outcome == "committed"
    assert sink.notices == [("GateReleased", "r2: request gate reopened at T after 600 s ...")]
    assert_all_at(receivers, 1)
    assert receivers[2].gate_released is None  # its prepare cleared it
    assert (await c.run_transition()).outcome == "committed"
    assert sink.notices == []


async def test_silent_receiver_needs_an_operator(tmp_path: Path) -> None:
    store, receivers, producers, membership, sink = world(tmp_path)
    receivers[1].die_on_flush = True  # gone, but not confirmed dead: it could still write
    c = await coordinator(store, producers, membership, sink)
    result = await c.run_transition()
    assert result.outcome == "aborted"
    assert "neither acknowledges" in result.message
    state = await store.read()
    assert state.record == K0
    assert state.aborted_by
    assert receivers[0].gate_closed  # the gate stays closed
    assert sink.phases[-1] == "Aborted"


async def test_a_receiver_finishing_its_apply_call_is_waited_for_not_retried(
    tmp_path: Path,
) -> None:
    """A stop that arrives while the node's apply call waits (a rank on another host waiting
    stage_wait_s for its dead receiver's file) answers after longer than all the tries for a
    silent node; the node shows the attempt stopped, so its one call is waited for and the
    overwrite retry commits."""
    store, receivers, producers, membership, sink = world(tmp_path)
    receivers[1].fail_flush_times = 1
    receivers[1].stop_drain_s = 3.0  # > stop_retries x control_timeout_s (1 x 2 s)
    c = await coordinator(store, producers, membership, sink, stop_retries=1)
    result = await c.run_transition()
    assert result.outcome == "committed", result.message
    assert result.modes == ["mixed", "overwrite"]
    assert receivers[1].stops == 1  # one call, waited for: not three piling up on the node
    said = "r1 is ending its apply call (stop waits up to 300s)"
    assert any(m.startswith("attempt 1 failed: ") and m.endswith(said) for m in sink.messages)
    assert_all_at(receivers, 1)


async def test_a_receiver_draining_past_the_bound_needs_an_operator(tmp_path: Path) -> None:
    store, receivers, producers, membership, sink = world(tmp_path)
    receivers[1].fail_flush_times = 1
    receivers[1].stop_drain_s = 60.0
    c = await coordinator(store, producers, membership, sink, stop_retries=1, stop_drain_s=1.0)
    result = await c.run_transition()
    assert (result.outcome, result.reason) == ("aborted", "ReceiverUnresponsive")
    assert "r1 acknowledged stop but is still finishing its apply call after 1s" in result.message
    assert (await store.read()).record == K0


async def test_producer_failure_then_overwrite_retry(tmp_path: Path) -> None:
    store, receivers, producers, membership, sink = world(tmp_path)
    producers[1].fail_sends = 1
    c = await coordinator(store, producers, membership, sink)
    result = await c.run_transition()
    assert (result.outcome, result.modes) == ("committed", ["mixed", "overwrite"])
    assert_all_at(receivers, 1)


async def test_producer_that_lost_its_state_aborts(tmp_path: Path) -> None:
    store, _receivers, producers, membership, sink = world(tmp_path)
    producers[0].lost_state = True
    c = await coordinator(store, producers, membership, sink, max_attempts=3)
    result = await c.run_transition()
    assert (result.outcome, result.attempts) == ("aborted", 3)
    assert (await store.read()).record == K0


@pytest.mark.parametrize(("applied", "modes"), [(True, ["mixed"]), (False, ["mixed", "overwrite"])])
async def test_unknown_commit_outcome_is_resolved(
    tmp_path: Path, applied: bool, modes: list[str]
) -> None:
    store, _receivers, producers, membership, sink = world(tmp_path, store_cls=CommitReplyLostFake)
    assert isinstance(store, CommitReplyLostFake)
    store.apply_before_losing = applied
    c = await coordinator(store, producers, membership, sink)
    result = await c.run_transition()
    assert (result.outcome, result.version, result.modes) == ("committed", 1, modes)
    assert (await store.read()).record.version == 1


async def test_unknown_outcome_revealing_a_conflict(tmp_path: Path) -> None:
    store, _receivers, producers, membership, sink = world(tmp_path, store_cls=CommitReplyLostFake)
    assert isinstance(store, CommitReplyLostFake)
    store.apply_before_losing = False
    c = await coordinator(store, producers, membership, sink)
    original = store.commit

    async def commit_then_taken_over(*args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return await original(*args, **kwargs)
        finally:
            # Meanwhile another coordinator took over and committed the transition.
            other = SqliteCommitStore(tmp_path / "commit.db", "p")
            epoch = await other.acquire("other")
            await other.prepare(epoch, ActiveAttempt("x", 1, "gx", "overwrite", time.time() + 60))
            await other.commit(epoch, "x", K0, CommitRecord(1, "gx"), time.time())

    store.commit = commit_then_taken_over  # type: ignore[method-assign]
    result = await c.run_transition()
    assert result.outcome == "conflict"
    assert not any(p.updates for p in producers)  # the gate and baselines are left alone


async def test_takeover_after_coordinator_crash_starts_in_overwrite(tmp_path: Path) -> None:
    store, receivers, producers, membership, sink = world(tmp_path)
    await store.initialize(K0)
    # The old coordinator prepared an attempt and receivers applied part of it, then it died.
    old_epoch = await store.acquire("old")
    await store.prepare(old_epoch, ActiveAttempt("old-a1", 1, "g-old", "mixed", time.time() + 60))
    receivers[0].bits = receivers[1].bits = "partial"
    c = await coordinator(store, producers, membership, sink)
    result = await c.run_transition()
    assert (result.outcome, result.modes) == ("committed", ["overwrite"])
    assert_all_at(receivers, 1)


async def test_commit_of_a_dead_coordinator_still_updates_baselines(tmp_path: Path) -> None:
    store, receivers, producers, membership, sink = world(tmp_path)
    await store.initialize(K0)
    old_epoch = await store.acquire("old")
    await store.prepare(old_epoch, ActiveAttempt("old-a1", 1, "g-old", "mixed", time.time() + 60))
    for r in receivers[:2]:
        r.bits, r.attempt, r.phase = "v1", "old-a1", "flushed"  # they acknowledged old-a1
    receivers[2].held_version = None  # restarted meanwhile: unknown bits
    # Its commit landed, then it died before any owner updated its baseline.
    await store.commit(old_epoch, "old-a1", K0, CommitRecord(1, "g-old"), time.time())
    c = await coordinator(store, producers, membership, sink)
    result = await c.run_transition()
    assert all(p.updates[0] == ("old-a1", CommitRecord(1, "g-old")) for p in producers)
    assert (result.outcome, result.version, result.modes) == ("committed", 2, ["mixed"])
    assert membership.restored == ["r2"]  # only the receiver that cannot vouch for v1
    assert_all_at(receivers, 2)


async def test_commit_conflict_between_two_coordinators(tmp_path: Path) -> None:
    store, receivers, producers, membership, sink = world(tmp_path)
    a = await coordinator(store, producers, membership, sink)
    b_store = SqliteCommitStore(tmp_path / "commit.db", "p")
    b = Coordinator(
        "p",
        b_store,
        producers,
        membership,
        RecordingSink(),
        CoordinatorConfig(control_timeout_s=2),
        name="b",
    )
    original_flush = receivers[0].flush

    async def flush_then_failover(req):  # type: ignore[no-untyped-def]
        await b.start()  # b takes over while a's attempt is in flight
        return await original_flush(req)

    receivers[0].flush = flush_then_failover  # type: ignore[method-assign]
    result_a = await a.run_transition()
    assert result_a.outcome == "conflict"
    receivers[0].flush = original_flush  # type: ignore[method-assign]
    result_b = await b.run_transition()
    assert (result_b.outcome, result_b.modes) == ("committed", ["overwrite"])
    assert (await store.read()).record.version == 1
    assert_all_at(receivers, 1)


class TokenRefusingProducerFake(FakeProducer):
    """A producer sidecar holding another token: every call answers 401."""

    async def update_baseline(self, attempt: str, record: CommitRecord) -> None:
        raise PeerAuthenticationError(f"producer {self.producer}: HTTP 401")


async def test_a_producer_refusing_the_token_while_recovering_is_not_an_attempt_failure(
    tmp_path: Path,
) -> None:
    """Finishing a dead coordinator's commit calls every producer: a 401 there is a
    configuration error the caller reports (exit 2), not a failed attempt to retry."""
    store, _, producers, membership, sink = world(tmp_path)
    producers[1] = TokenRefusingProducerFake(1)
    await store.initialize(K0)
    old_epoch = await store.acquire("old")
    await store.prepare(old_epoch, ActiveAttempt("old-a1", 1, "g-old", "mixed", time.time() + 60))
    await store.commit(old_epoch, "old-a1", K0, CommitRecord(1, "g-old"), time.time())
    c = await coordinator(store, producers, membership, sink)
    with pytest.raises(PeerAuthenticationError, match="producer 1: HTTP 401"):
        await c.recover()
