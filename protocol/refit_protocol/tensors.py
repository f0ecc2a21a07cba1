"""Canonical tensor identities on the wire, and the one table of dtype names the codec carries.

A canonical tensor is an HF name, a shape and a dtype. Control-plane messages spell the dtype as
torch does without its prefix ("bfloat16"); safetensors headers use their own tags ("BF16").
Both spellings of every dtype KubeRefit carries live here, once: the operator reads checkpoint
headers with them (no torch), the data plane maps the names to torch dtypes.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, model_validator

from refit_protocol.limits import limit_violation, shown_name

#: safetensors dtype tag -> dtype name (torch's, without "torch."): every dtype of the codec.
SAFETENSORS_DTYPES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
}
#: Every dtype name the codec carries.
DTYPE_NAMES: frozenset[str] = frozenset(SAFETENSORS_DTYPES.values())


class TensorMetaModel(BaseModel):
    """A canonical tensor's identity: HF name, shape, dtype name (e.g. "bfloat16").

    Only what the codec can carry validates: a dtype of `DTYPE_NAMES` and a name and shape
    within the shared limits (`refit_protocol.limits`), so a receiver refuses anything else
    with a 400 before it allocates or asks its runtime.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    shape: tuple[NonNegativeInt, ...]
    dtype: str

    @model_validator(mode="after")
    def _carried(self) -> TensorMetaModel:
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(
                f"{shown_name(self.name)}: dtype {self.dtype!r} is not carried by the codec"
            )
        reason = limit_violation(self.name, self.shape)
        if reason is not None:
            raise ValueError(f"{shown_name(self.name)}: {reason}")
        return self
