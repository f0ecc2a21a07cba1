"""`kuberefit verify`: ask receivers to prove they hold exactly what a dense load of the
committed checkpoint would write (the audit of `POST /v1/audit`; nothing is written).

Each node runs its runtime's own loader over the checkpoint in compare mode and answers per rank
(tensors and elements compared, mismatches with positions and bit patterns). A node that does
not hold the version asked for says so (`version_moved`) and is not compared; a node with a
mismatch stops serving and is restored densely by the coordinator before the next version.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from refit_operator.receiver_client import ReceiverHttpClient
from refit_protocol.errors import EndpointError
from refit_protocol.kit.tokens import TokenRing
from refit_protocol.receiver_api import AuditRequest, AuditResponse

#: Exit codes of `kuberefit verify`.
EXIT_OK, EXIT_MISMATCH, EXIT_INCOMPLETE = 0, 1, 3


@dataclass
class NodeAudit:
    url: str
    answer: AuditResponse | None = None
    error: str = ""


async def verify_nodes(
    urls: Sequence[str],
    checkpoint: str,
    version: int,
    *,
    token: str | TokenRing | None,
    timeout_s: float = 3600.0,
) -> list[NodeAudit]:
    """Audit every node at once; an unreachable node or a refused audit is reported, not raised."""
    req = AuditRequest(checkpoint=checkpoint, version=version)
    async with aiohttp.ClientSession() as session:

        async def one(url: str) -> NodeAudit:
            client = ReceiverHttpClient(url, url, token=token, session=session, timeout_s=timeout_s)
            try:
                return NodeAudit(url, await client.audit(req))
            except EndpointError as exc:
                return NodeAudit(url, error=str(exc))
            except (TimeoutError, aiohttp.ClientError) as exc:  # e.g. the total timeout
                return NodeAudit(url, error=f"{type(exc).__name__}: {exc}".rstrip(": "))

        return list(await asyncio.gather(*(one(u) for u in urls)))


def exit_code(results: Sequence[NodeAudit]) -> int:
    """1 when a node holds other bits; 3 when a node could not be compared (or there was no
    node to compare, or only hosts whose leader was not audited); else 0."""
    if any(
        r.answer is not None and not r.answer.ok and not r.answer.version_moved for r in results
    ):
        return EXIT_MISMATCH
    if not results or any(r.answer is None or r.answer.version_moved for r in results):
        return EXIT_INCOMPLETE
    if all(r.answer is not None and r.answer.audited_by_leader for r in results):
        return EXIT_INCOMPLETE  # only a server's other hosts: their leader compared nothing yet
    return EXIT_OK


def render(results: Sequence[NodeAudit]) -> list[str]:
    """One line per node, then one per mismatching tensor (what a person reads)."""
    lines = [] if results else ["no rollout node to audit"]
    for r in results:
        a = r.answer
        if a is None:
            lines.append(f"{r.url}: not audited: {r.error}")
            continue
        if a.version_moved:
            lines.append(f"{a.node}: holds v{a.held_version}, not v{a.version}: not compared")
            continue
        if a.audited_by_leader:
            lines.append(f"{a.node}: a server's other host: its ranks are in its leader's audit")
            continue
        tensors = sum(x.tensors for x in a.ranks)
        elements = sum(x.elements for x in a.ranks)
        verdict = "OK" if a.ok else "MISMATCH"
        lines.append(
            f"{a.node}: {verdict} v{a.version}: {len(a.ranks)} rank(s), {tensors} tensors, "
            f"{elements} elements compared in {a.seconds:.1f}s"
        )
        for rank in a.ranks:
            for m in rank.mismatches:
                where = f"rank {rank.rank}" + (f" on {rank.host}" if rank.host else "")
                lines.append(
                    f"  {where} {m.name} -> {','.join(m.storages)}: {m.count} element(s)"
                    f" differ, first at {m.positions[:3]} (holds {m.held_bits[:3]}, "
                    f"dense load writes {m.expected_bits[:3]})"
                )
    return lines
