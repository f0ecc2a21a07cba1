"""❷ projection for Megatron Bridge: which conversion tasks are affine, their row maps, who
owns each shard, and the residual tasks left to the bridge's own export.

`MegatronProjection` takes the bridge's conversion tasks once (`get_conversion_tasks`: the
bridge's own global names, with PP, VP and EP offsets resolved) and classifies each from its
mapping class, its module and the model config, never from data. A task is *affine* when its
export only moves whole rows of a BF16/FP16/FP32 parameter (column, row and replicated shards,
the gate/up halves of a fused MLP, and, with `project_qkv`, fused Q/K/V); every other task is
*residual* and named with the reason, and the bridge exports it as today
(`export_hf_weights(conversion_tasks=residual)`). One `all_gather_object` at construction makes
the decision the same on every rank (a rank that holds the parameter may see a reason the others
cannot, and the residual export is a collective over the same task list on every rank).

Which class does arithmetic or casts was read from Megatron Bridge 0.3.1
(docs/research/direct-projection.md); the identity probe in
tests/sidecar/trainer/megatron_project.py checks every row map against the bridge's own export
of source ids. Megatron is never imported here: classes are recognised by module and name.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.trainer import projection
from refit_sidecar.trainer.megatron import MegatronBridgeSource
from refit_sidecar.trainer.projection import RowMap

_MAPPINGS = "megatron.bridge.models.conversion.param_mapping"
#: Mapping classes whose export is a pure row move, and the row map of each (`AutoMapping`
#: resolves to one of the first three at export time, from its module; QKV only with
#: `project_qkv`).
_KIND = {
    "ColumnParallelMapping": "column",
    "RowParallelMapping": "row",
    "ReplicatedMapping": "replicated",
    "DirectMapping": "replicated",
    "GatedMLPMapping": "gated",
    "QKVMapping": "qkv",
    "AutoMapping": None,
}
#: What `AutoMapping._detect_parallelism_type` answers.
_DETECTED = ("column", "row", "replicated")
_PLAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
log = structlog.get_logger("kuberefit.projection")


#: Residual reasons of known mapping classes whose canonical outputs are a function of the
#: task's own parameter alone (split, cloned, gathered or permuted), so an unchanged parameter
#: on every rank that holds it means unchanged outputs: the residual export may skip the task.
#: Any other residual task (unknown classes, FP8 scales, a bridge hook) is exported every time.
_PARAM_ONLY_REASONS = (
    "fused Q/K/V",
    "tied embeddings",
    "expert parallelism > 1",
    "expert tensor parallelism",
    "permuted dimensions",
    "layout not projected",
)


@dataclass(frozen=True)
class TaskPlan:
    """One conversion task: affine (`kind`) or residual (`reason`), with its canonical bytes."""

    index: int
    name: str
    kind: str | None
    reason: str | None
    nbytes: int

    @property
    def affine(self) -> bool:
        return self.kind is not None

    @property
    def param_only(self) -> bool:
        """A residual task whose outputs change only when its parameter does (a change flag
        decides whether it is exported)."""
        return self.reason is not None and self.reason.startswith(_PARAM_ONLY_REASONS)


@dataclass(frozen=True)
class Shard:
    """An affine shard held on this rank: the live parameter and where its rows land."""

    task: TaskPlan
    rowmap: RowMap
    param: torch.Tensor

    def snapshot(self) -> torch.Tensor:
        """A CPU copy of the shard's current bits (a tracker entry, or a candidate)."""
        return self.param.detach().to("cpu", copy=True).contiguous()


@dataclass(frozen=True)
class Coverage:
    """How many canonical bytes each path takes (the paper's Appendix D table, per model)."""

    affine_bytes: dict[str, int] = field(default_factory=dict)
    residual_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.affine_bytes.values()) + sum(self.residual_bytes.values())

    @property
    def fraction(self) -> float:
        return sum(self.affine_bytes.values()) / self.total if self.total else 0.0

    def line(self) -> str:
        """The start-up log line: affine share by bytes, then each path's share by reason."""
        parts = [f"{k} {100 * b / self.total:.1f}%" for k, b in sorted(self.affine_bytes.items())]
        rest = [f"{k} {100 * b / self.total:.1f}%" for k, b in sorted(self.residual_bytes.items())]
        return (
            f"projected {100 * self.fraction:.1f}% of {self.total} canonical bytes "
            f"({', '.join(parts) or 'none'}); residual: {'; '.join(rest) or 'none'}"
        )


class MegatronProjection:
    """The projection plan of one Megatron model under one bridge, fixed at construction.

    Construction is a collective (the bridge's PP name exchange and one `all_gather_object`
    over the default group): call it on every rank, in the same order as the other exports.
    """

    def __init__(
        self,
        bridge: Any,
        model: Sequence[Any],
        *,
        project_qkv: bool = False,
        dp_rank: int | None = None,
        dp_size: int | None = None,
    ) -> None:
        """`bridge`: a Megatron Bridge `AutoBridge`; `model`: its Megatron model chunks;
        `project_qkv`: project fused Q/K/V too (off by default, as in the paper: the row
        permutation is proved by the identity probe, but it is the least common layout);
        `dp_rank`/`dp_size`: this rank among the data-parallel replicas, one of which owns each
        shard (default: Megatron's data-parallel group, context parallel included)."""
        import torch.distributed as dist

        if dp_rank is None or dp_size is None:
            from megatron.core import parallel_state

            dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
            dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_size})")
        self._bridge = bridge
        self._model = list(model)
        self._tasks = list(bridge.get_conversion_tasks(self._model))
        config = self._model[0].config
        context = _Context(
            config=config,
            project_qkv=project_qkv,
            tied=_tied(config, self._model),
            tp_size=int(getattr(config, "tensor_model_parallel_size", 1) or 1),
            whole=_whole_model_reason(bridge, self._model),
        )
        local: dict[int, tuple[str | None, str | None, int]] = {}
        self._rowmaps: dict[int, RowMap] = {}
        for i, task in enumerate(self._tasks):
            if task is None or task.param_weight is None:
                continue
            # Every rank must reach the all_gather below: a surprise here makes a residual task.
            try:
                kind, reason, rowmap = _classify(task, context)
            except Exception as exc:  # any surprise is a reason, not a hang
                kind, reason, rowmap = None, f"not classified ({type(exc).__name__})", None
            try:
                nbytes = sum(d.nbytes for d in rowmap.dests) if rowmap else _residual_bytes(task)
            except Exception:  # for the coverage line only
                nbytes = int(task.param_weight.numel()) * int(task.param_weight.element_size())
            local[i] = (kind, reason, nbytes)
            if rowmap is not None:
                self._rowmaps[i] = rowmap
        gathered: list[dict[int, tuple[str | None, str | None, int]]] = [
            {} for _ in range(dist.get_world_size())
        ]
        dist.all_gather_object(gathered, local)
        self.plans = [_merge(i, task, gathered) for i, task in enumerate(self._tasks)]
        self._dp = (dp_rank, dp_size)
        log.info(
            "projection plan",
            coverage=self.coverage().line(),
            tasks=len(self.plans),
            residual_tasks=len(self.residual_tasks),
        )

    @property
    def residual_tasks(self) -> list[Any]:
        """The bridge's tasks left to its export, in the bridge's order (same on every rank)."""
        return self._residual(set())

    def _residual(self, skip: set[int]) -> list[Any]:
        return [
            t
            for t, p in zip(self._tasks, self.plans, strict=True)
            if not p.affine and p.index not in skip
        ]

    def flagged_residuals(self) -> list[tuple[TaskPlan, Any]]:
        """The residual tasks a change flag may skip (`TaskPlan.param_only`), in the bridge's
        order (the same list on every rank), with the parameter of each when this rank holds
        it (else None)."""
        return [
            (p, t.param_weight)
            for t, p in zip(self._tasks, self.plans, strict=True)
            if p.param_only and t is not None
        ]

    def coverage(self) -> Coverage:
        cov = Coverage()
        for p in self.plans:
            bucket, key = (cov.affine_bytes, p.kind) if p.affine else (cov.residual_bytes, p.reason)
            assert key is not None
            bucket[key] = bucket.get(key, 0) + p.nbytes
        return cov

    def held_shards(self) -> Iterator[Shard]:
        """Every affine shard held on this rank, owned or a replica."""
        for i, rowmap in self._rowmaps.items():
            if self.plans[i].affine:  # else another rank found a reason: residual everywhere
                yield Shard(self.plans[i], rowmap, self._tasks[i].param_weight)

    def owned_shards(self) -> Iterator[Shard]:
        """The affine shards this rank owns: one owner per distinct shard (a stable hash of the
        task name picks the data-parallel replica, and the TP rank of a replicated tensor)."""
        dp_rank, dp_size = self._dp
        for shard in self.held_shards():
            mapping = self._tasks[shard.task.index].mapping
            h = zlib.crc32(shard.task.name.encode())
            if h % dp_size != dp_rank:
                continue
            # the quotient picks the TP rank: `h` modulo both would tie the two choices together
            tp_choice = (h // dp_size) % mapping.tp_size
            if shard.task.kind == "replicated" and tp_choice != mapping.tp_rank:
                continue
            yield shard

    def residual_source(self, skip: Sequence[int] = ()) -> MegatronBridgeSource:
        """Today's canonical source, limited to the residual tasks, less the tasks whose plan
        index is in `skip` (a collective per pass: give every rank the same `skip`)."""
        tasks = self._residual(set(skip))
        return MegatronBridgeSource(
            self._bridge, self._model, export_kwargs={"conversion_tasks": tasks}
        )

    def task_outputs(self, index: int) -> list[str]:
        """The canonical names the bridge exports for task `index` (a collective: every rank,
        the same task)."""
        source = MegatronBridgeSource(
            self._bridge, self._model, export_kwargs={"conversion_tasks": [self._tasks[index]]}
        )
        names = []
        for entry in source.entries():
            entry.fetch(False)
            names.append(entry.name)
        return names


def _whole_model_reason(bridge: Any, model: Sequence[Any]) -> str | None:
    """A reason no task of this model may be projected (checked on every rank's modules)."""
    model_bridge = getattr(bridge, "_model_bridge", None)
    hook_owner = next(
        (c for c in type(model_bridge).__mro__ if "maybe_modify_converted_hf_weight" in c.__dict__),
        None,
    )
    if hook_owner is not None and hook_owner.__name__ != "MegatronModelBridge":
        return f"{hook_owner.__name__} changes converted weights"
    for chunk in model:
        for name, _ in chunk.named_parameters():
            if ".adapter." in name or ".to_wrap." in name:  # Bridge's PEFT (LoRA) wrappers
                return "adapters are merged on export"
    return None


@dataclass(frozen=True)
class _Context:
    """What classification needs beside the task, the same for every task of the model."""

    config: Any
    project_qkv: bool
    tied: bool
    tp_size: int
    whole: str | None


def _tied(config: Any, model: Sequence[Any]) -> bool:
    """Whether the embedding is shared with the output layer, as the bridge decides it: the
    config first, else the model under its wrappers (Float16Module, DDP)."""
    value = getattr(config, "share_embeddings_and_output_weights", None)
    if value is None:
        inner = model[0]
        while hasattr(inner, "module"):
            inner = inner.module
        value = getattr(inner, "share_embeddings_and_output_weights", False)
    return bool(value)


def _classify(task: Any, ctx: _Context) -> tuple[str | None, str | None, RowMap | None]:
    """(kind, None, row map) for an affine task held here, else (None, reason, None)."""
    mapping = task.mapping
    cls = type(mapping)
    param = task.param_weight
    if ctx.whole is not None:
        return None, ctx.whole, None
    if cls.__module__ != _MAPPINGS or cls.__name__ not in _KIND:
        return None, f"{cls.__name__} (not a known row move)", None
    # before the reasons a change flag may skip (`_PARAM_ONLY_REASONS`): those need plain bits
    if type(param.data) is not torch.Tensor or param.dtype not in _PLAIN_DTYPES:
        return None, f"{param.dtype} {type(param.data).__name__} parameters", None
    if cls.__name__ == "QKVMapping" and not ctx.project_qkv:
        return None, "fused Q/K/V (project_qkv off)", None
    if cls.__name__ == "QKVMapping" and getattr(ctx.config, "attention_output_gate", False):
        return None, "fused Q/K/V with an output gate", None
    if getattr(mapping, "is_expert", False):
        if int(mapping.ep_size) > 1:
            return None, "expert parallelism > 1 (projection verified at EP=1 only)", None
        if int(mapping.tp_size) != ctx.tp_size:
            return None, "expert tensor parallelism unlike TP (not verified)", None
    if ctx.tied and task.global_param_name.startswith(("embedding.", "output_layer.")):
        return None, "tied embeddings (two canonical names)", None
    if getattr(mapping, "permute_dims", None) is not None:
        return None, "permuted dimensions", None
    try:
        kind = _resolved_kind(task)
        rowmap = _rowmap(kind, mapping, param, ctx.config)
    except _UnresolvedError as exc:
        return None, str(exc), None
    except ValueError as exc:
        return None, f"layout not projected ({exc})", None
    if rowmap.local_shape != tuple(param.shape):
        return None, "layout not projected (the shard is not what the map expects)", None
    return kind, None, rowmap


class _UnresolvedError(ValueError):
    """The parallelism of a known mapping class could not be resolved."""


def _resolved_kind(task: Any) -> str:
    """The row-map kind of a task of a known mapping class: `AutoMapping` resolved from its
    module as the bridge does at export time, and a 1-D row-parallel bias, which is not split
    (every TP rank holds all of it), as replicated."""
    kind = _KIND[type(task.mapping).__name__]
    if kind is None:  # AutoMapping
        try:
            kind = task.mapping._detect_parallelism_type(task.megatron_module)
        except ValueError as exc:
            raise _UnresolvedError("parallelism not detected") from exc
        if kind not in _DETECTED:
            raise _UnresolvedError(f"parallelism {kind!r} not known")
    return "replicated" if kind == "row" and task.param_weight.dim() == 1 else kind


def _rowmap(kind: str | None, mapping: Any, param: torch.Tensor, config: Any) -> RowMap:
    shape = tuple(int(d) for d in param.shape)
    r, t = int(mapping.tp_rank), int(mapping.tp_size)
    hf = mapping.hf_param
    if kind == "replicated":
        return projection.identity(TensorMeta(str(hf), shape, param.dtype))
    if kind == "column":
        return projection.column(TensorMeta(str(hf), (shape[0] * t, *shape[1:]), param.dtype), r, t)
    if kind == "row":
        return projection.row(TensorMeta(str(hf), (shape[0], shape[1] * t), param.dtype), r, t)
    if kind == "gated":
        half = (shape[0] // 2 * t, *shape[1:])
        return projection.gated(
            TensorMeta(hf["gate"], half, param.dtype), TensorMeta(hf["up"], half, param.dtype), r, t
        )
    if kind == "qkv":
        heads, groups = int(config.num_attention_heads), int(config.num_query_groups)
        d = int(config.kv_channels)
        rest = shape[1:]
        return projection.qkv(
            TensorMeta(hf["q"], (heads * d, *rest), param.dtype),
            TensorMeta(hf["k"], (groups * d, *rest), param.dtype),
            TensorMeta(hf["v"], (groups * d, *rest), param.dtype),
            heads=heads,
            groups=groups,
            head_dim=d,
            tp_rank=r,
            tp_size=t,
        )
    raise ValueError(f"no row map for {kind}")


def _residual_bytes(task: Any) -> int:
    """Bytes of the canonical tensors a residual task exports: its shard times TP when its
    class or module splits it over TP (for the coverage line only)."""
    p = task.param_weight
    n = int(p.numel()) * int(p.element_size())
    if type(task.mapping).__name__ in _KIND:
        split = _resolved_kind(task) != "replicated"
    else:
        split = bool(getattr(p, "tensor_model_parallel", False))
    return n * int(task.mapping.tp_size) if split else n


def _merge(
    index: int, task: Any, gathered: list[dict[int, tuple[str | None, str | None, int]]]
) -> TaskPlan:
    """One decision for a task from every rank that holds it: residual if any found a reason."""
    if task is None:
        return TaskPlan(index, f"task {index}", None, "no mapping for this parameter", 0)
    name = task.global_param_name
    seen = [g[index] for g in gathered if index in g]
    if not seen:
        return TaskPlan(index, name, None, "held by no rank", 0)
    nbytes = max(b for _, _, b in seen)
    # a reason a change flag may not skip comes first: one such holder decides for the task
    reasons = sorted(
        {r for _, r, _ in seen if r is not None},
        key=lambda r: (r.startswith(_PARAM_ONLY_REASONS), r),
    )
    if reasons:
        return TaskPlan(index, name, None, reasons[0], nbytes)
    kinds = {k for k, _, _ in seen}
    if len(kinds) != 1:
        shown = sorted(map(str, kinds))
        return TaskPlan(index, name, None, f"ranks disagree on the layout ({shown})", nbytes)
    return TaskPlan(index, name, kinds.pop(), None, nbytes)
