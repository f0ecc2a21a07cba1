"""This operator coordinating one policy: from taking its commit record (a newer epoch fences
any older coordinator) until it is fenced, loses the Lease or a transition fails
(`Coordinating`). The loop (`policy_runner.py`) decides when; this part runs one transition
and returns how it ended.

It owns the `Coordinator` and the policy's `PodMembership` (which remembers the node
incarnations it prewarmed) and hands the coordinator each transition's participants
(`Participants`): the producers that answered this pass, the membership, the RefitTransition
writer and the spec's settings.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiohttp
import structlog

from refit_operator import metrics
from refit_operator.commit_store.kube import KubernetesCommitStore
from refit_operator.coordinator import Coordinator, Participants
from refit_operator.discovery import PodView
from refit_operator.kube.api import KubeApi
from refit_operator.kube.lease import PolicyLease
from refit_operator.pod_membership import PodMembership
from refit_operator.policy_spec import PolicySpec
from refit_operator.ports import TransitionProgress
from refit_operator.producer_client import HttpProducerClient
from refit_operator.transition_types import TransitionResult
from refit_operator.transitions import TransitionRecorder
from refit_protocol.producer_api import StreamSettings
from refit_protocol.tensors import TensorMetaModel

log = structlog.get_logger("kuberefit.policy")


class Coordinating:
    """See the module docstring. `begin` takes the record, `close_recovered` ends what the
    previous coordinator left committed; `open` then `run` make each transition."""

    def __init__(
        self,
        api: KubeApi,
        lease: PolicyLease,
        store: KubernetesCommitStore,
        labels: Mapping[str, str],
        spec: PolicySpec,
        *,
        token: str,
        producers: Sequence[HttpProducerClient],
        rollouts: Callable[[], list[PodView]],
        session: aiohttp.ClientSession,
        identity: str,
        status_interval_s: float,
    ) -> None:
        self.api = api
        self.lease = lease
        self.store = store
        self.labels = dict(labels)  # namespace, policy
        self.status_interval_s = status_interval_s
        self.producers = list(producers)  # those of the last transition opened
        self.recorder: TransitionRecorder | None = None  # of the transition running now
        self.membership = PodMembership(
            rollouts,
            session,
            token=token,
            checkpoint_template=spec.restore.checkpoint_template,
            metas=self._metas,
            on_join=self._joined,
            probe_timeout_s=min(3.0, float(spec.control_timeout_seconds)),
        )
        self.coordinator = Coordinator(
            self.labels["policy"],
            store,
            self.producers,
            self.membership,
            _NullSink(),
            spec.coordinator_config(),
            name=identity,
        )

    async def begin(self) -> bool:
        """Acquire the commit record (a new epoch) and finish a transition whose commit took
        effect (`Coordinator.recover`); False if the Lease was lost just before."""
        if not await self.lease.acquire_or_renew():  # fresh, right before taking the record
            return False
        coordinator = self.coordinator
        await coordinator.start()
        recovered = await coordinator.recover()
        log.info(
            "policy.coordinating",
            policy=self.labels["policy"],
            epoch=coordinator.epoch,
            version=(await self.store.read()).record.version,
            recovered=recovered,
        )
        return True

    async def close_recovered(
        self, policy: Mapping[str, Any]
    ) -> tuple[TransitionResult, str] | None:
        """The RefitTransition of the committed version, if one is still open (its coordinator
        stopped after the commit): marked Committed with a `TakenOver` event. The result and
        its name, or None."""
        kv = (await self.store.read()).record
        if kv.version == 0:
            return None
        recorder = TransitionRecorder(
            self.api, dict(policy), kv.version - 1, kv.version, coordinator=self.coordinator.name
        )
        if not await recorder.open(create=False):
            return None
        result = TransitionResult("committed", kv.version, 0, message="recovered")
        metrics.TAKEOVERS.labels(**self.labels).inc()
        await recorder.finish(result, None)
        return result, recorder.name

    async def open(
        self,
        policy: Mapping[str, Any],
        spec: PolicySpec,
        token: str,
        producers: Sequence[HttpProducerClient],
        version: int,
    ) -> TransitionRecorder:
        """The RefitTransition of the transition from `version` (created, or continued after
        a takeover); the receivers learn the spec's settings and are prewarmed."""
        recorder = TransitionRecorder(
            self.api,
            dict(policy),
            version,
            version + 1,
            coordinator=self.coordinator.name,
            min_interval_s=self.status_interval_s,
        )
        self.membership.configure(
            token=token,
            checkpoint_template=spec.restore.checkpoint_template,
            probe_timeout_s=min(3.0, float(spec.control_timeout_seconds)),
        )
        self.producers = list(producers)
        recorder.poll = self.membership.totals
        await self.membership.prewarm_holders(version)
        if await recorder.open():
            metrics.TAKEOVERS.labels(**self.labels).inc()
        self.recorder = recorder
        return recorder

    async def run(
        self, recorder: TransitionRecorder, spec: PolicySpec, settings: StreamSettings | None
    ) -> TransitionResult:
        """Run the transition `open` began, while this operator holds the Lease; its
        RefitTransition ends as the transition did. Never raises but for cancellation."""
        parts = Participants(self.producers, self.membership, recorder, spec.coordinator_config())
        work = self.coordinator.run_transition(
            frozenset(self.membership.incompatible), settings, parts
        )
        try:
            result = await self._while_leader(work, recorder.from_version)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the API server or a bug: the next coordinator takes over
            log.exception("transition.error", policy=self.labels["policy"], error=str(exc))
            result = TransitionResult(
                "failed", recorder.from_version, 0, message=f"{type(exc).__name__}: {exc}"
            )
            result.reason = "OperatorError"
        finally:
            self.recorder = None
            await recorder.close()
        required = None if result.outcome == "failed" else result.receivers
        servers = self.membership.servers_of(required) if required else None
        await recorder.finish(result, required, servers)
        return result

    async def _while_leader(
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
                    log.warning("transition.lease_lost", policy=self.labels["policy"])
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    return TransitionResult(
                        "conflict", version, 0, message="lease lost", reason="LeaseLost"
                    )
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _metas(self) -> list[TensorMetaModel]:
        """The canonical tensors, as the first producer's baseline lists them."""
        return list((await self.producers[0].baseline_manifest()).tensors)

    async def _joined(self, node: str, how: str) -> None:
        metrics.RESTORES.labels(**self.labels).inc()
        if self.recorder is not None:
            await self.recorder.restored_node(node, how)


def log_done(policy: str, name: str, result: TransitionResult) -> None:
    """The one log line of a finished transition (RefitTransition `name`)."""
    log.info("transition.done", policy=policy, transition=name, **result.summary())


class _NullSink:
    """Progress of `recover()` (no transition object of its own)."""

    async def update(self, progress: TransitionProgress) -> None:
        return None
