"""The coordinator's Membership port over discovered pods (the operator's receivers).

The rollout pods of a policy are its receivers; each is reached at its pod IP and the sidecar's
named ports. A receiver is confirmed dead when its pod is gone or being deleted, when the pod's
UID or the sidecar's restart count differs from what this attempt started with (the process
that held the attempt's state was replaced), or when its control port refuses connections.

Joining receivers are brought to the committed version before they take part: a node that holds
it and only lacks its prewarm is prewarmed (the canonical metadata comes from a producer's
baseline manifest: the operator never reads checkpoints); any other node is restored densely
from `spec.restore.checkpointTemplate`, a path the rollout pods can read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import aiohttp
import structlog

from refit_operator.discovery import PodView
from refit_operator.http_membership import HttpMembership, NodeEndpoint
from refit_operator.ports import ReceiverClient
from refit_protocol.commit import CommitRecord
from refit_protocol.errors import PeerAuthenticationError
from refit_protocol.receiver_api import PrewarmRequest
from refit_protocol.tensors import TensorMetaModel

log = structlog.get_logger("kuberefit.pod_membership")

#: Called after a joining node was brought to the committed version: (node, what was done).
OnJoin = Callable[[str, str], Awaitable[None]]


class NoRestoreSourceError(RuntimeError):
    """A node needs a dense restore but the policy names no checkpoint to restore from."""


class PodMembership(HttpMembership):
    """Membership of a policy's running rollout pods (see the module docstring)."""

    def __init__(
        self,
        pods: Callable[[], Sequence[PodView]],
        session: aiohttp.ClientSession,
        *,
        token: str | None,
        checkpoint_template: str,
        metas: Callable[[], Awaitable[list[TensorMetaModel]]],
        on_join: OnJoin | None = None,
        probe_timeout_s: float = 3.0,
    ) -> None:
        super().__init__(
            [],
            session,
            token=token,
            checkpoint_of=lambda v: self.checkpoint_template.format(version=v),
            probe_timeout_s=probe_timeout_s,
        )
        self.pods = pods
        self.checkpoint_template = checkpoint_template
        self.strict_auth = False  # a pod with another token stays out; the others go on
        self._metas_source = metas
        self.on_join = on_join
        self._incarnation: dict[str, tuple[str, int]] = {}
        self._prewarmed: set[tuple[str, str, int]] = set()

    def configure(self, *, token: str, checkpoint_template: str, probe_timeout_s: float) -> None:
        """Follow the policy's current token and spec (before each transition)."""
        self.token = token
        self.checkpoint_template = checkpoint_template
        self.probe_timeout_s = probe_timeout_s

    async def totals(self) -> dict[str, int]:
        """Staged and applied payloads summed over the attempt's receivers (those answering
        within 2 s; a multi-host server counted once): a RefitTransition's progress."""
        answers = await asyncio.gather(
            *(asyncio.wait_for(self.client(n).status(), 2.0) for n in self.nodes),
            return_exceptions=True,
        )
        ok = [a for a in answers if not isinstance(a, BaseException)]
        # A multi-host server's other hosts stage the leader's payloads again: count the
        # leader's (it applies through every rank).
        counted = [a for a in ok if a.server_role != "host"]
        return {
            "staged": sum(a.staged for a in counted),
            "applied": sum(a.applied for a in counted),
            "nodes": len(ok),
        }

    def servers_of(self, nodes: Sequence[str]) -> dict[str, list[str]]:
        """The vLLM servers spanning several of `nodes` (pods injection labelled with one
        server), each with its pods: a RefitTransition's `receivers.servers`."""
        server = {p.name: p.server for p in self.pods()}
        grouped: dict[str, list[str]] = {}
        for node in sorted(nodes):
            grouped.setdefault(server.get(node, node), []).append(node)
        return {name: pods for name, pods in grouped.items() if len(pods) > 1}

    def refresh(self) -> list[PodView]:
        """Take the running pods as the node list; returns them."""
        running = [p for p in self.pods() if p.running]
        self.nodes = {
            p.name: NodeEndpoint(p.name, p.url, p.relay_endpoint, p.relay_mac_endpoint)
            for p in running
        }
        return running

    async def receivers(self) -> list[ReceiverClient]:
        running = {p.name: p for p in self.refresh()}
        members = await super().receivers()
        self._incarnation = {r.node: running[r.node].incarnation for r in members}
        return members

    async def confirmed_dead(self, node: str) -> bool:
        pod = next((p for p in self.pods() if p.name == node), None)
        if pod is None or pod.deleting:
            return True
        seen = self._incarnation.get(node)
        if seen is not None and pod.incarnation != seen:
            return True
        return await super().confirmed_dead(node)

    async def host_gone(self, node: str) -> bool:
        """The pod is deleted, being deleted, or another pod of the same name (a new UID)."""
        pod = next((p for p in self.pods() if p.name == node), None)
        seen = self._incarnation.get(node)
        return pod is None or pod.deleting or (seen is not None and pod.uid != seen[0])

    async def restore(self, receiver: ReceiverClient, record: CommitRecord) -> None:
        status = await self.client(receiver.node).status()
        if status.held_version == record.version and not status.dirty:
            await self._prewarm_node(receiver.node, record.version)
            return
        if not self.checkpoint_template:
            raise NoRestoreSourceError(
                f"{receiver.node} holds v{status.held_version}, not the committed "
                f"v{record.version}, and spec.restore.checkpointTemplate is not set"
            )
        await super().restore(receiver, record)  # the node prewarms after loading
        self._mark_prewarmed(receiver.node)
        if self.on_join is not None:
            await self.on_join(
                receiver.node,
                f"restored densely to v{record.version} from {self.checkpoint_of(record.version)}",
            )

    async def prewarm_holders(self, version: int) -> None:
        """Learn the loaders' classification (XOR-incompatible names) of every running node
        that holds `version`, once per node incarnation: a node that was prewarmed answers
        from its cache (its runtime is not asked again: it may be busy serving), any other is
        prewarmed now."""
        for pod in self.refresh():
            if (pod.name, *pod.incarnation) in self._prewarmed:
                continue
            try:
                status = await asyncio.wait_for(
                    self.client(pod.name).status(), self.probe_timeout_s
                )
            except PeerAuthenticationError as exc:
                # Not absent: its mounted Secret holds another token (mid-rotation, or a wrong
                # tokenSecret); say so loudly, it never joins until the tokens agree.
                log.warning("receiver.refused_token", node=pod.name, error=str(exc))
                continue
            except Exception as exc:
                log.info("receiver.absent", node=pod.name, error=str(exc) or type(exc).__name__)
                continue
            if status.held_version != version or status.dirty:
                continue  # it joins through `restore` when a transition starts
            cached = await self.client(pod.name).prewarmed() if status.prewarmed else None
            if cached is not None:
                self._classify(pod.name, cached.xor_incompatible, cached.unsupported)
                self._mark_prewarmed(pod.name)
            else:
                await self._prewarm_node(pod.name, version)

    async def _prewarm_node(self, node: str, version: int) -> None:
        answer = await self.client(node).prewarm(PrewarmRequest(metas=await self.metas(version)))
        self._classify(node, answer.xor_incompatible, answer.unsupported)
        self._mark_prewarmed(node)

    def _mark_prewarmed(self, node: str) -> None:
        pod = next((p for p in self.pods() if p.name == node), None)
        if pod is not None:
            self._prewarmed.add((node, *pod.incarnation))

    async def metas(self, version: int) -> list[TensorMetaModel]:
        if version not in self._metas:
            self._metas[version] = await self._metas_source()
        return self._metas[version]
