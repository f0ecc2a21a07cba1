"""The harness uses the product's SeaweedFS launcher (`kuberefit demo --transport s3` does too)."""

from refit_tools.local.s3 import S3Server, start_s3, weed_binary

__all__ = ["S3Server", "start_s3", "weed_binary"]
