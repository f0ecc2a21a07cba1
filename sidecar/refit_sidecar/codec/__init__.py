"""❸ encode: the bit-exact delta codec.

`records` (XOR / overwrite items), `locations` (runs, gaps, byte planes), `wire` (the versioned
format), `encode` (items into a sealed payload) and, for the receiver's ❺, `decode` (untrusted
bytes back into items) and `decoded_file` (the decoded form a receiver hands to vLLM workers).


Importing the package is cheap: each name is loaded from its module on first use (PEP 562), so
the vLLM bundle, which reads decoded files, never imports the compressor (zstandard).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from refit_sidecar.codec.decode import decode_payload, verify_mac
    from refit_sidecar.codec.encode import PreparedItem, encode_payload, prepare_item, seal_body
    from refit_sidecar.codec.errors import (
        AuthenticationError,
        BadMagic,
        CodecError,
        DecompressionError,
        DigestMismatch,
        HeaderMismatch,
        LocationError,
        MetaMismatch,
        SchemaError,
        SizeLimitExceeded,
        TruncatedPayload,
        UnsupportedVersion,
    )
    from refit_sidecar.codec.records import (
        Item,
        Mode,
        Op,
        TensorMeta,
        apply_item_,
        choose_op,
        diff_item,
        diff_items,
        item_from_diff,
        item_from_positions,
    )
    from refit_sidecar.codec.wire import (
        CODEC_VERSION,
        CodecConfig,
        DecodedPayload,
        DecodeLimits,
        EncodedPayload,
        PayloadHeader,
        peek_header,
    )

#: Public name -> the module of this package that defines it.
_HOME = {
    "AuthenticationError": "errors",
    "BadMagic": "errors",
    "CODEC_VERSION": "wire",
    "CodecConfig": "wire",
    "CodecError": "errors",
    "DecodeLimits": "wire",
    "DecodedPayload": "wire",
    "DecompressionError": "errors",
    "DigestMismatch": "errors",
    "EncodedPayload": "wire",
    "HeaderMismatch": "errors",
    "Item": "records",
    "LocationError": "errors",
    "MetaMismatch": "errors",
    "Mode": "records",
    "Op": "records",
    "PayloadHeader": "wire",
    "PreparedItem": "encode",
    "SchemaError": "errors",
    "SizeLimitExceeded": "errors",
    "TensorMeta": "records",
    "TruncatedPayload": "errors",
    "UnsupportedVersion": "errors",
    "apply_item_": "records",
    "choose_op": "records",
    "decode_payload": "decode",
    "diff_item": "records",
    "diff_items": "records",
    "encode_payload": "encode",
    "item_from_diff": "records",
    "item_from_positions": "records",
    "peek_header": "wire",
    "prepare_item": "encode",
    "seal_body": "encode",
    "verify_mac": "decode",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


__all__ = [
    "CODEC_VERSION",
    "AuthenticationError",
    "BadMagic",
    "CodecConfig",
    "CodecError",
    "DecodeLimits",
    "DecodedPayload",
    "DecompressionError",
    "DigestMismatch",
    "EncodedPayload",
    "HeaderMismatch",
    "Item",
    "LocationError",
    "MetaMismatch",
    "Mode",
    "Op",
    "PayloadHeader",
    "PreparedItem",
    "SchemaError",
    "SizeLimitExceeded",
    "TensorMeta",
    "TruncatedPayload",
    "UnsupportedVersion",
    "apply_item_",
    "choose_op",
    "decode_payload",
    "diff_item",
    "diff_items",
    "encode_payload",
    "item_from_diff",
    "item_from_positions",
    "peek_header",
    "prepare_item",
    "seal_body",
    "verify_mac",
]
