"""❹ the `s3` transport: one object per payload plus a manifest pointer to every receiver.

- `store`: settings, client, object keys, upload, delete and the bounded fetch (both sides);
- `sender`: the producer's `S3Transport` (upload, announce, stream end, leftovers, cleanup);
- `inbound`: a rollout node's `S3Inbound` (manifest and stream-end routes, downloads);
- `plugin`: the kind as the registry sees it (`S3Plugin`).
"""

from __future__ import annotations

from refit_sidecar.transport.s3.sender import S3Transport, S3TransportConfig
from refit_sidecar.transport.s3.store import (
    MIB,
    S3Config,
    S3Fetcher,
    abort_uploads,
    attempt_prefix,
    delete_prefix,
    make_client,
    object_key,
    upload_payload,
)

__all__ = [
    "MIB",
    "S3Config",
    "S3Fetcher",
    "S3Transport",
    "S3TransportConfig",
    "abort_uploads",
    "attempt_prefix",
    "delete_prefix",
    "make_client",
    "object_key",
    "upload_payload",
]
