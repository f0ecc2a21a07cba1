"""Fixtures of the sidecar tests: payload delivery through the real S3 transport."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness.s3 import S3Server
from tests.harness.s3_payloads import BUCKET, S3Delivery


@pytest.fixture(scope="session")
def payload_s3(s3: S3Server) -> S3Server:
    """The session's SeaweedFS (`s3`) with the payload bucket that `S3Delivery` writes below."""
    s3.client().create_bucket(Bucket=BUCKET)
    return s3


@pytest.fixture
def delivery(payload_s3: S3Server) -> Iterator[S3Delivery]:
    """Real S3 transports below a fresh key prefix, with a real receiver node per attempt;
    everything it made is released (and the prefix emptied) after the test."""
    delivery = S3Delivery(payload_s3)
    try:
        yield delivery
    finally:
        delivery.close()
