"""vLLM servers that span several hosts, as the coordinator sees them.

Each host of such a server is a pod with its own receiver; the leader's receiver applies through
every rank, the others only stage payload files for their ranks (`ReceiverStatus.server_role`).
The ranks of a server cannot apply without every host, so its nodes take part in an attempt
together: a node that leaves takes the rest of its server with it. A host that is not the
leader holds no weights of its own, so when its receiver restarts it can rejoin between two
attempts of a transition instead of waiting for the next one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from refit_protocol.receiver_api import ReceiverStatus


@dataclass
class ServerGroups:
    """Which server each node belongs to, as its receiver last reported."""

    _of: dict[str, tuple[str, str]] = field(default_factory=dict)  # node -> (server, role)

    def note(self, node: str, status: ReceiverStatus) -> None:
        if status.server is None:
            self._of.pop(node, None)
        else:
            self._of[node] = (status.server, status.server_role or "leader")

    def server(self, node: str) -> str | None:
        entry = self._of.get(node)
        return entry[0] if entry else None

    def is_host(self, node: str) -> bool:
        """A server's host other than the leader (it holds no weights of its own)."""
        entry = self._of.get(node)
        return entry is not None and entry[1] == "host"

    def with_mates(self, nodes: Iterable[str], among: Iterable[str]) -> set[str]:
        """`nodes` plus every node of `among` that shares a server with one of them."""
        out = set(nodes)
        servers = {s for s in map(self.server, out) if s is not None}
        out.update(n for n in among if self.server(n) in servers)
        return out
