"""The applier interface: what writes a validated payload into the serving weights (❻).

The receiver owns validation, dedup, order and backpressure (❺); an applier only prewarms,
turns a decoded payload into what it applies (`stage`), applies a group of staged payloads in
the order given, and synchronizes the device. Implementations, one per module, are chosen by
`ApplierConfig.kind` through the registry in `appliers/__init__.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from refit_protocol.receiver_api import RankPrewarm
from refit_sidecar.codec.records import Item, TensorMeta
from refit_sidecar.codec.wire import DecodedPayload, PayloadHeader


@dataclass
class StagedPayload:
    """A validated payload ready to apply: decoded items (in process) or a decoded payload file
    (vLLM: `refit_sidecar.codec.decoded_file`)."""

    header: PayloadHeader
    nbytes: int  # host bytes held for it (decoded or staged), for accounting
    items: list[Item] | None = None
    path: Path | None = None


@dataclass
class ApplyReport:
    payloads: int = 0
    items: int = 0
    values: int = 0
    checks: int = 0
    seconds: float = 0.0
    per_rank: list[dict[str, Any]] = field(default_factory=list)


class Applier(Protocol):
    """How a node writes weights. Calls come from one apply thread, never concurrently."""

    def prewarm(self, metas: Mapping[str, TensorMeta]) -> list[RankPrewarm]:
        """Reserve scratch and classify every canonical name, per rank."""
        ...

    def stage(self, decoded: DecodedPayload) -> StagedPayload:
        """Hold a decoded payload until its turn (called from staging threads)."""
        ...

    def apply(self, batch: Sequence[StagedPayload], check_samples: int) -> ApplyReport:
        """Apply the payloads in the given (declared) order; raise to fail the attempt."""
        ...

    def discard(self, staged: StagedPayload) -> None:
        """Drop a staged payload that will not be applied (obsolete/stopped attempt)."""
        ...

    def sync(self) -> None:
        """Block until every write is visible on the device (flush's completion ACK)."""
        ...

    def gate(self, closed: bool) -> None:
        """Close (hold new requests, wait for in-flight ones) or reopen the request gate."""
        ...

    def restore(self, source: str) -> set[str] | None:
        """Dense load of every tensor of a safetensors checkpoint directory (joining node);
        returns the canonical names loaded (on every rank), or None where this node loads
        nothing itself (another host of a multi-host server: its leader's restore loads it)."""
        ...

    def audit(self, source: str) -> list[dict[str, Any]]:
        """Compare every rank's weights with a dense load of the checkpoint directory `source`,
        writing nothing; one `apply.audit.AuditReport.to_json()` (plus "rank") per rank."""
        ...

    def close(self) -> None: ...
