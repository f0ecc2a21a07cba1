"""Typed decode errors: every malformed payload raises one of these, never a crash or a hang.

All derive from `CodecError(ValueError)`, so a receiver can fail the attempt on any of them with
one `except` while tests and logs still see what exactly was wrong.
"""

from __future__ import annotations


class CodecError(ValueError):
    """A payload could not be encoded or decoded; the message says why."""


class TruncatedPayload(CodecError):  # noqa: N818 - the names of the interface
    """The bytes end before a declared field or buffer does."""


class BadMagic(CodecError):  # noqa: N818 - the names of the interface
    """The bytes do not start with the KubeRefit payload magic."""


class UnsupportedVersion(CodecError):  # noqa: N818 - the names of the interface
    """The payload's codec version is not one this decoder implements."""


class AuthenticationError(CodecError):
    """A payload checked with a key has no MAC, or a MAC that the key did not make."""


class DigestMismatch(CodecError):  # noqa: N818 - the names of the interface
    """The BLAKE2b-128 digest of the compressed body does not match the declared digest."""


class SizeLimitExceeded(CodecError):  # noqa: N818 - the names of the interface
    """A declared size is larger than the body can justify or than the configured limit."""


class DecompressionError(CodecError):
    """The compressed body is not exactly one valid zstd frame of the declared size."""


class SchemaError(CodecError):
    """The decompressed body's structure is inconsistent (tables, offsets, names, codes)."""


class HeaderMismatch(SchemaError):  # noqa: N818 - the names of the interface
    """The plain header and the header copy inside the digested body disagree."""


class MetaMismatch(SchemaError):  # noqa: N818 - the names of the interface
    """An item's name, shape or dtype differs from the receiver's canonical metadata."""


class LocationError(CodecError):
    """Locations are out of range, unsorted, duplicated or inconsistent with the item."""


class EncodeLimitError(CodecError):
    """An item's tensor exceeds the shared structural limits (`refit_protocol.limits`): the
    encoder refuses to write what every receiver would refuse to read."""
