"""❼ joint commit — the coordinator: one transition at a time, joint commit, overwrite recovery.

Plain asyncio code following the paper's Algorithm B.2 (with Algorithm B.1 as the schedule of
one attempt). It orchestrates through ports (`ports.py`) and the `CommitStore`; it never touches
payload bytes. Outcomes of a transition:

- committed: every required receiver acknowledged completion, the compare-and-set commit
  published (v+1, g), every producer updated its baseline, the gate reopened;
- rejected: the first prepare was rejected; version v stays committed, nothing was written;
- conflict: another coordinator took over or committed first; this one stops without retrying
  and leaves the gate alone;
- aborted: retries were exhausted or a failure needs an operator (a receiver that never
  acknowledges, a producer that lost its state); the gate stays closed until receivers are
  densely restored.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, TypeVar

import structlog

from refit_operator.commit_store import (
    ActiveAttempt,
    CommitConflictError,
    CommitRefusedError,
    CommitStore,
    CommitUnknownError,
)
from refit_operator.ports import (
    Membership,
    ProducerClient,
    ProgressSink,
    ReceiverClient,
    TransitionProgress,
)
from refit_operator.server_groups import ServerGroups
from refit_operator.transition_types import CoordinatorConfig, TransitionResult
from refit_protocol.commit import AttemptMode, CommitRecord
from refit_protocol.errors import EndpointError, PeerAuthenticationError
from refit_protocol.producer_api import AttemptPlan, SentReport, StreamSettings
from refit_protocol.receiver_api import (
    FlushRequest,
    GateRequest,
    PrepareRequest,
    RelayFlushRequest,
)

log = structlog.get_logger("kuberefit.coordinator")
T = TypeVar("T")
#: A receiver's phase once a stop reached it (`receiver.node_state.retire`).
_STOPPED = "stopped"


class RejectedError(Exception):
    """A receiver rejected prepare (e.g. it does not hold the version the delta starts from)."""

    def __init__(self, message: str, nodes: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.nodes = tuple(nodes)


class AttemptFailedError(Exception):
    """Anything else that fails an attempt; after admission it leads to an overwrite retry."""


class InterventionRequiredError(Exception):
    """Automatic recovery cannot repair this; the transition is aborted."""


@dataclass(frozen=True)
class Participants:
    """Who takes part in a transition and with which settings. A caller whose participants
    change between transitions (the operator: pods come and go, the policy's spec changes)
    hands the new ones to `run_transition` instead of writing the coordinator's attributes."""

    producers: Sequence[ProducerClient]
    membership: Membership
    sink: ProgressSink
    config: CoordinatorConfig = field(default_factory=CoordinatorConfig)


class Coordinator:
    """Drives the transitions of one policy."""

    def __init__(
        self,
        policy: str,
        store: CommitStore,
        producers: Sequence[ProducerClient],
        membership: Membership,
        sink: ProgressSink,
        config: CoordinatorConfig | None = None,
        name: str | None = None,
    ) -> None:
        self.policy = policy
        self.store = store
        self._parts = Participants(
            tuple(producers), membership, sink, config or CoordinatorConfig()
        )
        self.name = name or f"coordinator-{uuid.uuid4().hex[:8]}"
        self.epoch = 0
        self._gate_closed: set[str] = set()
        self._servers = ServerGroups()
        self._notices: list[tuple[str, str]] = []  # TransitionProgress.notices of the next one

    @property
    def producers(self) -> Sequence[ProducerClient]:
        return self._parts.producers

    @property
    def membership(self) -> Membership:
        return self._parts.membership

    @property
    def sink(self) -> ProgressSink:
        return self._parts.sink

    @property
    def config(self) -> CoordinatorConfig:
        return self._parts.config

    async def start(self) -> None:
        """Become the active coordinator (a takeover if another one held the record)."""
        self.epoch = await self.store.acquire(self.name)
        log.info("coordinator.active", policy=self.policy, epoch=self.epoch, name=self.name)

    # ------------------------------------------------------------------------------- transition
    async def run_transition(
        self,
        xor_incompatible: frozenset[str] = frozenset(),
        settings: StreamSettings | None = None,
        parts: Participants | None = None,
    ) -> TransitionResult:
        """One transition to the next version (Algorithm B.1). `settings`: the stream settings
        every attempt's plan carries to the producers (the policy's current ones); `parts`:
        this transition's participants and config (they stay for the next ones)."""
        if parts is not None:
            self._parts = replace(parts, producers=tuple(parts.producers))
        state = await self.store.read()
        kv = state.record
        target = kv.version + 1
        progress = TransitionProgress(self.policy, kv.version, target)
        result = TransitionResult("aborted", kv.version, 0, progress=progress)
        mode: AttemptMode = "mixed"
        admitted = False
        active = state.active
        committed_attempt = await self._finish_committed(kv, active)
        takeover = active is not None and active.target_version == target
        receivers = await self._join(kv, committed_attempt, takeover=takeover)
        progress.notices.extend(self._notices)
        self._notices.clear()
        if active is not None and takeover:
            # Takeover of an admitted transition (Algorithm B.2 lines 2-12).
            taken = await self._take_over(active.attempt, kv, receivers, result)
            if taken is not None:
                return taken
            admitted, mode = True, "overwrite"
        t_first: float | None = None
        t_flushed = 0.0
        while True:
            if result.attempts >= self.config.max_attempts:
                return await self._abort(
                    result, f"{result.attempts} attempts failed", "RetriesExhausted"
                )
            result.attempts += 1
            result.modes.append(mode)
            result.receivers = [r.node for r in receivers]
            progress.attempt, progress.mode = result.attempts, mode
            tau: str | None = None
            outcome: Literal["success", "failed", "unknown", "conflict"] = "failed"
            new = CommitRecord(target, "")
            try:
                tau = f"{self.policy}-v{target}-a{result.attempts}-{uuid.uuid4().hex[:6]}"
                new = CommitRecord(target, f"g-{uuid.uuid4().hex[:12]}")
                await self.store.prepare(
                    self.epoch,
                    ActiveAttempt(
                        tau,
                        target,
                        new.baseline_id,
                        mode,
                        time.time() + self.config.commit_timeout_s,
                    ),
                )
                nodes = tuple(r.node for r in receivers)
                tree = tuple(await self.membership.relay_tree(nodes))
                mac_tree = (
                    await self.membership.relay_mac_tree(nodes)
                    if tree and self.config.intra_cluster == "mac"
                    else []
                )
                plan = AttemptPlan(
                    attempt=tau,
                    from_version=kv.version,
                    target_version=target,
                    baseline_id=new.baseline_id,
                    mode=mode,
                    xor_incompatible=xor_incompatible,
                    receivers=nodes,
                    receiver_urls=tuple(r.url for r in receivers),
                    relay_tree=tree,
                    settings=settings,
                )
                progress.attempt_id = tau
                await self._phase(progress, "Preparing")
                await self._prepare_receivers(plan, receivers, mac_tree)
                admitted = True
                t_first = t_first or time.perf_counter()
                await self._schedule(plan, receivers, progress)
                await self._phase(progress, "Committing")
                t_flushed = time.perf_counter()
                outcome = await self._commit(tau, kv, new)
            except RejectedError as exc:
                if not admitted:
                    await self._clear(tau)
                    result.outcome, result.message = "rejected", str(exc)
                    result.reason = "PrepareRejected"
                    await self._phase(progress, "Failed", str(exc))
                    return result
                # Alive but not on the transition's base (e.g. restarted between attempts): it
                # cannot be repaired by this transition's deltas. It leaves the transition and
                # is restored densely when the next one starts.
                # A multi-host server's nodes go together (`server_groups`).
                log.warning("attempt.rejected_after_admission", attempt=tau, error=str(exc))
                dropped = self._servers.with_mates(
                    await self._rejoin_hosts(set(exc.nodes), receivers, kv),
                    [r.node for r in receivers],
                )
                receivers = [r for r in receivers if r.node not in dropped]
                result.retired.extend(sorted(dropped))
            except CommitConflictError as exc:
                result.outcome, result.message = "conflict", str(exc)
                await self._phase(progress, "Failed", f"conflict: {exc}")
                return result
            except (AttemptFailedError, EndpointError, CommitRefusedError, TimeoutError) as exc:
                log.warning("attempt.failed", attempt=tau, mode=mode, error=str(exc))
                progress.message = f"attempt {result.attempts} failed: {exc}"
            if outcome == "unknown" and tau is not None:
                outcome = self._resolve(await self.store.read_commit(self.epoch, tau), kv, new)
            if outcome == "success" and tau is not None:
                t_updated = await self._finalize(tau, new, receivers, progress)
                result.outcome, result.version = "committed", target
                result.latency_s = t_updated - (t_first or t_updated)
                result.finalization_s = t_updated - t_flushed
                progress.timings.update(
                    latency_s=result.latency_s, finalization_s=result.finalization_s
                )
                await self._phase(progress, "Committed")
                return result
            if tau is not None:
                try:
                    await self.store.mark_obsolete(self.epoch, tau)
                    receivers = await self._stop(tau, receivers, result, kv, progress)
                    await self._cleanup(tau, receivers)
                except CommitConflictError as exc:
                    outcome, result.message = "conflict", str(exc)
                except InterventionRequiredError as exc:
                    return await self._abort(result, str(exc), "ReceiverUnresponsive")
                if outcome == "conflict":
                    result.outcome = "conflict"
                    await self._phase(progress, "Failed", f"conflict: {result.message}")
                    return result
            if admitted:
                mode = "overwrite"
            if not receivers:
                return await self._abort(result, "no receiver left to refit", "NoReceivers")

    # ------------------------------------------------------------------------------ pieces
    async def recover(self) -> bool:
        """Finish a transition whose commit took effect but whose coordinator died before the
        end: producers update their baselines from the record, receivers that acknowledged get
        the commit notice (the others are restored), gates reopen. True if there was one.

        A new coordinator calls this before waiting for the next candidate: the producers
        stage the next version only after their baseline update."""
        state = await self.store.read()
        kv, active = state.record, state.active
        committed_attempt = await self._finish_committed(kv, active)
        if committed_attempt is None:
            return False
        receivers = await self._join(kv, committed_attempt)
        await self._cleanup(committed_attempt, receivers)
        await self._reopen_gates(committed_attempt, receivers)
        log.info("coordinator.recovered", version=kv.version, attempt=committed_attempt)
        return True

    async def _finish_committed(self, kv: CommitRecord, active: ActiveAttempt | None) -> str | None:
        """If the active attempt is the committed one, update the producers' baselines from the
        record (idempotent when they already did) and return its id."""
        if active is None or (active.target_version, active.baseline_id) != (
            kv.version,
            kv.baseline_id,
        ):
            return None
        await self._each_producer(lambda p: p.update_baseline(active.attempt, kv))
        return active.attempt

    async def _take_over(
        self,
        old: str,
        kv: CommitRecord,
        receivers: list[ReceiverClient],
        result: TransitionResult,
    ) -> TransitionResult | None:
        log.info("coordinator.takeover", attempt=old)
        await self.store.mark_obsolete(self.epoch, old)
        await self._stop(old, receivers, result, kv)
        k = await self.store.read_commit(self.epoch, old)
        if k != kv:
            # The old coordinator's commit took effect: finish its transition and step back.
            await self._each_producer(lambda p: p.update_baseline(old, k))
            await self._cleanup(old, receivers)
            await self._reopen_gates(old, receivers)
            result.outcome, result.version = "conflict", k.version
            result.message = f"transition already committed as {k} by the previous coordinator"
            return result
        await self._cleanup(old, receivers)
        return None

    async def _join(
        self, kv: CommitRecord, committed_attempt: str | None = None, *, takeover: bool = False
    ) -> list[ReceiverClient]:
        """Required receivers of this transition; new or restarted ones are restored first.

        With `takeover`, nodes with partial writes of the admitted transition stay: its
        overwrite retry repairs them. Otherwise such a node, or one that was never prewarmed
        (a restarted receiver), is restored densely."""
        members: list[ReceiverClient] = []
        for r in await self.membership.receivers():
            try:
                status = await self._call(r.status())
                if (
                    committed_attempt is not None
                    and status.attempt == committed_attempt
                    and status.phase == "flushed"
                ):
                    # It acknowledged the attempt that committed; only the notice was lost.
                    await self._call(r.commit_notice(committed_attempt, kv.version))
                    status = await self._call(r.status())
            except (EndpointError, TimeoutError) as exc:
                log.warning("receiver.unreachable", node=r.node, error=str(exc))
                continue
            self._servers.note(r.node, status)
            if status.gate_closed:  # e.g. closed by a coordinator that died: reopen it later
                self._gate_closed.add(r.node)
            if status.gate_released:  # it reopened its gate itself while no coordinator was
                log.warning("receiver.gate_was_released", node=r.node, why=status.gate_released)
                self._notices.append(("GateReleased", f"{r.node}: {status.gate_released}"))
            base = status.base_version if status.dirty and takeover else status.held_version
            if base != kv.version or not status.prewarmed:
                log.info("receiver.restore", node=r.node, held=base, to=kv.version)
                try:
                    await self.membership.restore(r, kv)
                except (EndpointError, TimeoutError, RuntimeError, ValueError) as exc:
                    # It cannot take part now; the next transition tries again.
                    log.warning("receiver.restore_failed", node=r.node, error=str(exc))
                    continue
                self._gate_closed.discard(r.node)  # a restore ends with the gate open
            members.append(r)
        return members

    async def _prepare_receivers(
        self, plan: AttemptPlan, receivers: list[ReceiverClient], mac_tree: Sequence[str]
    ) -> None:
        """Prepare every receiver; `mac_tree`: the nodes' MAC-only relay endpoints (empty: the
        relays forward to each other over CurveZMQ)."""
        req = PrepareRequest(
            attempt=plan.attempt,
            from_version=plan.from_version,
            target_version=plan.target_version,
            mode=plan.mode,
            sync=self.config.sync,
            producers=[p.producer for p in self.producers],
            coordinator=self.name,
            check_samples=self.config.check_samples,
            relay_tree=list(plan.relay_tree),
            relay_mac_tree=list(mac_tree),
        )
        answers = await asyncio.gather(
            *(self._call(r.prepare(req)) for r in receivers), return_exceptions=True
        )
        rejected = [a for a in answers if not isinstance(a, BaseException) and not a.accepted]
        if rejected:
            raise RejectedError(
                "; ".join(f"{a.node}: {a.reason}" for a in rejected), [a.node for a in rejected]
            )
        errors = [a for a in answers if isinstance(a, BaseException)]
        if errors:
            raise AttemptFailedError(f"prepare failed: {errors[0]}")

    async def _schedule(
        self, plan: AttemptPlan, receivers: list[ReceiverClient], progress: TransitionProgress
    ) -> list[SentReport]:
        """Algorithm B.1 from the coordinator's side."""
        tau = plan.attempt
        if self.config.sync:
            await self._gates(tau, receivers, closed=True)
            await self._all(receivers, lambda r: r.open_apply(tau))
        await self._phase(progress, "Streaming")
        await self._each_producer(lambda p: p.start(plan))
        sent = await self._watching(
            receivers, asyncio.gather(*(p.wait_sent(tau) for p in self.producers))
        )
        expected = {s.producer: s.payloads for s in sent}
        progress.payloads = sum(expected.values())
        progress.wire_bytes = sum(s.wire_bytes for s in sent)
        progress.changed_elements = sum(s.changed_elements for s in sent)
        progress.total_elements = sum(s.total_elements for s in sent)
        progress.timings.update(_producer_stages(sent))
        if self.config.relay_tree:
            flushed = await self._all(
                receivers,
                lambda r: r.relay_flush(RelayFlushRequest(attempt=tau, expected=expected)),
            )
            bad = [f for f in flushed if not f.ok]
            if bad:
                raise AttemptFailedError(f"relay flush: {bad[0].node}: {bad[0].errors}")
        if not self.config.sync:
            await self._gates(tau, receivers, closed=True)
            await self._all(receivers, lambda r: r.open_apply(tau))
        acks = await self._all(
            receivers,
            lambda r: r.flush(
                FlushRequest(
                    attempt=tau, expected=expected, check_samples=self.config.check_samples
                )
            ),
            timeout=self.config.flush_timeout_s,
        )
        bad_acks = [a for a in acks if not a.ok]
        if bad_acks:
            raise AttemptFailedError(f"flush: {bad_acks[0].node}: {bad_acks[0].errors}")
        # The slowest receiver's applier calls and device sync (what its flush ACK reports).
        progress.timings["apply_s"] = max(
            (a.timings.get("apply_s", 0.0) + a.timings.get("sync_s", 0.0) for a in acks),
            default=0.0,
        )
        return list(sent)

    async def _watching(self, receivers: Sequence[ReceiverClient], work: Awaitable[T]) -> T:
        """Await `work` while probing the receivers; a receiver confirmed dead fails the attempt
        now (a dead relay-tree node otherwise holds the producers until their ACK timeouts)."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.config.liveness_probe_s)
                if done:
                    return task.result()
                probes = await asyncio.gather(
                    *(self._call(r.status(), self.config.liveness_probe_s) for r in receivers),
                    return_exceptions=True,
                )
                pairs = zip(receivers, probes, strict=True)
                silent = [(r, p) for r, p in pairs if isinstance(p, Exception)]
                dead = await asyncio.gather(
                    *(self.membership.confirmed_dead(r.node) for r, _ in silent)
                )
                for (r, exc), is_dead in zip(silent, dead, strict=True):
                    if is_dead:
                        raise AttemptFailedError(
                            f"{r.node} died while the producers streamed: {exc}"
                        ) from exc
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _commit(
        self, tau: str, kv: CommitRecord, new: CommitRecord
    ) -> Literal["success", "unknown"]:
        try:
            await self.store.commit(self.epoch, tau, kv, new, time.time())
        except CommitUnknownError as exc:
            log.warning("commit.unknown", attempt=tau, error=str(exc))
            return "unknown"
        return "success"

    @staticmethod
    def _resolve(
        k: CommitRecord, kv: CommitRecord, new: CommitRecord
    ) -> Literal["success", "failed", "conflict"]:
        if k == new:
            return "success"
        return "failed" if k == kv else "conflict"

    async def _finalize(
        self,
        tau: str,
        new: CommitRecord,
        receivers: list[ReceiverClient],
        progress: TransitionProgress,
    ) -> float:
        """Returns when the last baseline update ended (the end of the paper's timed window;
        the notices, cleanup and gate reopening that follow are outside it)."""
        await self._phase(progress, "Finalizing")
        # The transition ends only after every producer updated its baseline.
        await self._each_producer(lambda p: p.update_baseline(tau, new))
        t_updated = time.perf_counter()
        # The version is committed: a receiver failing from here on must not stop the others
        # from learning it and serving again. It is left to the next `_join` (a lost notice is
        # resent to a flushed node, anything else restored densely).
        await self._best_effort(receivers, lambda r: r.commit_notice(tau, new.version), "notice")
        await self._cleanup(tau, receivers)
        await self._reopen_gates(tau, receivers)
        return t_updated

    async def _stop(
        self,
        tau: str,
        receivers: list[ReceiverClient],
        result: TransitionResult,
        kv: CommitRecord,
        progress: TransitionProgress | None = None,
    ) -> list[ReceiverClient]:
        """stop_and_wait on every endpoint; retire receivers confirmed dead, except a server's
        host whose receiver restarted in its pod: it rejoins (`_rejoin_host`)."""
        await self._each_producer(lambda p: p.stop_and_wait(tau), tolerate=True)
        alive: list[ReceiverClient] = []
        for r in receivers:
            if await self._stop_one(tau, r, kv, progress):
                alive.append(r)
            else:
                log.warning("receiver.retired", node=r.node, attempt=tau)
                result.retired.append(r.node)
                self._gate_closed.discard(r.node)
        # The rest of a retired node's server cannot apply without it: it leaves too.
        gone = {r.node for r in receivers} - {r.node for r in alive}
        mates = self._servers.with_mates(gone, [r.node for r in alive]) - gone
        if mates:
            log.warning("receiver.server_left", nodes=sorted(mates), attempt=tau)
            result.retired.extend(sorted(mates))
        return [r for r in alive if r.node not in mates]

    async def _stop_one(
        self, tau: str, r: ReceiverClient, kv: CommitRecord, progress: TransitionProgress | None
    ) -> bool:
        """True once `r` acknowledged the stop (or its restarted host rejoined); False when it
        is confirmed dead. A receiver that answers its status with the attempt stopped is
        finishing the apply call in progress (a vLLM rank on another host may wait
        `stage_wait_s` for a payload file its dead receiver never writes): its one stop call is
        waited for up to `stop_drain_s`, not counted as silent. Raises after `stop_retries`
        tries without any answer."""
        silent = 0
        draining_since: float | None = None
        said: str | None = None  # the transition's message before the drain was shown
        call = asyncio.ensure_future(r.stop(tau))
        try:
            while True:
                try:
                    await self._call(asyncio.shield(call))
                    return True
                except TimeoutError as exc:
                    if await self._draining(r, tau):
                        now = time.monotonic()
                        if draining_since is None:
                            draining_since = now
                            said = await self._draining_said(r.node, tau, progress)
                        if now - draining_since < self.config.stop_drain_s:
                            continue  # the same call: its apply is finishing
                        raise InterventionRequiredError(
                            f"receiver {r.node} acknowledged stop but is still finishing its "
                            f"apply call after {self.config.stop_drain_s:g}s"
                        ) from exc
                    error: Exception = exc
                except EndpointError as exc:
                    error = exc
                if await self.membership.confirmed_dead(r.node):
                    return await self._rejoin_host(r, kv)
                silent += 1
                log.warning("receiver.stop_retry", node=r.node, error=_why(error))
                if silent >= self.config.stop_retries:
                    raise InterventionRequiredError(
                        f"receiver {r.node} neither acknowledges stop nor is confirmed dead"
                    )
                call.cancel()
                call = asyncio.ensure_future(r.stop(tau))
        finally:
            call.cancel()
            if progress is not None and said is not None:
                progress.message = said  # the wait is over: the next update says why it failed

    async def _draining_said(
        self, node: str, tau: str, progress: TransitionProgress | None
    ) -> str | None:
        """Log it, and show it in the transition's message (the wait may last a minute);
        returns the message it replaced."""
        log.info("receiver.stop_draining", node=node, attempt=tau)
        if progress is None:
            return None
        before = progress.message
        note = f"{node} is ending its apply call (stop waits up to {self.config.stop_drain_s:g}s)"
        progress.message = f"{before}; {note}" if before else note
        await self.sink.update(progress)
        return before

    async def _draining(self, r: ReceiverClient, tau: str) -> bool:
        """`r` answers and shows `tau` stopped: the stop arrived, its apply call is ending."""
        try:
            status = await self._call(r.status(), min(5.0, self.config.control_timeout_s))
        except (EndpointError, TimeoutError):
            return False
        return status.attempt == tau and status.phase == _STOPPED

    async def _rejoin_hosts(
        self, rejected: set[str], receivers: Sequence[ReceiverClient], kv: CommitRecord
    ) -> set[str]:
        """Of the nodes an attempt rejected, the ones that leave the transition: a server's
        host whose receiver restarted rejoins (`_rejoin_host`), so its server stays in."""
        leaving: set[str] = set()
        for r in receivers:
            if r.node in rejected and not await self._rejoin_host(r, kv):
                leaving.add(r.node)
        return leaving

    async def _rejoin_host(self, r: ReceiverClient, kv: CommitRecord) -> bool:
        """A multi-host server's host whose receiver restarted in its pod rejoins between two
        attempts: it holds no weights (its restore loads nothing) and its vLLM ranks live on,
        so the overwrite retry repairs them with the rest of the server. Waits up to
        control_timeout_s for the restarted receiver to answer. False for any other node,
        and for a host whose pod is gone (its ranks went with it)."""
        if not self._servers.is_host(r.node) or await self.membership.host_gone(r.node):
            return False
        deadline = time.monotonic() + self.config.control_timeout_s
        while True:
            try:
                await self.membership.restore(r, kv)
            except (EndpointError, TimeoutError, RuntimeError, ValueError) as exc:
                if time.monotonic() < deadline:
                    await asyncio.sleep(0.5)
                    continue
                log.warning("receiver.host_rejoin_failed", node=r.node, error=str(exc))
                return False
            log.info("receiver.host_rejoined", node=r.node, server=self._servers.server(r.node))
            self._gate_closed.discard(r.node)  # a restore ends with the gate open
            return True

    async def _cleanup(self, tau: str, receivers: list[ReceiverClient]) -> None:
        await self._each_producer(lambda p: p.cleanup(tau), tolerate=True)
        for r in receivers:
            try:
                await self._call(r.cleanup(tau))
            except (EndpointError, TimeoutError) as exc:
                log.warning("receiver.cleanup_failed", node=r.node, error=str(exc))

    async def _gates(self, tau: str, receivers: list[ReceiverClient], *, closed: bool) -> None:
        todo = [r for r in receivers if (r.node in self._gate_closed) != closed]
        await self._all(todo, lambda r: r.gate(GateRequest(attempt=tau, closed=closed)))
        for r in todo:
            (self._gate_closed.add if closed else self._gate_closed.discard)(r.node)

    async def _reopen_gates(self, tau: str, receivers: Sequence[ReceiverClient]) -> None:
        """Reopen every gate this coordinator knows closed, node by node; a failure leaves
        that node marked closed (the next transition tries again)."""
        todo = [r for r in receivers if r.node in self._gate_closed]
        answers = await asyncio.gather(
            *(self._call(r.gate(GateRequest(attempt=tau, closed=False))) for r in todo),
            return_exceptions=True,
        )
        for r, a in zip(todo, answers, strict=True):
            if isinstance(a, BaseException):
                log.warning("receiver.reopen_failed", node=r.node, error=str(a) or repr(a))
            else:
                self._gate_closed.discard(r.node)

    async def _best_effort(
        self,
        receivers: Sequence[ReceiverClient],
        call: Callable[[ReceiverClient], Awaitable[object]],
        what: str,
    ) -> list[str]:
        """One call per receiver; failures are logged, not raised. Returns the failed nodes."""
        answers = await asyncio.gather(
            *(self._call(call(r)) for r in receivers), return_exceptions=True
        )
        failed: list[str] = []
        for r, a in zip(receivers, answers, strict=True):
            if isinstance(a, BaseException):
                log.warning(f"receiver.{what}_failed", node=r.node, error=str(a) or repr(a))
                failed.append(r.node)
        return failed

    async def _clear(self, tau: str | None) -> None:
        if tau is not None:
            await self.store.mark_obsolete(self.epoch, tau)

    async def _abort(self, result: TransitionResult, why: str, reason: str) -> TransitionResult:
        """Operator intervention needed: stop, keep the gate closed, say why."""
        await self.store.abort(f"{self.name}: {why}")
        result.outcome, result.message, result.reason = "aborted", why, reason
        assert result.progress is not None
        await self._phase(
            result.progress,
            "Aborted",
            f"{why}; the request gate stays closed until receivers are densely restored "
            "and the abort is cleared",
        )
        return result

    async def _phase(self, progress: TransitionProgress, phase: str, message: str = "") -> None:
        progress.phase = phase
        if message:
            progress.message = message
        log.info(
            "transition.phase",
            policy=self.policy,
            to=progress.to_version,
            phase=phase,
            attempt=progress.attempt,
            mode=progress.mode,
            message=message or None,
        )
        await self.sink.update(progress)

    # -- helpers ------------------------------------------------------------------------------
    async def _call(self, aw: Awaitable[T], timeout: float | None = None) -> T:
        return await asyncio.wait_for(aw, timeout or self.config.control_timeout_s)

    async def _all(
        self,
        receivers: Sequence[ReceiverClient],
        call: Callable[[ReceiverClient], Awaitable[T]],
        timeout: float | None = None,
    ) -> list[T]:
        """One call per receiver, concurrently; the first failure fails the whole step at once
        (the others are cancelled): a node that died must not leave the attempt waiting for
        the others' timeouts, since the retry stops every node anyway."""
        tasks = [asyncio.ensure_future(self._call(call(r), timeout)) for r in receivers]
        if not tasks:
            return []
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            pending = [t for t in tasks if not t.done()]
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for r, t in zip(receivers, tasks, strict=True):
            exc = None if t.cancelled() else t.exception()
            if isinstance(exc, TimeoutError):
                limit = timeout or self.config.control_timeout_s
                raise AttemptFailedError(f"{r.node}: no answer within {limit:g}s") from exc
            if exc is not None:
                raise AttemptFailedError(f"{r.node}: {type(exc).__name__}: {exc}") from exc
        return [t.result() for t in tasks]

    async def _each_producer(
        self, call: Callable[[ProducerClient], Awaitable[object]], tolerate: bool = False
    ) -> None:
        answers = await asyncio.gather(
            *(self._call(call(p)) for p in self.producers), return_exceptions=True
        )
        for p, a in zip(self.producers, answers, strict=True):
            if isinstance(a, BaseException):
                if isinstance(a, PeerAuthenticationError) and not tolerate:
                    raise a  # another token: a configuration error, not a failed attempt
                if tolerate:
                    log.warning("producer.call_failed", producer=p.producer, error=str(a))
                else:
                    raise AttemptFailedError(f"producer {p.producer}: {a}") from a


#: The producer pipeline stages that construct the delta and encode it (`SentReport.timings`).
CONSTRUCT_STAGES = ("intake", "compare", "coalesce", "compress")


def _producer_stages(sent: Sequence[SentReport]) -> dict[str, float]:
    """The slowest producer's busy time constructing and encoding the delta (`construct_s`)
    and sending it (`transport_s`), as the producers reported them."""
    return {
        "construct_s": max(
            (sum(r.timings.get(k, 0.0) for k in CONSTRUCT_STAGES) for r in sent), default=0.0
        ),
        "transport_s": max((r.timings.get("send", 0.0) for r in sent), default=0.0),
    }


def _why(exc: BaseException) -> str:
    """A failure as a log line can say it (a timeout's str() is empty)."""
    return "no answer in time" if isinstance(exc, TimeoutError) else str(exc) or repr(exc)
