"""The harness's S3 server is real SeaweedFS: multipart works and signatures are checked."""

from __future__ import annotations

import hashlib
import io
import os

import pytest
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import ClientError

from tests.harness.s3 import S3Server


def test_multipart_roundtrip_20mb_with_checksum(s3: S3Server) -> None:
    c = s3.client()
    c.create_bucket(Bucket="smoke-multipart")
    data = os.urandom(20 * 2**20)
    cfg = TransferConfig(multipart_threshold=5 * 2**20, multipart_chunksize=5 * 2**20)
    c.upload_fileobj(
        io.BytesIO(data),
        "smoke-multipart",
        "blob",
        Config=cfg,
        ExtraArgs={"ChecksumAlgorithm": "SHA256"},
    )
    head = c.head_object(Bucket="smoke-multipart", Key="blob")
    assert head["ContentLength"] == len(data)
    assert head["ETag"].strip('"').endswith("-4")  # four 5 MiB parts: really multipart
    out = io.BytesIO()
    c.download_fileobj("smoke-multipart", "blob", out)
    assert hashlib.sha256(out.getvalue()).digest() == hashlib.sha256(data).digest()
    c.delete_object(Bucket="smoke-multipart", Key="blob")
    assert c.list_objects_v2(Bucket="smoke-multipart").get("KeyCount", 0) == 0


def test_wrong_secret_is_rejected(s3: S3Server) -> None:
    with pytest.raises(ClientError) as err:
        s3.client(secret_key="not-the-secret").list_buckets()
    assert err.value.response["Error"]["Code"] in {"SignatureDoesNotMatch", "AccessDenied"}
