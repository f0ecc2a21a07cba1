"""H, the canonical checkpoint's size, from what a user has at hand.

- a safetensors index (`model.safetensors.index.json`): `metadata.total_size`, the exact sum of
  the tensors' bytes;
- a Hugging Face `config.json`: an estimate from the architecture (embedding, attention with
  grouped KV heads, gated MLP or experts, norms, untied output head) times the dtype's width. It
  ignores biases and model-specific extras, so it is marked as an estimate.

Both files are read with the bounds of `plan/files.py` (size, nesting, length of numbers); every
architecture figure must be at most `MAX_ARCHITECTURE_FIGURE` before any arithmetic, and H at
most `MAX_MODEL_BYTES` (1 PB).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refit_tools.plan.files import InputFileError, read_json
from refit_tools.plan.units import MAX_MODEL_BYTES, MAX_MODEL_TEXT

#: The largest figure of a config.json's architecture (sizes, layers, heads, experts,
#: vocabulary) taken: a billion (real models' are below a million).
MAX_ARCHITECTURE_FIGURE = 10**9

_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


class SizingError(ValueError):
    """The file does not give a size (the message says why)."""


@dataclass(frozen=True)
class ModelSize:
    model_bytes: int
    #: The output head's bytes (the last tensor in export order) when known.
    last_tensor_bytes: int | None
    exact: bool
    how: str
    #: The embedding's bytes (the first tensor in export order) when known.
    first_tensor_bytes: int | None = None
    #: Bytes per element (the dtype's width) when the source says; None: not known.
    element_bytes: int | None = None
    #: The dtype the width comes from, as the source names it.
    dtype: str | None = None
    #: Bytes of each tensor in export order, when the source gives the layout (a Hugging Face
    #: config: estimated from its sizes); the planner builds the producer's payloads from it.
    tensor_bytes: tuple[int, ...] | None = None


def _json(path: Path) -> dict[str, Any]:
    try:
        data = read_json(path, finite=False)  # bounded; the fields read are checked by name
    except OSError as exc:
        raise SizingError(f"{path}: cannot read it: {exc.strerror}") from exc
    except InputFileError as exc:
        raise SizingError(f"{path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise SizingError(f"{path}: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SizingError(f"{path}: not a JSON object")
    return data


def from_safetensors_index(path: Path) -> ModelSize:
    data = _json(path)
    metadata = data.get("metadata")
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    if not isinstance(total, int | float) or isinstance(total, bool):
        raise SizingError(f"{path}: no positive metadata.total_size (a safetensors index has one)")
    try:
        usable = math.isfinite(total) and total > 0 and total == int(total)
    except OverflowError:  # an integer beyond a float's range
        usable = False
    if not usable:
        digits = str(total)
        shown = (
            f"{total:g}"
            if isinstance(total, float)
            else digits
            if len(digits) <= 20
            else f"a {len(digits)}-digit number"
        )
        raise SizingError(
            f"{path}: metadata.total_size is {shown}, not a positive, finite whole number of bytes"
        )
    if total > MAX_MODEL_BYTES:
        raise SizingError(
            f"{path}: metadata.total_size is {int(total)} bytes: H must be at most {MAX_MODEL_TEXT}"
        )
    return ModelSize(int(total), None, True, f"metadata.total_size of {path.name}")


def _int(cfg: dict[str, Any], *keys: str, default: int | None = None) -> int:
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            if value > MAX_ARCHITECTURE_FIGURE:
                digits = len(str(value))
                raise SizingError(
                    f"{key} is a {digits}-digit number, above {MAX_ARCHITECTURE_FIGURE:,} "
                    "(no model has that many)"
                )
            return value
    if default is not None:
        return default
    raise SizingError(f"config has no positive {' / '.join(keys)}")


#: The most tensors a layout is built for (a 1T MoE has ~70,000); beyond it H alone is used.
MAX_TENSORS = 1_000_000


def from_hf_config(path: Path) -> ModelSize:
    """Parameter count x dtype width, estimated from a Hugging Face config.json."""
    outer = _json(path)
    cfg = outer.get("text_config") if isinstance(outer.get("text_config"), dict) else outer
    assert isinstance(cfg, dict)
    try:
        hidden = _int(cfg, "hidden_size", "d_model", "n_embd")
        layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers")
        heads = _int(cfg, "num_attention_heads", "n_head")
        kv_heads = _int(cfg, "num_key_value_heads", default=heads)
        vocab = _int(cfg, "vocab_size")
        head_dim = _int(cfg, "head_dim", default=hidden // heads)
        inter = _int(cfg, "intermediate_size", "ffn_dim", "n_inner", default=4 * hidden)
        experts = _int(cfg, "num_experts", "n_routed_experts", "num_local_experts", default=0)
        moe_inter = _int(cfg, "moe_intermediate_size", default=inter)
        shared_inter = _int(cfg, "shared_expert_intermediate_size", default=0)
        shared_experts = _int(cfg, "n_shared_experts", default=0)
    except SizingError as exc:
        raise SizingError(f"{path}: {exc}") from None
    named = cfg.get("torch_dtype") or cfg.get("dtype") or outer.get("torch_dtype") or "bfloat16"
    dtype = named if isinstance(named, str) else json.dumps(named)
    width = _DTYPE_BYTES.get(dtype.removeprefix("torch."))
    if width is None:
        shown = repr(dtype) if len(dtype) <= 40 else repr(dtype[:37] + "...")
        raise SizingError(f"{path}: unknown dtype {shown} (known: {', '.join(_DTYPE_BYTES)})")
    # One layer's tensors in Hugging Face export order, as (elements, count) runs: norm, q, k,
    # v, o, norm, then the MLP (gate, up, down; or the router, every expert's three and the
    # shared expert's three).
    q, kv = hidden * heads * head_dim, hidden * kv_heads * head_dim
    layer = [(hidden, 1), (q, 1), (kv, 2), (q, 1), (hidden, 1)]
    if experts:
        shared = shared_inter or shared_experts * moe_inter
        layer += [(experts * hidden, 1), (hidden * moe_inter, 3 * experts)]
        layer += [(hidden * shared, 3)] if shared else []
    else:
        layer += [(hidden * inter, 3)]
    tied = bool(cfg.get("tie_word_embeddings", outer.get("tie_word_embeddings", False)))
    head = 0 if tied else vocab * hidden
    params = vocab * hidden + layers * sum(n * c for n, c in layer) + hidden + head
    if params * width > MAX_MODEL_BYTES:  # exact integers: checked before any float
        raise SizingError(
            f"{path}: the sizes in it give {params:.3g} parameters x {width} bytes: H must be "
            f"at most {MAX_MODEL_TEXT}"
        )
    how = (
        f"estimated from {path.name}: {params / 1e9:.3g}B parameters x {width} bytes ({dtype}); "
        f"{layers} layers, hidden {hidden}, {f'{experts} experts, ' if experts else ''}"
        f"vocabulary {vocab}{', tied head' if tied else ''}"
    )
    count = 2 + layers * sum(c for _, c in layer) + (1 if head else 0)
    tensors: tuple[int, ...] | None = None
    if count <= MAX_TENSORS:  # counted before any list is built
        one = [n * width for n, c in layer for _ in range(c)]
        tensors = (vocab * hidden * width, *layers * one, hidden * width)
        tensors += (head * width,) if head else ()
    return ModelSize(
        params * width,
        head * width or None,
        False,
        how,
        vocab * hidden * width,
        element_bytes=width,
        dtype=dtype,
        tensor_bytes=tensors,
    )
