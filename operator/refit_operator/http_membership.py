"""The coordinator's Membership port over the receivers' HTTP control planes.

Used by the coordinator process (`kuberefit coordinator serve`) when the nodes are separate
processes.
A node takes part while its control plane answers. It is confirmed dead when its control port
refuses connections: nothing listens there any more, so the process that held the attempt's
state is gone and none of its pending writes can resume (the paper's condition for retiring a
receiver). A timeout is not a confirmation: a slow node may still write.

Joining receivers (new, restarted, or holding no known version) are restored from the committed
version's checkpoint: the node loads that directory through its runtime's own loader, prewarms
and then holds the version (`RestoreRequest`; docs/coordinator.md, "Joining receivers").
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
import structlog

from refit_operator.checkpoint_meta import read_metas
from refit_operator.ports import ReceiverClient
from refit_operator.receiver_client import ReceiverHttpClient
from refit_protocol.commit import CommitRecord
from refit_protocol.errors import EndpointError, PeerAuthenticationError
from refit_protocol.kit.tokens import TokenRing
from refit_protocol.receiver_api import PrewarmRequest, RestoreRequest
from refit_protocol.tensors import TensorMetaModel

log = structlog.get_logger("kuberefit.membership")


@dataclass(frozen=True)
class NodeEndpoint:
    """One rollout node: its name, receiver control-plane URL and relay-tree endpoints (the
    CurveZMQ one, and the MAC-only one for the other relays of its cluster)."""

    name: str
    url: str
    relay_endpoint: str = ""
    relay_mac_endpoint: str = ""


class HttpMembership:
    """Membership from a static node list; liveness and restores through each node's HTTP API."""

    def __init__(
        self,
        nodes: Sequence[NodeEndpoint],
        session: aiohttp.ClientSession,
        *,
        token: str | TokenRing | None,
        checkpoint_of: Callable[[int], str],
        probe_timeout_s: float = 3.0,
    ) -> None:
        self.nodes = {n.name: n for n in nodes}
        self.session = session
        self.token = token
        self.checkpoint_of = checkpoint_of
        self.probe_timeout_s = probe_timeout_s
        self.incompatible: set[str] = set()
        #: A node refusing the token stops a static deployment (`kuberefit coordinator serve`: a
        #: configuration error); in a cluster (`PodMembership`) only that node stays out.
        self.strict_auth = True
        self._metas: dict[int, list[TensorMetaModel]] = {}

    def client(self, node: str) -> ReceiverHttpClient:
        n = self.nodes[node]
        return ReceiverHttpClient(n.name, n.url, token=self.token, session=self.session)

    async def receivers(self) -> list[ReceiverClient]:
        probes = await asyncio.gather(*(self._answers(n) for n in self.nodes))
        return [self.client(n) for n, ok in zip(self.nodes, probes, strict=True) if ok]

    async def confirmed_dead(self, node: str) -> bool:
        try:
            await asyncio.wait_for(self.client(node).status(), self.probe_timeout_s)
        except EndpointError as exc:
            return _refused(exc.__cause__)
        except Exception:  # anything else (a timeout) leaves the node's state unknown
            return False
        return False

    async def host_gone(self, node: str) -> bool:
        """Unknown for a static node list: a host that never answers again stays out."""
        return False

    async def restore(self, receiver: ReceiverClient, record: CommitRecord) -> None:
        source = self.checkpoint_of(record.version)
        metas = await self.metas(record.version)
        answer = await self.client(receiver.node).restore(
            RestoreRequest(version=record.version, source=source, metas=metas)
        )
        self._classify(receiver.node, answer.xor_incompatible, answer.unsupported)
        log.info("receiver.restored", node=receiver.node, version=record.version, source=source)

    async def prewarm(self, version: int) -> None:
        """Prewarm every answering node with the canonical metadata of `version`."""
        metas = await self.metas(version)
        for r in await self.receivers():
            answer = await self.client(r.node).prewarm(PrewarmRequest(metas=metas))
            self._classify(r.node, answer.xor_incompatible, answer.unsupported)

    async def relay_tree(self, nodes: Sequence[str]) -> list[str]:
        return [self.nodes[n].relay_endpoint for n in nodes if self.nodes[n].relay_endpoint]

    async def relay_mac_tree(self, nodes: Sequence[str]) -> list[str]:
        tree = [self.nodes[n] for n in nodes if self.nodes[n].relay_endpoint]
        macs = [n.relay_mac_endpoint for n in tree]
        return macs if any(macs) else []

    async def metas(self, version: int) -> list[TensorMetaModel]:
        if version not in self._metas:
            self._metas[version] = await asyncio.to_thread(read_metas, self.checkpoint_of(version))
        return self._metas[version]

    def _classify(self, node: str, incompatible: set[str], unsupported: dict[str, str]) -> None:
        if unsupported:  # fail closed: this node cannot apply some tensors exactly
            raise RuntimeError(f"{node}: unsupported loaders {sorted(unsupported)}")
        self.incompatible |= incompatible

    async def _answers(self, node: str) -> bool:
        try:
            await asyncio.wait_for(self.client(node).status(), self.probe_timeout_s)
        except PeerAuthenticationError as exc:
            if self.strict_auth:
                raise  # not absent: configured with another token; waiting cannot help
            log.warning("receiver.refused_token", node=node, error=str(exc))
            return False
        except Exception as exc:
            log.info("receiver.absent", node=node, error=str(exc) or type(exc).__name__)
            return False
        return True


def _refused(cause: BaseException | None) -> bool:
    """A refused TCP connection (nothing listens), as opposed to a timeout or an HTTP error."""
    if not isinstance(cause, aiohttp.ClientConnectorError):
        return False
    return cause.os_error is not None and cause.os_error.errno == errno.ECONNREFUSED
