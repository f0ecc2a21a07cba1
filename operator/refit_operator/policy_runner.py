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
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import structlog

from refit_operator import metrics
from refit_operator.commit_store import StoreState
from refit_operator.commit_store.kube import KubernetesCommitStore
from refit_operator.coordinator import Coordinator, TransitionResult
from refit_operator.discovery import Discovered, PodView, discover
from refit_operator.kube.api import KubeApi, NotFoundError, SecretRefusedError, object_ref
from refit_operator.kube.lease import PolicyLease
from refit_operator.kube.names import CLEAR_ABORT, VERIFY_NOW
from refit_operator.pod_membership import PodMembership
from refit_operator.pod_settings import RESTART_REQUIRED, FixedSettingsWatch
from refit_operator.policy_spec import PolicySpec, SpecError, parse_spec
from refit_operator.policy_status import Observed, policy_status, same_status
from refit_operator.producer_client import HttpProducerClient, chunking_disagreement
from refit_operator.transitions import TransitionRecorder, to_prune
from refit_operator.verify import EXIT_MISMATCH, EXIT_OK, exit_code, render, verify_nodes
from refit_protocol.commit import CommitRecord
from refit_protocol.errors import EndpointError
from refit_protocol.producer_api import ProducerStatus
from refit_protocol.tensors import TensorMetaModel
from refit_protocol.tokens import TokenRing

log = structlog.get_logger("kuberefit.policy")

INITIAL_BASELINE = "g-initial"
#: While it holds the Lease only this operator writes the record, so a pass reads it at most
#: this often (plus after each transition and abort clearing): the record is a GET per read.
RECORD_REFRESH_S = 5.0
#: How long a token read from the policy's Secret is used before it is read again.
TOKEN_REFRESH_S = 60.0


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
    """The loop described in the module docstring, for one policy."""

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
        self.coordinator: Coordinator | None = None
        self.membership: PodMembership | None = None
        self.session: aiohttp.ClientSession | None = None
        self.spec: PolicySpec | None = None
        self._producer_clients: list[HttpProducerClient] = []
        self._recorder: TransitionRecorder | None = None
        self._store_ready = False
        self._status: dict[str, Any] | None = None
        self._current = ""
        self._current_summary = ""
        self._last: tuple[str, str, str] = ("", "", "")
        self._token: tuple[tuple[str, str, str], TokenRing] | None = None
        self._token_error: tuple[str, str] | None = None
        self._token_at = 0.0
        self._verified: tuple[bool, str, str] | None = None  # the last audit (spec.verify)
        self._error = ""  # the last pass's failure, until a pass succeeds
        self._generation = 0
        self._state: StoreState | None = None
        self._observed_last: Observed | None = None
        self._producer_error = ""
        self._candidates: dict[int, int | None] = {}  # producer -> staged version, this pass
        self._state_at = 0.0
        self._fixed_settings = FixedSettingsWatch()

    # -- the loop -------------------------------------------------------------------------------
    async def run(self) -> None:
        log.info("policy.started", namespace=self.namespace, policy=self.name)
        lease: asyncio.Task[None] | None = None
        cancelled = False  # a graceful stop ends its pass; a cancelled one is cut mid-pass
        try:
            async with aiohttp.ClientSession() as session:
                self.session = session
                lease = asyncio.create_task(self._keep_lease())
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
                    await self._sleep(self.settings.poll_s)
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
        await self._report_fixed_settings(found, spec)
        token = await self._read_token(spec)
        if not self._store_ready:
            await self.store.initialize(CommitRecord(0, INITIAL_BASELINE))
            self._store_ready = True
        state = await self._record_state()
        if CLEAR_ABORT in (obj.get("metadata", {}).get("annotations") or {}):
            state = await self._clear_abort(obj, state)
        metrics.COMMITTED_VERSION.labels(**self.labels).set(state.record.version)
        await self._write_status(obj, self._observed(spec, found, state))
        if token is None or state.aborted_by:
            return
        if VERIFY_NOW in (obj.get("metadata", {}).get("annotations") or {}):
            await self._verify_now(obj, spec, state, token)
        producers = await self._producers(found, spec, token, state.record)
        if producers is None:
            return
        self._producer_clients = producers
        if self.coordinator is None:
            await self._become_coordinator(obj, spec, token, producers)
            return
        target = state.record.version + 1
        active = state.active
        admitted = active is not None and active.target_version == target and not active.obsolete
        if spec.paused and not admitted:  # an attempt already admitted is finished first
            return
        if any(v != target for v in self._candidates.values()):
            return  # not every producer has staged v+1 yet (as its status said this pass)
        await self._transition(obj, spec, found, token, producers)

    # -- leadership -----------------------------------------------------------------------------
    async def _keep_lease(self) -> None:
        while True:
            try:
                held = await self.lease.acquire_or_renew()
            except Exception as exc:  # the API server may be briefly unreachable
                log.warning("lease.renew_failed", policy=self.name, error=str(exc))
                held = False
                self.lease.lost()
            metrics.LEADER.labels(**self.labels).set(1 if held else 0)
            await asyncio.sleep(self.settings.lease_s / 3)

    async def _become_coordinator(
        self,
        obj: Mapping[str, Any],
        spec: PolicySpec,
        token: str,
        producers: list[HttpProducerClient],
    ) -> None:
        if not await self.lease.acquire_or_renew():  # fresh, right before taking the record
            return
        membership = self.membership = self._membership(spec, token)
        coordinator = Coordinator(
            self.name,
            self.store,
            producers,
            membership,
            _NullSink(),
            spec.coordinator_config(),
            name=self.settings.identity,
        )
        await coordinator.start()
        self._status = self._state = None  # another operator may have written meanwhile
        recovered = await coordinator.recover()
        kv = (await self.store.read()).record
        self.coordinator = coordinator
        # A transition whose commit took effect but whose coordinator stopped: it is finished
        # now (`recover`); its RefitTransition says so.
        recorder = TransitionRecorder(
            self.api, dict(obj), kv.version - 1, kv.version, coordinator=coordinator.name
        )
        if kv.version > 0 and await recorder.open(create=False):
            result = TransitionResult("committed", kv.version, 0, message="recovered")
            metrics.TAKEOVERS.labels(**self.labels).inc()
            await recorder.finish(result, None)
            self._record(result, recorder.name)
        log.info(
            "policy.coordinating",
            policy=self.name,
            epoch=coordinator.epoch,
            version=kv.version,
            recovered=recovered,
        )

    def _drop_coordinator(self, why: str) -> None:
        if self.coordinator is not None:
            log.warning("policy.coordinator_dropped", policy=self.name, why=why)
            self.coordinator = None
            self.membership = None

    # -- one transition -------------------------------------------------------------------------
    async def _transition(
        self,
        obj: Mapping[str, Any],
        spec: PolicySpec,
        found: Discovered,
        token: str,
        producers: list[HttpProducerClient],
    ) -> None:
        assert self.coordinator is not None
        state = await self.store.read()
        kv = state.record
        recorder = TransitionRecorder(
            self.api,
            dict(obj),
            kv.version,
            kv.version + 1,
            coordinator=self.coordinator.name,
            min_interval_s=self.settings.status_interval_s,
        )
        membership = self.membership or self._membership(spec, token)
        membership.token = token
        membership.checkpoint_template = spec.restore.checkpoint_template
        membership.probe_timeout_s = min(3.0, float(spec.control_timeout_seconds))
        self._recorder = recorder
        recorder.poll = lambda: _aggregate(membership)
        await membership.prewarm_holders(kv.version)
        self.coordinator.producers = list(producers)
        self.coordinator.membership = membership
        self.coordinator.sink = recorder
        self.coordinator.config = spec.coordinator_config()
        if await recorder.open():
            metrics.TAKEOVERS.labels(**self.labels).inc()
        # Sidecars of the previous release take no settings with a plan (reported instead).
        follow = self._fixed_settings.all_follow(list(found.ready_trainers))
        settings = spec.stream_settings() if follow else None
        self._current = recorder.name
        self._current_summary = f"v{kv.version} -> v{kv.version + 1}"
        await self._write_status(obj, self._observed(spec, found, state))
        try:
            result = await self._run_while_leader(
                self.coordinator.run_transition(frozenset(membership.incompatible), settings),
                kv.version,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the API server or a bug: the next coordinator takes over
            log.exception("transition.error", policy=self.name, error=str(exc))
            result = TransitionResult(
                "failed", kv.version, 0, message=f"{type(exc).__name__}: {exc}"
            )
            result.reason = "OperatorError"
        finally:
            self._current = ""
            self._recorder = None
            await recorder.close()
        await recorder.finish(result, None if result.outcome == "failed" else result.receivers)
        self._record(result, recorder.name)
        if result.outcome in ("failed", "conflict"):
            # Not finished by this coordinator: a newer one fenced it (it writes nothing more),
            # or it failed (the next pass acquires the record again and recovers or takes the
            # attempt over, as after a restart).
            self._drop_coordinator(result.message)
            return
        after = await self._record_state(fresh=True)
        metrics.COMMITTED_VERSION.labels(**self.labels).set(after.record.version)
        every = spec.verify.every_versions
        if result.outcome == "committed" and every and result.version % every == 0:
            await self._audit(obj, spec, result.version, token)
        await self._write_status(obj, self._observed(spec, discover(self.pods(), spec), after))
        await self._prune(spec)
        if result.outcome == "rejected":
            await self._sleep(spec.rejected_backoff_seconds)

    async def _verify_now(
        self, obj: Mapping[str, Any], spec: PolicySpec, state: StoreState, token: str
    ) -> None:
        """The `kuberefit.io/verify-now` annotation: audit the committed version once now."""
        try:
            if spec.restore.checkpoint_template:
                await self._audit(obj, spec, state.record.version, token)
            else:
                self._verified = (
                    False,
                    "NoCheckpointTemplate",
                    "an audit compares against the committed checkpoint: set "
                    "spec.restore.checkpointTemplate",
                )
        finally:  # asked once: never again on every pass, whatever happened
            await self.api.remove_policy_annotation(self.namespace, self.name, VERIFY_NOW)
        await self._write_status(obj, self._observed(spec, discover(self.pods(), spec), state))

    async def _audit(
        self, obj: Mapping[str, Any], spec: PolicySpec, version: int, token: str
    ) -> None:
        """spec.verify: every ready rollout node proves it holds exactly a dense load of the
        committed checkpoint (`kuberefit verify`); the result is the `Verified` condition, an
        Event and metrics. A node with a mismatch closed its gate and forgot its version: the
        next transition restores it densely before it serves again."""
        pods = discover(self.pods(), spec).ready_rollouts
        checkpoint = spec.restore.checkpoint_template.format(version=version)
        t0 = time.monotonic()
        try:
            results = await verify_nodes(
                [p.url for p in pods],
                checkpoint,
                version,
                token=token,
                timeout_s=float(spec.flush_timeout_seconds),
            )
        except Exception as exc:  # never let an audit stop the policy's transitions
            log.exception("policy.audit_failed", policy=self.name, version=version)
            metrics.AUDITS.labels(**self.labels, result="incomplete").inc()
            self._verified = (False, "Incomplete", f"v{version}: audit failed: {exc}")
            return
        code, lines = exit_code(results), render(results)
        took = time.monotonic() - t0
        if code == EXIT_OK:
            outcome, reason = "verified", "Verified"
            message = (
                f"v{version}: {len(results)} rollout node(s) hold exactly the bits of a dense "
                f"load of {checkpoint} ({took:.1f}s)"
            )
            metrics.AUDITED_VERSION.labels(**self.labels).set(version)
        else:
            outcome = "mismatch" if code == EXIT_MISMATCH else "incomplete"
            reason = "Mismatch" if code == EXIT_MISMATCH else "Incomplete"
            problems = [line for line in lines if ": OK v" not in line]
            message = f"v{version}: " + "; ".join(problems)[:900]
        metrics.AUDITS.labels(**self.labels, result=outcome).inc()
        self._verified = (code == EXIT_OK, reason, message)
        log.info("policy.audited", policy=self.name, version=version, result=outcome)
        with contextlib.suppress(Exception):
            await self.api.post_event(
                object_ref(dict(obj)),
                "Verified" if code == EXIT_OK else f"Audit{reason}",
                message,
                warning=code != EXIT_OK,
            )

    async def _run_while_leader(
        self, work: Awaitable[TransitionResult], version: int
    ) -> TransitionResult:
        """Await `work`, cancelling it if this operator stops holding the Lease: another one
        may coordinate now, and its newer epoch fences this one's writes anyway."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=1.0)
                if done:
                    return task.result()
                if not self.lease.held:
                    log.warning("transition.lease_lost", policy=self.name)
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    return TransitionResult(
                        "conflict", version, 0, message="lease lost", reason="LeaseLost"
                    )
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _record(self, result: TransitionResult, name: str) -> None:
        metrics.TRANSITIONS.labels(**self.labels, outcome=result.outcome).inc()
        for mode in result.modes:
            metrics.ATTEMPTS.labels(**self.labels, mode=mode).inc()
        p = result.progress
        if result.outcome == "committed":
            metrics.LATENCY.labels(**self.labels).observe(result.latency_s)
            metrics.LAST_COMMIT.labels(**self.labels).set(time.time())
            for stage, seconds in metrics.stage_seconds(result).items():
                metrics.STAGE_SECONDS.labels(**self.labels, stage=stage).observe(seconds)
            if p is not None:
                metrics.WIRE_BYTES.labels(**self.labels).inc(p.wire_bytes)
                if p.total_elements:
                    metrics.CHANGED_FRACTION.labels(**self.labels).set(
                        p.changed_elements / p.total_elements
                    )
        self._last = (name, result.outcome, result.message)
        log.info(
            "transition.done",
            policy=self.name,
            transition=name,
            outcome=result.outcome,
            version=result.version,
            attempts=result.attempts,
            modes=result.modes,
            retired=result.retired,
            latency_s=round(result.latency_s, 3),
        )

    async def _prune(self, spec: PolicySpec) -> None:
        items = await self.api.list_transitions(self.namespace)
        for name in to_prune(items, self.name, spec.keep_transitions):
            with contextlib.suppress(NotFoundError):
                await self.api.delete_transition(self.namespace, name)

    # -- parts ----------------------------------------------------------------------------------
    def _membership(self, spec: PolicySpec, token: str) -> PodMembership:
        """The receivers of this policy, kept while this operator coordinates it (it remembers
        which node incarnations it prewarmed)."""
        assert self.session is not None

        async def metas() -> list[TensorMetaModel]:
            manifest = await self._producer_clients[0].baseline_manifest()
            return list(manifest.tensors)

        async def joined(node: str, how: str) -> None:
            metrics.RESTORES.labels(**self.labels).inc()
            if self._recorder is not None:
                await self._recorder.restored_node(node, how)

        def pods() -> list[PodView]:
            assert self.spec is not None
            return list(discover(self.pods(), self.spec).rollouts)

        return PodMembership(
            pods,
            self.session,
            token=token,
            checkpoint_template=spec.restore.checkpoint_template,
            metas=metas,
            on_join=joined,
            probe_timeout_s=min(3.0, float(spec.control_timeout_seconds)),
        )

    async def _producers(
        self, found: Discovered, spec: PolicySpec, token: str, record: CommitRecord
    ) -> list[HttpProducerClient] | None:
        """Clients of every expected producer in index order; None until all answer (the
        reason goes to the Ready condition).

        A producer without a baseline (a restarted sidecar) is told the committed record, so
        the trainer's first export after its restart is checked against the right version."""
        self._producer_error = ""
        self._candidates = {}
        clients = await self._probe_producers(found, spec, token, record)
        if clients is None:
            return None
        if sorted(clients) != list(range(spec.producers)):
            self._producer_error = (
                f"trainer sidecars report producer indices {sorted(clients)}; spec.producers "
                f"is {spec.producers}, so indices 0..{spec.producers - 1} are expected"
            )
            return None
        return [clients[i] for i in range(spec.producers)]

    async def _probe_producers(
        self, found: Discovered, spec: PolicySpec, token: str, record: CommitRecord
    ) -> dict[int, HttpProducerClient] | None:
        assert self.session is not None
        timeout = min(5.0, float(spec.control_timeout_seconds))
        clients: dict[int, HttpProducerClient] = {}
        statuses: dict[str, ProducerStatus] = {}
        for pod in found.ready_trainers:
            probe = HttpProducerClient(0, pod.url, token=token, session=self.session)
            try:
                status = await asyncio.wait_for(probe.status(), timeout)
            except (EndpointError, TimeoutError) as exc:
                why = str(exc) or f"no answer within {timeout:g}s"
                self._producer_error = f"trainer pod {pod.name}: {why}"
                return None
            self._fixed_settings.saw(pod, status)
            if status.producers is not None and status.producers != spec.producers:
                self._producer_error = (
                    f"trainer pod {pod.name} splits the checkpoint among {status.producers} "
                    f"producers, spec.producers is {spec.producers}: recreate the trainer pods "
                    "(injection writes the policy's count into their sidecars)"
                )
                return None
            if status.producer in clients:
                self._producer_error = (
                    f"trainer pod {pod.name} reports producer index {status.producer}, "
                    "which another trainer pod reports too"
                )
                return None
            statuses[f"trainer pod {pod.name}"] = status
            split = chunking_disagreement(statuses)
            if split is not None:
                self._producer_error = split
                return None
            client = HttpProducerClient(status.producer, pod.url, token=token, session=self.session)
            clients[status.producer] = client
            self._candidates[status.producer] = status.candidate_version
            held = CommitRecord(status.committed_version, status.committed_baseline)
            if not status.baseline_ready and held != record:
                try:
                    await asyncio.wait_for(client.learn_committed(record), timeout)
                except (EndpointError, TimeoutError) as exc:
                    self._producer_error = (
                        f"trainer pod {pod.name} refused v{record.version}: {exc}"
                    )
                    return None
                log.info("producer.told_committed", pod=pod.name, version=record.version)
        return clients

    async def _report_fixed_settings(self, found: Discovered, spec: PolicySpec) -> None:
        """A Warning Event on each pod holding settings, fixed when it was created, that its
        policy no longer has (`pod_settings`); the SettingsApplied condition lists them."""
        for view, message in self._fixed_settings.check([*found.trainers, *found.rollouts], spec):
            log.warning("pod.restart_required", pod=view.name, policy=self.name, why=message)
            ref = {"apiVersion": "v1", "kind": "Pod", "name": view.name, "uid": view.uid}
            try:
                await self.api.post_event(
                    {**ref, "namespace": view.namespace}, RESTART_REQUIRED, message, warning=True
                )
            except Exception as exc:  # the condition still says it; the next change retries
                log.warning("pod.event_failed", pod=view.name, error=str(exc)[:300])

    async def _read_token(self, spec: PolicySpec) -> str | None:
        """The token to send now. The Secret is re-read every TOKEN_REFRESH_S and followed by a
        `TokenRing`: after a rotation the previous token is sent for the grace period, so pods
        whose mounted copy is not updated yet keep accepting the operator's calls."""
        ref = (self.namespace, spec.token_secret.name, spec.token_secret.key)
        now = asyncio.get_running_loop().time()
        ring = self._token[1] if self._token is not None and self._token[0] == ref else None
        if ring is not None and now - self._token_at < TOKEN_REFRESH_S:
            return ring.sending()
        try:
            value = await self.api.read_secret_key(*ref)
        except NotFoundError:
            self._token_error = (
                "TokenSecretMissing",
                f"Secret {ref[0]}/{ref[1]} (spec.tokenSecret) does not exist",
            )
            return None
        except SecretRefusedError as exc:
            self._token_error = ("TokenSecretRefused", f"spec.tokenSecret: {exc}")
            return None
        try:
            if ring is None:
                ring = TokenRing(value, grace_s=float(spec.token_rotation_grace_seconds))
            else:
                ring.update(value)
        except ValueError:
            self._token_error = ("TokenSecretRefused", f"spec.tokenSecret: {ref[1]} is empty")
            return None
        self._token, self._token_at, self._token_error = (ref, ring), now, None
        return ring.sending()

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
        return await self._record_state(fresh=True)

    async def _record_state(self, *, fresh: bool = False) -> StoreState:
        """The commit record, read at most every RECORD_REFRESH_S unless `fresh`."""
        now = asyncio.get_running_loop().time()
        if fresh or self._state is None or now - self._state_at > RECORD_REFRESH_S:
            self._state, self._state_at = await self.store.read(), now
        return self._state

    def _observed(self, spec: PolicySpec, found: Discovered, state: StoreState) -> Observed:
        name, outcome, message = self._last
        return Observed(
            generation=self._generation,
            token_error=self._token_error,
            paused=spec.paused,
            committed_version=state.record.version,
            aborted_by=state.aborted_by,
            producers_expected=spec.producers,
            trainers=len(found.trainers),
            trainers_ready=len(found.ready_trainers),
            rollouts=len(found.rollouts),
            rollouts_ready=len(found.ready_rollouts),
            current=self._current,
            current_summary=self._current_summary,
            last=name,
            last_outcome=outcome,
            last_message=message,
            error=self._error,
            producers_error=self._producer_error,
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

    async def _sleep(self, seconds: float) -> None:
        deadline = asyncio.get_running_loop().time() + seconds
        while not self.stopped():
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return
            await asyncio.sleep(min(left, 0.2))


class _NullSink:
    """Progress of `recover()` (no transition object of its own)."""

    async def update(self, progress: Any) -> None:
        return None


async def _aggregate(membership: PodMembership) -> dict[str, int]:
    """Staged and applied payloads summed over the attempt's receivers."""
    clients = [membership.client(n) for n in membership.nodes]
    answers = await asyncio.gather(
        *(asyncio.wait_for(c.status(), 2.0) for c in clients), return_exceptions=True
    )
    ok = [a for a in answers if not isinstance(a, BaseException)]
    return {
        "staged": sum(a.staged for a in ok),
        "applied": sum(a.applied for a in ok),
        "nodes": len(ok),
    }
