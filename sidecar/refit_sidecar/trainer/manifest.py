"""The export manifest on the wire, and a readable account of how two exports differ.

Names, shapes, dtypes and order of the canonical tensors fix the chunk plan and ownership, so
the sidecar compares a new export's manifest with its baseline's before staging it, and says
exactly what changed when they differ.
"""

from __future__ import annotations

from collections.abc import Sequence

from refit_protocol.tensors import TensorMetaModel
from refit_sidecar.codec import dtypes
from refit_sidecar.codec.errors import SchemaError
from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.trainer.errors import CandidateMismatchError


def to_wire(metas: Sequence[TensorMeta]) -> list[TensorMetaModel]:
    return [
        TensorMetaModel(name=m.name, shape=list(m.shape), dtype=dtypes.dtype_name(m.dtype))
        for m in metas
    ]


def from_wire(models: Sequence[TensorMetaModel]) -> list[TensorMeta]:
    """Metadata from an untrusted manifest (only dtypes the codec carries)."""
    out = []
    for m in models:
        try:
            dtype = dtypes.dtype_from_name(m.dtype)
        except SchemaError as exc:
            raise CandidateMismatchError(f"{m.name}: dtype {m.dtype!r} is not supported") from exc
        if any(d < 0 for d in m.shape):
            raise CandidateMismatchError(f"{m.name}: negative dimension in {m.shape}")
        out.append(TensorMeta(m.name, tuple(m.shape), dtype))
    return out


def _fmt(meta: TensorMeta) -> str:
    return f"{list(meta.shape)} {dtypes.dtype_name(meta.dtype)}"


def describe_difference(
    ours: Sequence[TensorMeta], theirs: Sequence[TensorMeta], *, limit: int = 5
) -> str | None:
    """None when equal; else the first differences (missing, extra, changed, reordered)."""
    if list(ours) == list(theirs):
        return None
    mine = {m.name: m for m in ours}
    base = {m.name: m for m in theirs}
    problems: list[str] = []
    if len(mine) != len(ours):
        problems.append("the export repeats a tensor name")
    extra = [n for n in mine if n not in base]
    missing = [n for n in base if n not in mine]
    changed = [n for n in mine if n in base and mine[n] != base[n]]
    if extra:
        problems.append(f"{len(extra)} not in the baseline ({', '.join(extra[:limit])})")
    if missing:
        problems.append(f"{len(missing)} missing ({', '.join(missing[:limit])})")
    problems.extend(
        f"{n} is {_fmt(mine[n])}, the baseline has {_fmt(base[n])}" for n in changed[:limit]
    )
    if len(changed) > limit:
        problems.append(f"{len(changed) - limit} more changed")
    if not problems:
        problems.append("the same tensors come in a different order")
    return "; ".join(problems)


def require_same_layout(
    ours: Sequence[TensorMeta], theirs: Sequence[TensorMeta], what: str
) -> None:
    """Refuse an export whose names, shapes, dtypes or order differ from `what`."""
    diff = describe_difference(ours, theirs)
    if diff is not None:
        raise CandidateMismatchError(
            f"the export does not match {what}: {diff}. Names, shapes, dtypes and order must "
            "stay fixed between versions (same model, same Bridge version and export settings)"
        )
