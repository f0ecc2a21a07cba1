"""The harness uses the product's SeaweedFS launcher (`kuberefit demo --transport s3` does too),
and these helpers to point the product's S3 settings at it."""

from __future__ import annotations

from typing import Any

from pydantic import SecretStr

from refit_sidecar.transport.s3 import S3Config
from refit_tools.local.s3 import S3Server, start_s3, weed_binary

__all__ = ["S3Server", "node_settings", "start_s3", "store_config", "weed_binary"]


def store_config(server: S3Server, bucket: str, **settings: Any) -> S3Config:
    """Payload-store settings for `bucket` on `server` (its keys, path-style addressing);
    `settings` override or add fields."""
    return S3Config(
        bucket=bucket,
        endpoint_url=server.endpoint_url,
        access_key_id=SecretStr(server.access_key),
        secret_access_key=SecretStr(server.secret_key),
        addressing_style="path",
        **settings,
    )


def node_settings(config: S3Config) -> dict[str, Any]:
    """`config` as a receiver's settings file spells it (its secrets written out)."""
    out = config.model_dump(mode="json")
    for name in ("access_key_id", "secret_access_key"):
        secret = getattr(config, name)
        out[name] = secret.get_secret_value() if secret is not None else None
    return out
