"""Reading a newer peer's answers: fields this release does not know are dropped, not refused.

The user's trainer image pins its own `kuberefit[trainer]`; the sidecar next to it comes with
the chart and may be newer (so may the sidecars an operator talks to after a chart rollback). Requests stay strict (a peer refuses what it does not know), but an
answer from an authenticated peer that only adds fields must not break an older client, as a
Kubernetes client ignores fields a newer API server adds.
"""

from __future__ import annotations

import json
import types
from typing import Any, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)


def read_answer(model: type[M], raw: bytes | str) -> M:
    """`raw` (JSON) as `model`, unknown fields at any depth of its models dropped; everything
    else is validated as strictly as `model` says (what is not JSON raises pydantic's
    ValidationError, as `model_validate_json` would)."""
    try:
        data = json.loads(raw)
    except ValueError:
        return model.model_validate_json(raw)  # raises, naming what is wrong
    return model.model_validate(known_fields(model, data))


def known_fields(model: type[BaseModel], data: Any) -> Any:
    """`data` with the keys `model` (and the models its fields hold) does not declare dropped."""
    if not isinstance(data, dict):
        return data
    out: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        key = field.alias or name
        if key in data:
            out[key] = _known(field.annotation, data[key])
        elif name in data:
            out[name] = _known(field.annotation, data[name])
    return out


def _known(annotation: Any, value: Any) -> Any:
    origin = get_origin(annotation)
    if _is_model(annotation):
        return known_fields(annotation, value)
    if origin in (list, tuple, set, frozenset) and isinstance(value, list):
        (inner, *_) = get_args(annotation) or (Any,)
        return [_known(inner, v) for v in value]
    if origin is dict and isinstance(value, dict):
        _, inner = get_args(annotation) or (Any, Any)
        return {k: _known(inner, v) for k, v in value.items()}
    if origin in (Union, types.UnionType) and isinstance(value, dict):
        models = [a for a in get_args(annotation) if _is_model(a)]
        if len(models) == 1:  # `Model | None`; a union of models is left to validation
            return known_fields(models[0], value)
    return value


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)
