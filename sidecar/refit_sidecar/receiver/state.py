"""Per-attempt bookkeeping of a receiver: dedup table, declared order, quotas (no I/O; it only
records which threads work on an attempt, never starts one).

Declared order: every producer numbers its payloads' `order` 0, 1, 2, ...; the attempt's single
application order is (order, producer) ascending, the same on every node whatever the arrival
order. A producer's stream is complete once its total is known (its stream-end mark, or the
expected counts of relay-flush / flush).

Quotas: each producer may hold `quota` payloads on this node (registered and not yet released,
i.e. applied locally and acknowledged by every child). A payload beyond that is answered WAIT,
except the producer's lowest unreleased order, which always passes. That reserved slot is what
keeps the apply queue and every relay hop from deadlocking when arrivals are out of order.
"""

from __future__ import annotations

import collections
import enum
import threading
from dataclasses import dataclass, field

from refit_protocol.compat import StrEnum
from refit_protocol.receiver_api import PrepareRequest
from refit_sidecar.receiver.appliers.base import StagedPayload
from refit_sidecar.transport.inbound import PayloadIdent


class Phase(StrEnum):
    IDLE = "idle"
    PREPARED = "prepared"
    STREAMING = "streaming"
    APPLYING = "applying"
    FLUSHED = "flushed"
    FAILED = "failed"
    STOPPED = "stopped"


#: Phases in which an attempt may still stage or apply payloads.
ACTIVE = frozenset({Phase.PREPARED, Phase.STREAMING, Phase.APPLYING})


class EntryState(enum.Enum):
    REGISTERED = "registered"  # admitted; being downloaded / validated
    STAGED = "staged"  # compressed bytes held (async RL)
    READY = "ready"  # validated and staged for the applier, in the queue
    APPLYING = "applying"
    APPLIED = "applied"
    DROPPED = "dropped"


@dataclass(eq=False)
class Entry:
    ident: PayloadIdent
    refs: int  # local staging + child forwards still to finish
    state: EntryState = EntryState.REGISTERED
    local_released: bool = False
    body: bytes | memoryview | None = None  # compressed bytes (async staging)
    keep: object = None  # keeps a zero-copy receive buffer alive
    staged: StagedPayload | None = None


OrderKey = tuple[int, int]  # (order, producer)


class AttemptState:
    """Everything a node knows about one attempt."""

    def __init__(self, req: PrepareRequest, *, quota: int, check_samples: int) -> None:
        self.request = req
        self.attempt = req.attempt
        self.sync = req.sync
        self.producers: tuple[int, ...] = tuple(sorted(set(req.producers)))
        self.quota = quota
        self.check_samples = check_samples
        self.phase = Phase.PREPARED
        self.opened = False
        self.stopping = False
        self.failed = False
        self.flushed_ok = False
        self.wrote = False
        self.errors: list[str] = []
        self.entries: dict[tuple[int, int], Entry] = {}
        self.by_order: dict[tuple[int, int], int] = {}  # (producer, order) -> payload_id
        self.totals: dict[int, int] = {}
        self.registered: collections.Counter[int] = collections.Counter()
        self.held: collections.Counter[int] = collections.Counter()
        self._released: dict[int, set[int]] = {p: set() for p in self.producers}
        self.low: dict[int, int] = dict.fromkeys(self.producers, 0)
        self.apply_cursor: dict[int, int] = dict.fromkeys(self.producers, 0)
        self.decode_cursor: dict[int, int] = dict.fromkeys(self.producers, 0)
        self.ready: dict[OrderKey, Entry] = {}
        self.pending_local = 0
        self.decoding = 0
        self.applying = 0
        self.compressed_bytes = 0
        self.applied = 0
        self.checks = 0
        self.timings: dict[str, float] = collections.defaultdict(float)
        self.threads: list[threading.Thread] = []

    # -- declared order ------------------------------------------------------------------------
    def next_key(self, cursor: dict[int, int]) -> OrderKey | None:
        """The next (order, producer) after `cursor`; None once every stream is complete."""
        best: OrderKey | None = None
        for p in self.producers:
            c = cursor[p]
            total = self.totals.get(p)
            if total is not None and c >= total:
                continue
            if best is None or (c, p) < best:
                best = (c, p)
        return best

    def all_applied(self) -> bool:
        """Every declared payload taken by the apply thread and its last group finished."""
        return self.next_key(self.apply_cursor) is None and self.applying == 0

    def entry_at(self, key: OrderKey) -> Entry | None:
        order, producer = key
        pid = self.by_order.get((producer, order))
        return None if pid is None else self.entries.get((producer, pid))

    def missing(self, limit: int = 8) -> list[str]:
        """Declared payloads not yet applied, for error messages."""
        out: list[str] = []
        for p in self.producers:
            total = self.totals.get(p)
            end = total if total is not None else self.apply_cursor[p] + 1
            for order in range(self.apply_cursor[p], end):
                e = self.entry_at((order, p))
                out.append(f"{p}:{order}({'absent' if e is None else e.state.value})")
                if len(out) >= limit:
                    return out
        return out

    # -- admission and accounting ---------------------------------------------------------------
    def admissible(self, ident: PayloadIdent) -> bool:
        p = ident.producer
        return ident.order == self.low[p] or self.held[p] < self.quota

    def register(self, ident: PayloadIdent, children: int) -> Entry:
        entry = Entry(ident, refs=1 + children)
        self.entries[(ident.producer, ident.payload_id)] = entry
        self.by_order[(ident.producer, ident.order)] = ident.payload_id
        self.registered[ident.producer] += 1
        self.held[ident.producer] += 1
        self.pending_local += 1
        if self.phase is Phase.PREPARED:
            self.phase = Phase.STREAMING
        return entry

    def release(self, entry: Entry) -> None:
        """One reference (local staging/apply or a child forward) finished."""
        entry.refs -= 1
        if entry.refs == 0:
            p = entry.ident.producer
            self.held[p] -= 1
            released = self._released[p]
            released.add(entry.ident.order)
            while self.low[p] in released:
                released.discard(self.low[p])
                self.low[p] += 1

    def release_local(self, entry: Entry) -> None:
        if not entry.local_released:
            entry.local_released = True
            self.release(entry)

    def set_total(self, producer: int, total: int) -> str | None:
        """Record a producer's total; an error message if it contradicts what is known."""
        if producer not in self.producers:
            return f"producer {producer} is not part of attempt {self.attempt}"
        known = self.totals.get(producer)
        if known is not None and known != total:
            return f"producer {producer}: total {total} contradicts earlier total {known}"
        if self.registered[producer] > total:
            return (
                f"producer {producer}: {self.registered[producer]} payloads arrived, total {total}"
            )
        beyond = [o for (p, o) in self.by_order if p == producer and o >= total]
        if beyond:
            return f"producer {producer}: order {min(beyond)} is beyond its total {total}"
        self.totals[producer] = total
        return None

    def set_totals(self, expected: dict[int, int]) -> list[str]:
        errors = []
        missing = set(self.producers) - set(expected)
        if missing:
            errors.append(f"no expected count for producers {sorted(missing)}")
        for p, n in sorted(expected.items()):
            err = self.set_total(p, n)
            if err:
                errors.append(err)
        return errors

    def count_errors(self) -> list[str]:
        """Registered counts that differ from known totals."""
        return [
            f"producer {p}: {self.registered[p]} of {t} payloads arrived"
            for p, t in sorted(self.totals.items())
            if self.registered[p] != t
        ]

    @property
    def staged_total(self) -> int:
        return sum(self.registered.values())

    def totals_known(self) -> bool:
        return all(p in self.totals for p in self.producers)


@dataclass
class ObsoleteSet:
    """Ids of replaced attempts (bounded: the oldest are forgotten first)."""

    limit: int = 4096
    _ids: collections.OrderedDict[str, None] = field(default_factory=collections.OrderedDict)

    def add(self, attempt: str) -> None:
        self._ids[attempt] = None
        while len(self._ids) > self.limit:
            self._ids.popitem(last=False)

    def __contains__(self, attempt: object) -> bool:
        return attempt in self._ids
