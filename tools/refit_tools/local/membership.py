"""The coordinator's Membership port for local nodes: liveness from the processes themselves,
dense restore from the committed version's checkpoint directory."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import aiohttp

from refit_operator.ports import ReceiverClient
from refit_operator.receiver_client import ReceiverHttpClient
from refit_protocol.commit import CommitRecord
from refit_protocol.receiver_api import PrewarmRequest, RestoreRequest
from refit_protocol.tensors import TensorMetaModel
from refit_tools.local.nodes import LocalNode


class LocalMembership:
    """Receivers are the nodes whose two processes run; a dead node is confirmed dead at once
    (its processes are gone, so no pending write can resume)."""

    def __init__(
        self,
        nodes: Sequence[LocalNode],
        session: aiohttp.ClientSession,
        metas: list[TensorMetaModel],
        checkpoint_of: Callable[[int], Path],
        *,
        relay: bool = True,
    ) -> None:
        self.nodes = {n.name: n for n in nodes}
        self.relay = relay
        self.session = session
        self.metas = metas
        self.checkpoint_of = checkpoint_of
        self.incompatible: set[str] = set()

    def client(self, node: LocalNode) -> ReceiverHttpClient:
        return ReceiverHttpClient(node.name, node.url, token=node.token, session=self.session)

    async def receivers(self) -> list[ReceiverClient]:
        return [self.client(n) for n in self.nodes.values() if n.alive()]

    async def confirmed_dead(self, node: str) -> bool:
        return not self.nodes[node].alive()

    async def host_gone(self, node: str) -> bool:
        """A local node's host is this machine; a node that never answers again stays out."""
        return False

    async def prewarm(self, node: LocalNode) -> set[str]:
        """Classify the node's loaders; returns its XOR-incompatible names (fails closed)."""
        answer = await self.client(node).prewarm(PrewarmRequest(metas=self.metas))
        if answer.unsupported:
            raise RuntimeError(f"{node.name}: unsupported loaders {answer.unsupported}")
        self.incompatible |= answer.xor_incompatible
        return answer.xor_incompatible

    async def restore(self, receiver: ReceiverClient, record: CommitRecord) -> None:
        """The receiver loads the committed checkpoint through vLLM's loader and prewarms
        (`POST /v1/restore`, the same path as the coordinator process's HttpMembership)."""
        node = self.nodes[receiver.node]
        req = RestoreRequest(
            version=record.version, source=str(self.checkpoint_of(record.version)), metas=self.metas
        )
        answer = await self.client(node).restore(req)
        if answer.unsupported:
            raise RuntimeError(f"{node.name}: unsupported loaders {answer.unsupported}")
        self.incompatible |= answer.xor_incompatible

    async def relay_tree(self, nodes: Sequence[str]) -> list[str]:
        return [self.nodes[n].relay_endpoint for n in nodes] if self.relay else []

    async def relay_mac_tree(self, nodes: Sequence[str]) -> list[str]:
        macs = [self.nodes[n].relay_mac_endpoint for n in nodes] if self.relay else []
        return macs if any(macs) else []
