"""❸ encode: the bit-exact delta codec.

`records` (XOR / overwrite items), `locations` (runs, gaps, byte planes), `wire` (the versioned
format), `encode` (items into a sealed payload) and, for the receiver's ❺, `decode` (untrusted
bytes back into items) and `decoded_file` (the decoded form a receiver hands to vLLM workers).
"""

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
