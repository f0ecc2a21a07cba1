"""Reading a newer peer's answers: fields this release does not know are dropped, not refused.

The user's trainer image pins its own `kuberefit[trainer]`; the sidecar next to it comes with
the chart and may be newer (so may the sidecars an operator talks to after a chart rollback).
Requests stay strict (a peer refuses what it does not know), but an answer from an
authenticated peer that only adds fields must not break an older client, as a Kubernetes
client ignores the fields a newer API server adds.
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
    """`data` with the keys `model` (and the models its fields hold) does not declare dropped;
    a key is kept under any name the model accepts (field name, alias, validation alias)."""
    if not isinstance(data, dict):
        return data
    out: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        names = {name, field.alias, field.validation_alias}
        for key in (k for k in names if isinstance(k, str) and k in data):
            out[key] = _known(field.annotation, data[key])
    return out


def _known(annotation: Any, value: Any) -> Any:
    """`value` filtered by what `annotation` declares; left as is where that is not clear
    (validation then decides)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if _is_model(annotation):
        return known_fields(annotation, value)
    if origin in (Union, types.UnionType):
        present = [a for a in args if a is not type(None)]
        return _known(present[0], value) if len(present) == 1 else value
    if not isinstance(value, (list, dict)) or not args:
        return value
    if origin in (list, set, frozenset) and isinstance(value, list):
        return [_known(args[0], v) for v in value]
    if origin is tuple and isinstance(value, list):
        if len(args) == 2 and args[1] is Ellipsis:
            return [_known(args[0], v) for v in value]
        if len(args) == len(value):
            return [_known(a, v) for a, v in zip(args, value, strict=True)]
        return value
    if origin is dict and isinstance(value, dict):
        return {k: _known(args[1], v) for k, v in value.items()}
    return value


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)
