"""One RefitPolicy's coordinator inside the operator (one task per policy: `policy_tasks.py`).

Each pass of the loop reads the policy (a live view kopf keeps current) and its pods (kopf's
pod index), and then, if this operator holds the policy's Lease:

1. makes sure the PolicyVersion exists (version 0 on first sight) — only the commit store
   writes it;
2. on taking the Lease, acquires the commit record (a new epoch fences any older coordinator),
   finishes a transition whose commit took effect (`Coordinator.recover`) and marks its
   RefitTransition Committed with a `TakenOver` event;
3. clears an abort when asked (annotation `kuberefit.io/clear-abort`);
4. when every expected producer has staged v+1 (and the policy is not paused or aborted), runs
   the transition: an admitted attempt left by a killed coordinator is taken over in overwrite
   mode (Algorithm B.2), and its RefitTransition continues;
5. writes the RefitPolicy status when it changed.

A coordinator fenced by a newer epoch, or whose Lease lapsed mid-transition (outcome
`conflict`), writes nothing more (one Event), drops its coordinator and goes back to waiting
for the Lease. Nothing here touches payload bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import structlog

from refit_operator import metrics
from refit_operator.commit_store import StoreState
from refit_operator.commit_store.kube import KubernetesCommitStore
from refit_operator.discovery import Discovered, PodView, discover
from refit_operator.kube.api import KubeApi, object_ref
from refit_operator.kube.lease import PolicyLease
from refit_operator.kube.names import CLEAR_ABORT, VERIFY_NOW
from refit_operator.pod_settings import FixedSettingsWatch, report_restart_required
from refit_operator.policy_audit import NO_CHECKPOINT, Verified, audit
from refit_operator.policy_producers import ProducerProbe, probe_producers
from refit_operator.policy_spec import PolicySpec, SpecError, parse_spec
from refit_operator.policy_status import Observed, policy_status, same_status
from refit_operator.policy_token import PolicyToken
from refit_operator.policy_transition import Coordinating, log_done
from refit_operator.producer_client import HttpProducerClient
from refit_operator.transition_types import TransitionResult
from refit_operator.transitions import prune
from refit_protocol.commit import CommitRecord

log = structlog.get_logger("kuberefit.policy")

INITIAL_BASELINE = "g-initial"
#: While it holds the Lease only this operator writes the record, so a pass reads it at most
#: this often (plus after each transition and abort clearing): the record is a GET per read.
RECORD_REFRESH_S = 5.0


@dataclass(frozen=True)
class RunnerSettings:
    """Operator-wide timing (flags of `kuberefit operator serve`)."""

    identity: str
    poll_s: float = 0.5
    lease_s: int = 15
    status_interval_s: float = 1.0
    #: Namespace of the policies' Leases (the operator's own). Empty: each beside its policy.
    lease_namespace: str = ""


class PolicyRunner:
    """The loop described in the module docstring, for one policy. Its parts return values:
    the token (`policy_token`), the producers' probe (`policy_producers`), the audit
    (`policy_audit`) and the coordinating itself (`policy_transition`)."""

    def __init__(
        self,
        api: KubeApi,
        namespace: str,
        name: str,
        *,
        body: Callable[[], Mapping[str, Any]],
        pods: Callable[[], Sequence[PodView]],
        stopped: Callable[[], bool],
        settings: RunnerSettings,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self.body = body
        self.pods = pods
        self.stopped = stopped
        self.settings = settings
        self.labels = {"namespace": namespace, "policy": name}
        metrics.preset_policy(namespace, name)
        self.lease = PolicyLease(
            api,
            settings.lease_namespace or namespace,
            name,
            settings.identity,
            settings.lease_s,
            policy_namespace=namespace if settings.lease_namespace else "",
        )
        self.store = KubernetesCommitStore(api.custom, namespace, name)
        self.record = _RecentRecord(self.store)
        self.token = PolicyToken(api, namespace)
        self.coordinating: Coordinating | None = None
        self.session: aiohttp.ClientSession | None = None
        self.spec: PolicySpec | None = None
        self._fixed_settings = FixedSettingsWatch()
        self._store_ready = False
        self._status: dict[str, Any] | None = None  # the status last written
        # What the status reports, besides what each pass finds:
        self._observed_last: Observed | None = None
        self._generation = 0
        self._probe = ProducerProbe()
        self._current = ("", "")  # the running transition: name, "vN -> vN+1"
        self._last: tuple[str, str, str] = ("", "", "")  # the last one: name, outcome, message
        self._verified: Verified | None = None  # the last audit (spec.verify)
        self._error = ""  # the last pass's failure, until a pass succeeds

    # -- the loop -------------------------------------------------------------------------------
    async def run(self) -> None:
        log.info("policy.started", namespace=self.namespace, policy=self.name)
        lease: asyncio.Task[None] | None = None
        cancelled = False  # a graceful stop ends its pass; a cancelled one is cut mid-pass
        try:
            async with aiohttp.ClientSession() as session:
                self.session = session
                lease = asyncio.create_task(self.lease.keep(self._leading))
                while not self.stopped():
                    try:
                        await self.step()
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:  # report, never crash the operator
                        log.exception("policy.error", policy=self.name, error=str(exc))
                        self._error = f"{type(exc).__name__}: {exc}"
                    else:
                        self._error = ""
                    await _sleep(self.settings.poll_s, self.stopped)
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            if lease is not None:
                lease.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await lease
            metrics.LEADER.labels(**self.labels).set(0)
            log.info(
                "policy.stopped", namespace=self.namespace, policy=self.name, cancelled=cancelled
            )

    async def step(self) -> None:
        """One pass (see the module docstring)."""
        obj = dict(self.body())
        annotations = obj.get("metadata", {}).get("annotations") or {}
        generation = self._generation = int(obj.get("metadata", {}).get("generation") or 0)
        try:
            spec = self.spec = parse_spec(dict(obj.get("spec") or {}))
        except SpecError as exc:
            if self.lease.held:  # what was last observed still holds; only the spec is bad
                last = self._observed_last or Observed(generation)
                observed = replace(last, generation=generation, spec_error=str(exc))
                await self._write_status(obj, observed)
            return
        if not self.lease.held:
            self._drop_coordinator("lease not held")
            return
        found = discover(self.pods(), spec)
        pods = [*found.trainers, *found.rollouts]
        await report_restart_required(self.api, self._fixed_settings, pods, spec, self.name)
        token = await self.token.current(spec)
        if not self._store_ready:
            await self.store.initialize(CommitRecord(0, INITIAL_BASELINE))
            self._store_ready = True
        state = await self.record.read()
        if CLEAR_ABORT in annotations:
            state = await self._clear_abort(obj, state)
        metrics.TRANSITION.committed(state.record.version, self.namespace, self.name)
        await self._write_status(obj, self._observed(spec, found, state))
        if token is None or state.aborted_by:
            return
        if VERIFY_NOW in annotations:
            await self._verify_now(obj, spec, state, token)
        assert self.session is not None
        self._probe = ProducerProbe()  # this pass's, even if the probe raises
        probe = self._probe = await probe_producers(
            self.session, found, spec, token, state.record, self._fixed_settings
        )
        if probe.clients is None:
            return
        if self.coordinating is None:
            await self._begin(obj, spec, token, probe.clients)
            return
        target = state.record.version + 1
        active = state.active
        admitted = active is not None and active.target_version == target and not active.obsolete
        if spec.paused and not admitted:  # an attempt already admitted is finished first
            return
        if probe.all_staged(target):
            await self._transition(obj, spec, found, token)

    # -- leadership -----------------------------------------------------------------------------
    async def _begin(
        self,
        obj: Mapping[str, Any],
        spec: PolicySpec,
        token: str,
        producers: Sequence[HttpProducerClient],
    ) -> None:
        assert self.session is not None
        coordinating = Coordinating(
            self.api,
            self.lease,
            self.store,
            self.labels,
            spec,
            token=token,
            producers=producers,
            rollouts=lambda: list(discover(self.pods(), self.spec or spec).rollouts),
            session=self.session,
            identity=self.settings.identity,
            status_interval_s=self.settings.status_interval_s,
        )
        if not await coordinating.begin():
            return
        self.coordinating = coordinating
        self._status = None  # another operator may have written meanwhile
        self.record.forget()
        recovered = await coordinating.close_recovered(obj)
        if recovered is not None:
            self._record(*recovered)

    def _leading(self, held: bool) -> None:
        metrics.LEADER.labels(**self.labels).set(1 if held else 0)

    def _drop_coordinator(self, why: str) -> None:
        if self.coordinating is not None:
            log.warning("policy.coordinator_dropped", policy=self.name, why=why)
            self.coordinating = None

    # -- one transition -------------------------------------------------------------------------
    async def _transition(
        self, obj: Mapping[str, Any], spec: PolicySpec, found: Discovered, token: str
    ) -> None:
        assert self.coordinating is not None
        assert self._probe.clients is not None
        state = await self.store.read()
        v = state.record.version
        recorder = await self.coordinating.open(obj, spec, token, self._probe.clients, v)
        # Sidecars of the previous release take no settings with a plan (reported instead).
        follow = self._fixed_settings.all_follow(list(found.ready_trainers))
        self._current = (recorder.name, f"v{v} -> v{v + 1}")
        await self._write_status(obj, self._observed(spec, found, state))
        try:
            settings = spec.stream_settings() if follow else None
            result = await self.coordinating.run(recorder, spec, settings)
        finally:
            self._current = ("", "")
        self._record(result, recorder.name)
        if result.outcome in ("failed", "conflict"):
            # Not finished by this coordinator: a newer one fenced it (it writes nothing more),
            # or it failed (the next pass acquires the record again and recovers or takes the
            # attempt over, as after a restart).
            self._drop_coordinator(result.message)
            return
        after = await self.record.read(fresh=True)
        metrics.TRANSITION.committed(after.record.version, self.namespace, self.name)
        every = spec.verify.every_versions
        if result.outcome == "committed" and every and result.version % every == 0:
            await self._audit(obj, spec, result.version, token)
        await self._write_status(obj, self._observed(spec, discover(self.pods(), spec), after))
        await prune(self.api, self.namespace, self.name, spec.keep_transitions)
        if result.outcome == "rejected":
            await _sleep(spec.rejected_backoff_seconds, self.stopped)

    async def _verify_now(
        self, obj: Mapping[str, Any], spec: PolicySpec, state: StoreState, token: str
    ) -> None:
        """The `kuberefit.io/verify-now` annotation: audit the committed version once now."""
        try:
            if spec.restore.checkpoint_template:
                await self._audit(obj, spec, state.record.version, token)
            else:
                self._verified = NO_CHECKPOINT
        finally:  # asked once: never again on every pass, whatever happened
            await self.api.remove_policy_annotation(self.namespace, self.name, VERIFY_NOW)
        await self._write_status(obj, self._observed(spec, discover(self.pods(), spec), state))

    async def _audit(
        self, obj: Mapping[str, Any], spec: PolicySpec, version: int, token: str
    ) -> None:
        self._verified = await audit(
            self.api,
            obj,
            discover(self.pods(), spec).ready_rollouts,
            spec.restore.checkpoint_template.format(version=version),
            version,
            token=token,
            timeout_s=float(spec.flush_timeout_seconds),
            labels=self.labels,
        )

    def _record(self, result: TransitionResult, name: str) -> None:
        metrics.TRANSITION.record(result, self.namespace, self.name)
        self._last = (name, result.outcome, result.message)
        log_done(self.name, name, result)

    # -- parts ----------------------------------------------------------------------------------
    async def _clear_abort(self, obj: Mapping[str, Any], state: StoreState) -> StoreState:
        if state.aborted_by:
            await self.store.clear_abort()
            log.info("policy.abort_cleared", policy=self.name, was=state.aborted_by)
            with contextlib.suppress(Exception):
                await self.api.post_event(
                    object_ref(dict(obj)),
                    "AbortCleared",
                    f"abort by {state.aborted_by} cleared; transitions resume",
                )
        await self.api.remove_policy_annotation(self.namespace, self.name, CLEAR_ABORT)
        return await self.record.read(fresh=True)

    def _observed(self, spec: PolicySpec, found: Discovered, state: StoreState) -> Observed:
        name, outcome, message = self._last
        servers_ready, servers = found.servers()
        return Observed(
            generation=self._generation,
            token_error=self.token.error,
            paused=spec.paused,
            committed_version=state.record.version,
            aborted_by=state.aborted_by,
            producers_expected=spec.producers,
            trainers=len(found.trainers),
            trainers_ready=len(found.ready_trainers),
            rollouts=len(found.rollouts),
            rollouts_ready=len(found.ready_rollouts),
            servers=servers,
            servers_ready=servers_ready,
            current=self._current[0],
            current_summary=self._current[1],
            last=name,
            last_outcome=outcome,
            last_message=message,
            error=self._error,
            producers_error=self._probe.error,
            producers_reason=self._probe.reason,
            coordinator=self.settings.identity,
            not_injected=tuple(p.name for p in found.not_injected),
            restart_required=self._fixed_settings.current,
            verify_every=spec.verify.every_versions,
            verified=self._verified,
        )

    async def _write_status(self, obj: Mapping[str, Any], observed: Observed) -> None:
        if not observed.spec_error:
            self._observed_last = observed
        previous = self._status if self._status is not None else obj.get("status")
        status = policy_status(observed, previous)
        if same_status(previous, status):
            return
        await self.api.patch_policy_status(self.namespace, self.name, status)
        self._status = status


class _RecentRecord:
    """The policy's commit record, read at most every RECORD_REFRESH_S unless asked `fresh`:
    while it holds the Lease only this operator writes it, and every read is a GET."""

    def __init__(self, store: KubernetesCommitStore) -> None:
        self.store = store
        self._state: StoreState | None = None
        self._at = 0.0

    async def read(self, *, fresh: bool = False) -> StoreState:
        now = time.monotonic()
        if fresh or self._state is None or now - self._at > RECORD_REFRESH_S:
            self._state, self._at = await self.store.read(), now
        return self._state

    def forget(self) -> None:
        """Read it on the next pass (another operator may have written meanwhile)."""
        self._state = None


async def _sleep(seconds: float, stopped: Callable[[], bool]) -> None:
    """Sleep `seconds`, or until `stopped()`."""
    deadline = time.monotonic() + seconds
    while not stopped():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        await asyncio.sleep(min(left, 0.2))
