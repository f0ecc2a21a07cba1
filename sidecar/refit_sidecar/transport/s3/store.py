"""The object store of the S3 transport: settings, client, object keys, upload, delete, fetch.

Both sides use it: producers upload (`upload_payload`, multipart above a threshold), receivers
fetch (`S3Fetcher`, never more bytes than the manifest announced), the sender deletes an
attempt's objects (`delete_prefix`). `endpoint_url` makes any S3-compatible store work
(SeaweedFS in tests).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal
from urllib.parse import quote, urlsplit

import structlog
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from refit_protocol.kit.auth import is_loopback_host
from refit_protocol.kit.config_files import ConfigPath
from refit_protocol.sizes import ByteSize
from refit_sidecar.transport.errors import PayloadRejectedError, TransportError

log = structlog.get_logger("kuberefit.transport.s3")

MIB = 1 << 20


class S3Config(BaseModel):
    """Where payload objects live and how to reach the store (both producers and receivers)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bucket: str = Field(
        min_length=3,
        description="Bucket for payload objects (must exist).",
        examples=["kuberefit-payloads"],
    )
    prefix: str = Field(default="kuberefit", description="Key prefix; objects go below it.")
    endpoint_url: str | None = Field(
        default=None, description="S3-compatible endpoint (None: AWS for `region`)."
    )
    region: str = Field(default="us-east-1", description="Signing region.")
    access_key_id: SecretStr | None = Field(
        default=None, description="Static credentials; None uses boto3's default chain."
    )
    secret_access_key: SecretStr | None = Field(
        default=None, description="Secret of `access_key_id` (give both or neither)."
    )
    addressing_style: Literal["auto", "path", "virtual"] = Field(
        default="auto",
        description="Bucket in the path (most S3-compatible stores) or in the host name "
        "(virtual); auto lets botocore choose.",
    )
    multipart_threshold: ByteSize = Field(
        default=64 * MIB, ge=5 * MIB, description="Payloads larger than this upload in parts."
    )
    part_size: ByteSize = Field(default=64 * MIB, ge=5 * MIB, description="Multipart part size.")
    upload_concurrency: int = Field(default=4, ge=1, description="Parts uploaded in parallel.")
    max_attempts: int = Field(default=3, ge=1, description="botocore attempts per request.")
    connect_timeout_s: float = Field(default=10.0, gt=0, description="TCP connect timeout.")
    read_timeout_s: float = Field(
        default=120.0, gt=0, description="Longest wait for the next bytes of an answer."
    )
    ca_bundle: ConfigPath | None = Field(
        default=None,
        description="PEM file of the CA(s) that signed the endpoint's certificate (a private "
        "object store); None: the system's trust store.",
    )
    allow_insecure: bool = Field(
        default=False,
        description="Allow a plain http:// endpoint that is not on loopback (never in "
        "production: credentials and payload bytes would cross the network in clear).",
    )
    server_side_encryption: Literal["", "AES256", "aws:kms"] = Field(
        default="", description="Ask the store to encrypt objects at rest ('' : bucket default)."
    )
    sse_kms_key_id: str = Field(
        default="", description="KMS key for server_side_encryption aws:kms ('' : the default)."
    )

    @model_validator(mode="after")
    def _secure_endpoint(self) -> S3Config:
        url = urlsplit(self.endpoint_url or "https://s3.amazonaws.com")
        if url.scheme not in ("http", "https"):
            raise ValueError(f"s3.endpoint_url must be http(s)://, got {self.endpoint_url!r}")
        if url.scheme == "http" and not (
            is_loopback_host(url.hostname or "") or self.allow_insecure
        ):
            raise ValueError(
                f"s3.endpoint_url {self.endpoint_url} is plain HTTP on a non-loopback host: use "
                "https:// (with s3.ca_bundle for a private CA), or set s3.allow_insecure"
            )
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError(
                "s3.access_key_id and s3.secret_access_key go together: give both, or neither "
                "for boto3's default credential chain"
            )
        if self.sse_kms_key_id and self.server_side_encryption != "aws:kms":
            raise ValueError("s3.sse_kms_key_id needs s3.server_side_encryption: aws:kms")
        return self

    def encryption_args(self) -> dict[str, str]:
        """Extra arguments of PUT and CreateMultipartUpload for server-side encryption."""
        args: dict[str, str] = {}
        if self.server_side_encryption:
            args["ServerSideEncryption"] = self.server_side_encryption
        if self.sse_kms_key_id:
            args["SSEKMSKeyId"] = self.sse_kms_key_id
        return args


def make_client(cfg: S3Config) -> Any:
    """A boto3 S3 client for `cfg` (thread-safe; create one per process and share it)."""
    import boto3
    from botocore.config import Config

    if cfg.ca_bundle is not None and not cfg.ca_bundle.is_file():
        raise ValueError(f"s3.ca_bundle {cfg.ca_bundle} is not a readable file")
    kwargs: dict[str, Any] = {}
    if cfg.access_key_id is not None and cfg.secret_access_key is not None:
        kwargs["aws_access_key_id"] = cfg.access_key_id.get_secret_value()
        kwargs["aws_secret_access_key"] = cfg.secret_access_key.get_secret_value()
    # A session of its own: boto3's default session is not thread-safe, and clients are made
    # from several threads (transports, the store check, cleanup of leftovers).
    return boto3.session.Session().client(
        "s3",
        endpoint_url=cfg.endpoint_url,
        region_name=cfg.region,
        verify=str(cfg.ca_bundle) if cfg.ca_bundle is not None else True,
        config=Config(
            retries={"max_attempts": cfg.max_attempts, "mode": "standard"},
            s3={"addressing_style": cfg.addressing_style},
            connect_timeout=cfg.connect_timeout_s,
            read_timeout=cfg.read_timeout_s,
            max_pool_connections=max(10, cfg.upload_concurrency * 2),
            # Integrity is the BLAKE2b-128 digest every receiver checks; extra CRCs buy nothing.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
        **kwargs,
    )


#: Error codes of a store that does not accept the credentials (a HEAD answers a bare 403).
DENIED = frozenset(
    {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken"}
)


def store_problem(cfg: S3Config) -> str:
    """Why the producer could not use the store ("" : it can list its prefix). Names the cause
    a user fixes: the credentials, the CA, the bucket, the endpoint. Listing the prefix (one
    key at most) is what the attempt cleanup needs anyway, and what a least-privilege policy
    (ListBucket limited to the prefix, Put/Get/Delete on it) allows; a quick check: one try,
    short timeouts."""
    import botocore.exceptions

    quick = cfg.model_copy(
        update={
            "max_attempts": 1,
            "connect_timeout_s": min(cfg.connect_timeout_s, 5.0),
            "read_timeout_s": min(cfg.read_timeout_s, 15.0),
        }
    )
    where = f"S3 bucket {cfg.bucket} at {cfg.endpoint_url or f'AWS {cfg.region}'}"
    try:
        make_client(quick).list_objects_v2(Bucket=cfg.bucket, Prefix=root_prefix(cfg), MaxKeys=1)
    except botocore.exceptions.ClientError as exc:
        error = exc.response.get("Error", {})
        code = str(error.get("Code") or "")
        if code in DENIED:
            return (
                f"{where} refuses the credentials ({code}): check the access key and secret "
                f"(or the pod's cloud identity) and that they may list {root_prefix(cfg)}"
            )
        if code in ("404", "NoSuchBucket"):
            return f"{where} does not exist: create it (KubeRefit never creates buckets)"
        return f"{where}: {code} {error.get('Message') or ''}".rstrip()
    except botocore.exceptions.SSLError:
        return (
            f"{where}: the endpoint's certificate is not trusted (a private CA needs its "
            "bundle: s3.ca_bundle)"
        )
    except botocore.exceptions.NoCredentialsError:
        return (
            f"{where}: no credentials found (static keys, AWS_ACCESS_KEY_ID/"
            "AWS_SECRET_ACCESS_KEY, a web identity or instance metadata)"
        )
    except (botocore.exceptions.BotoCoreError, ValueError) as exc:
        return f"{where}: {type(exc).__name__}: {str(exc)[:300]}"
    return ""


def root_prefix(cfg: S3Config) -> str:
    """Where every KubeRefit object of this store lies (the store check lists it)."""
    return f"{cfg.prefix.strip('/')}/"


def attempt_prefix(cfg: S3Config, attempt: str) -> str:
    return f"{root_prefix(cfg)}{quote(attempt, safe='')}/"


def object_key(cfg: S3Config, attempt: str, producer: int, payload_id: int, digest: str) -> str:
    """One key per payload identity and content: a retry with other bytes cannot overwrite."""
    return f"{attempt_prefix(cfg, attempt)}p{producer}/{payload_id:012d}-{digest[:16]}.krp"


def upload_payload(client: Any, cfg: S3Config, key: str, body: bytes) -> None:
    """PUT one object, multipart above the threshold (aborted on any failure)."""
    if len(body) <= cfg.multipart_threshold:
        client.put_object(Bucket=cfg.bucket, Key=key, Body=body, **cfg.encryption_args())
        return
    mpu = client.create_multipart_upload(Bucket=cfg.bucket, Key=key, **cfg.encryption_args())
    upload_id = mpu["UploadId"]
    mv = memoryview(body)
    ranges = [(i + 1, off) for i, off in enumerate(range(0, len(body), cfg.part_size))]

    def part(number: int, off: int) -> dict[str, Any]:
        chunk = bytes(mv[off : off + cfg.part_size])
        resp = client.upload_part(
            Bucket=cfg.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=chunk
        )
        return {"ETag": resp["ETag"], "PartNumber": number}

    try:
        with ThreadPoolExecutor(cfg.upload_concurrency, thread_name_prefix="s3-part") as pool:
            parts = list(pool.map(lambda r: part(*r), ranges))
        client.complete_multipart_upload(
            Bucket=cfg.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
        )
    except BaseException:
        try:
            client.abort_multipart_upload(Bucket=cfg.bucket, Key=key, UploadId=upload_id)
        except Exception as exc:  # the leftover sweep at stream end retries it
            log.warning("s3.abort_failed", key=key, error=str(exc))
        raise


def delete_prefix(client: Any, bucket: str, prefix: str) -> int:
    """Delete every object and abort every multipart upload below `prefix`; returns objects."""
    deleted = 0
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            resp = client.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
            errors = resp.get("Errors", [])
            if errors:
                raise TransportError(f"S3 delete failed for {len(errors)} objects: {errors[0]}")
            deleted += len(batch)
    abort_uploads(client, bucket, prefix)
    return deleted


def abort_uploads(client: Any, bucket: str, prefix: str) -> int:
    """Abort incomplete multipart uploads below `prefix` (they cost storage until aborted)."""
    aborted = 0
    resp = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix)
    for up in resp.get("Uploads", []):
        client.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
        aborted += 1
    return aborted


class S3Fetcher:
    """Receiver-side downloads with the node's own client."""

    def __init__(self, cfg: S3Config, client: Any | None = None) -> None:
        self.cfg = cfg
        self.client = client if client is not None else make_client(cfg)

    def fetch(self, bucket: str, key: str, size: int) -> bytes:
        if bucket != self.cfg.bucket:
            raise PayloadRejectedError(f"bucket {bucket!r} is not the configured payload bucket")
        resp = self.client.get_object(Bucket=bucket, Key=key)
        # The store is not trusted with sizes either: never read more than the manifest said.
        length = int(resp.get("ContentLength", size))
        if length != size:
            resp["Body"].close()
            raise PayloadRejectedError(f"{key}: object has {length} bytes, manifest says {size}")
        data: bytes = resp["Body"].read(size + 1)
        if len(data) != size:
            raise PayloadRejectedError(f"{key}: {len(data)} bytes, manifest says {size}")
        return data
