"""Object storage across clusters: HTTPS to a store with a private CA, plain HTTP refused off
loopback, server-side encryption asked for, and credentials never in a log line.

A real SeaweedFS serves S3 over TLS with a certificate from a test CA (`tests/harness/pki.py`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import botocore.exceptions
import pytest
from pydantic import SecretStr, ValidationError

from refit_sidecar.transport.s3 import S3Config, S3TransportConfig, make_client, upload_payload
from refit_sidecar.transport.selector import TransportSelector
from tests.harness.pki import TestCA
from tests.harness.s3 import S3Server, start_s3
from tests.sidecar.receiver.models import canonical, payloads, perturb


@pytest.fixture(scope="module")
def tls_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    root = tmp_path_factory.mktemp("s3-tls")
    ca = TestCA(root / "pki")
    pair = ca.issue("seaweedfs")
    server = start_s3(root / "s3", tls=(pair.cert_path, pair.key_path, ca.cert_path))
    try:
        yield server
    finally:
        server.process.stop()


def _config(server: S3Server, **extra: object) -> S3Config:
    fields: dict[str, object] = {
        "bucket": "tls-payloads",
        "endpoint_url": server.endpoint_url,
        "access_key_id": SecretStr(server.access_key),
        "secret_access_key": SecretStr(server.secret_key),
        "addressing_style": "path",
        "max_attempts": 1,
        **extra,
    }
    return S3Config.model_validate(fields)


def test_payloads_travel_over_https_with_the_stores_ca(tls_s3: S3Server) -> None:
    assert tls_s3.endpoint_url.startswith("https://")
    assert tls_s3.ca_bundle is not None
    cfg = _config(tls_s3, ca_bundle=tls_s3.ca_bundle)
    client = make_client(cfg)
    client.create_bucket(Bucket=cfg.bucket)
    old = canonical(0, tensors=1, numel=4096)
    [p] = payloads("tls", 0, old, perturb(old, 3))
    upload_payload(client, cfg, "tls/p0.krp", p.body)
    got = client.get_object(Bucket=cfg.bucket, Key="tls/p0.krp")["Body"].read()
    assert got == p.body
    # The same store without its CA: the certificate is not trusted, nothing is sent.
    untrusted = make_client(_config(tls_s3))
    with pytest.raises(botocore.exceptions.SSLError):
        untrusted.head_object(Bucket=cfg.bucket, Key="tls/p0.krp")


def test_server_side_encryption_is_requested_on_every_upload(tls_s3: S3Server) -> None:
    cfg = _config(tls_s3, ca_bundle=tls_s3.ca_bundle, server_side_encryption="AES256")
    assert cfg.encryption_args() == {"ServerSideEncryption": "AES256"}
    client = make_client(cfg)
    sent: list[dict[str, str]] = []
    client.meta.events.register(
        "before-send.s3.*", lambda request, **_: sent.append(dict(request.headers))
    )
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=cfg.bucket)
    small = bytes(range(256)) * 16
    upload_payload(client, cfg, "sse/small.krp", small)  # PUT
    big_cfg = cfg.model_copy(update={"multipart_threshold": 5 << 20, "part_size": 5 << 20})
    upload_payload(client, big_cfg, "sse/big.krp", small * 1300)  # CreateMultipartUpload
    starts = [h for h in sent if "x-amz-server-side-encryption" in {k.lower() for k in h}]
    assert len(starts) >= 2  # the PUT and the multipart start both ask for encryption


def test_insecure_endpoints_and_leaky_settings_are_refused(
    tls_s3: S3Server, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValidationError, match="plain HTTP on a non-loopback host"):
        S3Config(bucket="b" * 3, endpoint_url="http://10.0.0.1:9000")
    assert S3Config(bucket="bbb", endpoint_url="http://10.0.0.1:9000", allow_insecure=True)
    assert S3Config(bucket="bbb", endpoint_url="http://127.0.0.1:9000")  # loopback: tests
    with pytest.raises(ValidationError, match=r"needs s3\.server_side_encryption"):
        S3Config(bucket="bbb", sse_kms_key_id="k")
    cfg = _config(tls_s3, ca_bundle=tls_s3.ca_bundle)
    text = repr(cfg) + str(cfg.model_dump()) + cfg.model_dump_json()
    assert tls_s3.secret_key not in text
    assert tls_s3.secret_key not in capsys.readouterr().err


def test_ca_bundle_must_exist(tmp_path: Path) -> None:
    cfg = S3Config(bucket="bbb", ca_bundle=tmp_path / "missing.pem")
    with pytest.raises(ValueError, match=r"missing\.pem"):
        make_client(cfg)


def test_a_producers_store_check_names_what_to_fix_and_leftovers_are_deleted(
    tls_s3: S3Server,
) -> None:
    """What the operator shows in the policy's Ready condition comes from this check (the
    producer's status), run against the real store: refused keys, an untrusted certificate, a
    missing bucket each say so; a working store says nothing. A producer restarted since an
    attempt still deletes that attempt's objects."""
    good = _config(tls_s3, ca_bundle=tls_s3.ca_bundle, bucket="check-payloads")
    make_client(good).create_bucket(Bucket=good.bucket)

    def problem(cfg: S3Config) -> str:
        selector = TransportSelector(S3TransportConfig(s3=cfg))
        found = selector.check_now()  # what `problem()` runs in the background
        assert selector.problem() == found
        return found

    assert problem(good) == ""
    wrong = good.model_copy(update={"secret_access_key": SecretStr("not-the-secret")})
    assert "refuses the credentials" in problem(wrong)
    assert "certificate is not trusted" in problem(good.model_copy(update={"ca_bundle": None}))
    assert "does not exist" in problem(good.model_copy(update={"bucket": "no-such-bucket"}))
    client = make_client(good)
    for key in ("kuberefit/a-1/p0/1.krp", "kuberefit/a-1/p1/2.krp", "kuberefit/a-2/p0/1.krp"):
        client.put_object(Bucket=good.bucket, Key=key, Body=b"x")
    TransportSelector(S3TransportConfig(s3=good)).leftovers("a-1")
    listed = client.list_objects_v2(Bucket=good.bucket)
    assert [o["Key"] for o in listed.get("Contents", [])] == ["kuberefit/a-2/p0/1.krp"]
