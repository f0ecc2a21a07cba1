"""❶–❷ with direct projection, as the publisher runs it: each rank compares the affine shards it
owns with its shard baseline, projects the changes to canonical positions, and routes them to
the rank that publishes the chunk they land in; residual tasks go through the bridge's export.

`ProjectedSource` is a `PlanningSource`: the publisher hands it what its sidecar expects (the
baseline's layout, chunk size, producers) and sends the chunks it yields. Each owned chunk holds
its residual tensors whole and every projected tensor as `Change`s (sorted positions, new
values), which the sidecar applies to a copy of its committed baseline before staging
(`producer.changes`): from there on, the delta, the payloads, the joint commit, the overwrite
retry and dense restore are what they are for the export path. Receivers cannot tell.

One publish is a fixed sequence of collectives on the default group, the same on every rank
(ranks without a sidecar run it through `Publisher.participate`):
1. `all_gather_object` of each rank's intent: which producer it publishes, the version, the
   committed version and (once) the baseline's layout. Every rank checks the same facts, so a
   refusal is raised everywhere alike instead of leaving ranks in a collective.
2. `initial`: the full export through `plan_owned`, one export of each flagged residual task
   alone (to learn its outputs), then each rank copies its owned shards and the flagged residual
   parameters it holds as the shard baseline. `next`: the projected changes, exchanged with
   `all_to_all_single`; the residual change flags, made global with one `all_reduce`; the
   residual export of the tasks that changed (`MegatronProjection.flagged_residuals` says which
   tasks a flag may skip: those whose outputs follow from their own parameter alone).
The shard baseline advances only with the commit: the changes of a staged version are kept
aside and folded in when a later publish finds that version committed; a version that did not
commit (a failed or dropped transition) is compared again from the same baseline.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog
import torch

from refit_protocol.producer_api import StagePurpose
from refit_sidecar.baseline.chunks import ExportChunk, owner_of, plan_chunks
from refit_sidecar.bitdiff import diff_bits
from refit_sidecar.bits import NP_INT_VIEW, bits_numpy
from refit_sidecar.codec import dtypes
from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.trainer.errors import CandidateMismatchError, StagingStateError
from refit_sidecar.trainer.export import (
    CanonicalSource,
    Change,
    PlannedChunk,
    StageIntent,
    checked_tensor,
    plan_owned,
)
from refit_sidecar.trainer.megatron import MegatronBridgeSource
from refit_sidecar.trainer.megatron_projection import Coverage, MegatronProjection

log = structlog.get_logger("kuberefit.projected")
Bits = npt.NDArray[Any]


@dataclass(frozen=True)
class _Agreed:
    """The facts of one publish every rank agrees on (from the producers' intents)."""

    version: int
    purpose: StagePurpose
    producers: int
    limit_bytes: int
    committed: int
    rank_of: dict[int, int]  # producer -> rank
    producer: int | None  # this rank's


@dataclass(frozen=True)
class _Cut:
    """The baseline's layout cut into chunks, with the lookups a publish needs; derived once
    per layout and chunk size, not on every publish."""

    metas: list[TensorMeta]
    limit_bytes: int
    plan: list[tuple[TensorMeta, ...]]
    number: dict[str, int]  # name -> position in `metas`
    chunk_of: dict[str, int]  # name -> chunk index

    @classmethod
    def of(cls, metas: list[TensorMeta], limit_bytes: int) -> _Cut:
        plan = plan_chunks(metas, limit_bytes)
        chunk_of = {m.name: i for i, chunk in enumerate(plan) for m in chunk}
        return cls(metas, limit_bytes, plan, {m.name: k for k, m in enumerate(metas)}, chunk_of)

    def describe(self, meta: TensorMeta) -> str | None:
        """None when the layout holds `meta` as it is, else how it holds it."""
        k = self.number.get(meta.name)
        if k is None:
            return "missing"
        theirs = self.metas[k]
        return None if theirs == meta else f"{list(theirs.shape)} {theirs.dtype}"


class ShardBaseline:
    """The committed bits of the shards a rank owns (flat integer views, by task index), and
    the changes of the version staged after them, folded in only once that version commits."""

    def __init__(self) -> None:
        self.bits: dict[int, Bits] | None = None
        self.version = -1
        self._pending: tuple[int, dict[int, tuple[Bits, Bits]]] | None = None

    def reset(self, version: int, bits: dict[int, Bits]) -> None:
        """The shards as of `version`, whose whole export was just published."""
        self.bits, self.version, self._pending = bits, version, None

    def stage(self, version: int, changes: dict[int, tuple[Bits, Bits]]) -> None:
        """Keep the changes of `version` (local positions, new bits per shard) aside."""
        self._pending = (version, changes)

    def settle(self, committed: int) -> dict[int, Bits]:
        """The bits as of `committed`: a staged version that committed is folded in, one that
        did not (a failed or dropped transition, about to be published again) is dropped."""
        if self.bits is None:
            raise StagingStateError(
                "no shard baseline: publish the first export (Publisher.initialize) through "
                "this source before new versions"
            )
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] <= committed:
            for index, (positions, new) in pending[1].items():
                self.bits[index][positions] = new
            self.version = pending[0]
        if self.version != committed:
            raise StagingStateError(
                f"the shard baseline holds v{self.version}, the sidecars committed "
                f"v{committed}: initialize the publisher again from the committed weights"
            )
        return self.bits


class ProjectedSource:
    """Publish through direct projection (a `PlanningSource`); construction is a collective."""

    def __init__(
        self,
        projection: MegatronProjection,
        full: CanonicalSource,
        *,
        timeout_s: float = 7200.0,
    ) -> None:
        """`projection`: the plan of the trainer's model; `full`: the whole export (first
        publish, whose result both sides start from); `timeout_s`: how long a rank waits for
        the others in this source's collectives (a publishing rank may first wait for the
        previous version's commit: keep it above `PublisherConfig.commit_timeout_s`)."""
        import torch.distributed as dist

        self._projection = projection
        self._full = full
        # This source's own collectives carry host tensors and small objects: a gloo group over
        # every rank, which works whatever backend the trainer's default group has (NCCL).
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._shards = {s.task.index: s for s in projection.owned_shards()}
        held = sorted({m.name for s in projection.held_shards() for m in s.rowmap.dests})
        gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, held, group=self._group)
        #: Canonical tensors some rank projects; all others must come from the residual export.
        self.projected_names = frozenset(n for names in gathered for n in names)
        #: Residual tasks a change flag may skip, with their outputs (learned at the first
        #: export) and how many the last publish skipped.
        self._flagged = projection.flagged_residuals()
        self._outputs: dict[int, list[str]] = {}
        self.skipped_residuals = 0
        self._base = ShardBaseline()
        self._layout: list[TensorMeta] | None = None
        self._cut: _Cut | None = None

    def coverage(self) -> Coverage:
        """What the projection covers, by bytes (its line is logged at construction)."""
        return self._projection.coverage()

    @classmethod
    def megatron(
        cls, bridge: Any, model: Sequence[Any], *, timeout_s: float = 7200.0, **kwargs: Any
    ) -> ProjectedSource:
        """The projecting source of a Megatron model under a Megatron Bridge `AutoBridge`;
        `kwargs` go to `MegatronProjection` (`project_qkv`, `dp_rank`, `dp_size`)."""
        projection = MegatronProjection(bridge, model, **kwargs)
        return cls(projection, MegatronBridgeSource(bridge, model), timeout_s=timeout_s)

    # --------------------------------------------------------------------------- PlanningSource
    def plan(self, intent: StageIntent | None) -> Iterator[PlannedChunk]:
        agreed = self._agree(intent)
        if agreed.purpose == "initial":
            yield from plan_owned(
                self._full.entries(), agreed.limit_bytes, agreed.producer, agreed.producers
            )
            # what each flagged residual task exports: one more export of each, once
            self._outputs = {
                p.index: self._projection.task_outputs(p.index) for p, _ in self._flagged
            }
            bits = {i: _bits(s.param, copy=True) for i, s in self._shards.items()}
            bits.update({p.index: _bits(w, copy=True) for p, w in self._flagged if w is not None})
            self._base.reset(agreed.version, bits)
            log.info("projected.baseline", version=agreed.version, shards=len(bits))
            return
        yield from self._next(agreed)

    # ------------------------------------------------------------------------------- machinery
    def _agree(self, intent: StageIntent | None) -> _Agreed:
        """Gather every publishing rank's intent (or refusal) and check the same facts on
        every rank. The layout comes from producer 0: once, and again on every first export
        (a trainer restart may meet other sidecars)."""
        import torch.distributed as dist

        mine: dict[str, Any] | None = None
        if intent is not None and intent.refusal is not None:
            mine = {"refusal": intent.refusal}
        elif intent is not None:
            fresh = intent.purpose == "initial" or self._layout is None
            mine = {
                "facts": (
                    intent.version,
                    intent.purpose,
                    intent.producers,
                    intent.limit_bytes,
                    intent.committed,
                ),
                "producer": intent.producer,
                "layout": intent.layout if fresh and intent.producer == 0 else None,
            }
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine, group=self._group)
        refused = [(r, g["refusal"]) for r, g in enumerate(gathered) if g and "refusal" in g]
        if refused:
            rank, why = refused[0]
            raise StagingStateError(f"rank {rank} refused to publish: {why}")
        ranks = [(r, g) for r, g in enumerate(gathered) if g is not None]
        if not ranks:
            raise StagingStateError("no rank publishes: give one rank per producer a Publisher")
        facts = {g["facts"] for _, g in ranks}
        if len(facts) != 1:
            raise StagingStateError(f"the publishing ranks disagree: {sorted(facts)}")
        version, purpose, producers, limit, committed = facts.pop()
        rank_of = {g["producer"]: r for r, g in ranks}
        if sorted(rank_of) != list(range(producers)) or len(ranks) != producers:
            raise StagingStateError(
                f"{producers} producers need one publishing rank each; ranks publish producers "
                f"{sorted(g['producer'] for _, g in ranks)}"
            )
        layout = gathered[rank_of[0]]["layout"]
        if purpose == "initial" or layout is not None:
            self._layout, self._cut = (None if layout is None else list(layout)), None
        mine_producer = None if intent is None else intent.producer
        return _Agreed(version, purpose, producers, limit, committed, rank_of, mine_producer)

    def _raise_everywhere(self, problem: str | None) -> None:
        """One `all_reduce` (MAX) of a refusal flag: a problem found on one rank is raised on
        every rank, none is left waiting in the next collective."""
        import torch.distributed as dist

        flag = torch.tensor([problem is not None], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        if problem is not None:
            raise CandidateMismatchError(problem)
        if int(flag[0]):
            raise CandidateMismatchError("another rank refused its projection (see its log)")

    def _next(self, agreed: _Agreed) -> Iterator[PlannedChunk]:
        base = self._base.settle(agreed.committed)
        if self._layout is None:
            raise StagingStateError("the sidecars sent no baseline layout")
        if self._cut is None or self._cut.limit_bytes != agreed.limit_bytes:
            self._cut = _Cut.of(self._layout, agreed.limit_bytes)
        cut = self._cut
        pending, outgoing, problem = self._project(base, agreed, cut)
        received, problem = _exchange(outgoing, cut.metas, problem, self._group)
        self._raise_everywhere(problem)
        skip, unchanged = self._unchanged_residuals(base, pending)
        residual = self._residual_tensors(agreed, cut, skip)
        self._raise_everywhere(residual.problem)
        missing = set(cut.number) - self.projected_names - residual.names - unchanged
        both = (self.projected_names | unchanged) & residual.names
        if missing or both or unchanged & self.projected_names:
            raise CandidateMismatchError(
                f"the projection covers {len(self.projected_names)} tensors and the residual "
                f"export {len(residual.names)}: missing {sorted(missing)[:5]}, in both "
                f"{sorted(both)[:5]} (first 5)"
            )
        self._base.stage(agreed.version, pending)
        for i, metas in enumerate(cut.plan):
            if owner_of(i, agreed.producers) != agreed.producer:
                yield PlannedChunk(i, metas, None)
                continue
            whole = [(m.name, residual.kept.pop(m.name)) for m in metas if m.name in residual.kept]
            changes = tuple(
                _merged(m, received.pop(m.name, [])) for m in metas if m.name not in residual.names
            )
            yield PlannedChunk(i, metas, ExportChunk(i, tuple(whole)), changes)
        if received or residual.kept:
            left = sorted(received)[:3] + sorted(residual.kept)[:3]
            raise CandidateMismatchError(f"changes or tensors outside this rank's chunks: {left}")

    def _project(
        self,
        base: dict[int, Bits],
        agreed: _Agreed,
        cut: _Cut,
    ) -> tuple[dict[int, tuple[Bits, Bits]], list[list[tuple[int, Bits, Bits]]], str | None]:
        """Diff every owned shard with its baseline and route each projected change to the
        rank publishing its chunk: (this rank's pending changes, per-rank outgoing lists, a
        problem that every rank must learn of before it raises)."""
        import torch.distributed as dist

        pending: dict[int, tuple[Bits, Bits]] = {}
        outgoing: list[list[tuple[int, Bits, Bits]]] = [[] for _ in range(dist.get_world_size())]
        for meta in {m for s in self._shards.values() for m in s.rowmap.dests}:
            theirs = cut.describe(meta)
            if theirs is not None:
                problem = (
                    f"{meta.name}: projected as {list(meta.shape)} {meta.dtype}, the "
                    f"baseline's export holds it {theirs}"
                )
                return {}, outgoing, problem
        for index, shard in self._shards.items():
            diff = diff_bits(base[index], _bits(shard.param, copy=False))
            if not diff.count:
                continue
            pending[index] = (diff.locations, diff.new_bits)  # the diff owns its arrays
            for meta, (where, mask) in zip(
                shard.rowmap.dests, shard.rowmap.route(diff.locations), strict=True
            ):
                if where.size:
                    rank = agreed.rank_of[owner_of(cut.chunk_of[meta.name], agreed.producers)]
                    bits = diff.new_bits if mask is None else diff.new_bits[mask]
                    outgoing[rank].append((cut.number[meta.name], where, bits))
        return pending, outgoing, None

    def _unchanged_residuals(
        self, base: dict[int, Bits], pending: dict[int, tuple[Bits, Bits]]
    ) -> tuple[list[int], set[str]]:
        """Change flags: each rank compares the parameters of the flagged residual tasks it
        holds with their baseline, one `all_reduce` (MAX) makes the flags global. Returns the
        unchanged tasks (skipped by the export) and their canonical outputs (sent as no
        changes); the changed parameters' diffs join `pending`."""
        import torch.distributed as dist

        flags = torch.zeros(len(self._flagged), dtype=torch.int64)
        for k, (plan, param) in enumerate(self._flagged):
            if param is None:
                continue
            diff = diff_bits(base[plan.index], _bits(param, copy=False))
            if diff.count:
                pending[plan.index] = (diff.locations, diff.new_bits)
                flags[k] = 1
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        changed = flags.tolist()
        skip = [p.index for (p, _), c in zip(self._flagged, changed, strict=True) if not c]
        self.skipped_residuals = len(skip)
        return skip, {n for i in skip for n in self._outputs[i]}

    def _residual_tensors(self, agreed: _Agreed, cut: _Cut, skip: Sequence[int]) -> _Residual:
        """The residual export less the skipped tasks, run on every rank; the publisher of each
        tensor's chunk keeps it. Its entries are the same on every rank, so a refusal here is
        raised everywhere."""
        out = _Residual()
        for entry in self._projection.residual_source(skip).entries():
            chunk = cut.chunk_of.get(entry.name)
            if chunk is None or cut.describe(entry.meta) is not None:
                raise CandidateMismatchError(
                    f"{entry.name}: exported as {list(entry.meta.shape)} {entry.meta.dtype}, "
                    "which the baseline's export does not hold"
                )
            owned = owner_of(chunk, agreed.producers) == agreed.producer
            tensor = entry.fetch(owned)
            out.names.add(entry.name)
            if owned:
                try:
                    out.kept[entry.name] = checked_tensor(entry.meta, tensor)
                except CandidateMismatchError as exc:  # finish the export: it is a collective
                    out.problem = out.problem or str(exc)
        return out


def _bits(param: torch.Tensor, *, copy: bool) -> Bits:
    """A parameter's stored bits as a flat integer view on the host: a copy of its own (for a
    baseline), or a view where the parameter already lives on the host (to compare)."""
    return bits_numpy(param.detach().to("cpu", copy=copy)).reshape(-1)


@dataclass
class _Residual:
    """What the residual export gave: every name (all ranks), the tensors this rank keeps."""

    names: set[str] = field(default_factory=set)
    kept: dict[str, torch.Tensor] = field(default_factory=dict)
    problem: str | None = None


def _exchange(
    outgoing: list[list[tuple[int, Bits, Bits]]],
    layout: Sequence[TensorMeta],
    problem: str | None,
    group: Any,
) -> tuple[dict[str, list[tuple[Bits, Bits]]], str | None]:
    """Send each rank its (tensor number, positions, new bits) pieces and receive this rank's:
    four `all_to_all_single` calls (sizes and a problem flag, then piece headers, positions
    and value bytes) on `group`. A problem on any rank is raised on every rank after the
    first call; one found in what arrived is returned, for the caller to raise everywhere.
    Empties `outgoing` as it packs it, so each change is held packed or unpacked, not both."""
    import torch.distributed as dist

    world = len(outgoing)
    heads, positions, values = [], [], []
    for pieces in outgoing:
        heads.append(np.array([[k, p.size] for k, p, _ in pieces], np.int64).reshape(-1))
        positions.append(np.concatenate([p for _, p, _ in pieces] or [np.empty(0, np.int64)]))
        raw = [np.ascontiguousarray(b).view(np.uint8) for _, _, b in pieces]
        values.append(np.concatenate(raw or [np.empty(0, np.uint8)]))
        pieces.clear()
    sizes = torch.tensor(
        [
            [h.size, p.size, v.size, problem is not None]
            for h, p, v in zip(heads, positions, values, strict=True)
        ],
        dtype=torch.int64,
    )
    got = torch.empty_like(sizes)
    dist.all_to_all_single(got, sizes, group=group)
    if problem is not None:
        raise CandidateMismatchError(problem)
    failed = [r for r in range(world) if int(got[r, 3])]
    if failed:
        raise CandidateMismatchError(f"rank {failed[0]} refused its projection (see its log)")

    def swap(parts: list[Bits], column: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(int(got[:, column].sum()), dtype=dtype)
        dist.all_to_all_single(
            out,
            torch.from_numpy(np.concatenate(parts)),
            got[:, column].tolist(),
            sizes[:, column].tolist(),
            group=group,
        )
        return out

    head = swap(heads, 0, torch.int64).numpy().reshape(-1, 2)
    where = swap(positions, 1, torch.int64).numpy()
    data = swap(values, 2, torch.uint8).numpy()
    received: dict[str, list[tuple[Bits, Bits]]] = defaultdict(list)
    p = v = 0
    for number, count in head.tolist():
        meta = layout[number]
        lanes = NP_INT_VIEW[dtypes.width(meta.dtype)]
        piece = data[v : v + count * lanes.itemsize]
        # pieces of several widths are packed back to back: copy one that starts unaligned
        aligned = v % lanes.itemsize == 0
        bits = piece.view(lanes) if aligned else np.frombuffer(piece.tobytes(), lanes)
        received[meta.name].append((where[p : p + count], bits))
        p, v = p + count, v + count * lanes.itemsize
    if p != where.size or v != data.size:
        return received, "the projected changes received do not add up"
    return received, None


def _merged(meta: TensorMeta, pieces: list[tuple[Bits, Bits]]) -> Change:
    """One tensor's changes from every rank that projects part of it, sorted by position."""
    if not pieces:
        where, bits = np.empty(0, np.int64), np.empty(0, NP_INT_VIEW[dtypes.width(meta.dtype)])
    else:
        where = np.concatenate([p for p, _ in pieces])
        bits = np.concatenate([b for _, b in pieces])
        if len(pieces) > 1:
            order = np.argsort(where, kind="stable")
            where, bits = where[order], bits[order]
    if where.size > 1 and not np.all(where[1:] > where[:-1]):
        raise CandidateMismatchError(f"{meta.name}: two shards projected the same element")
    values = torch.from_numpy(np.ascontiguousarray(bits)).view(meta.dtype)
    return Change(meta.name, torch.from_numpy(np.ascontiguousarray(where)), values)
