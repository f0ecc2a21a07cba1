"""A RefitPolicy's spec as a typed model, and the checks its schema cannot express.

Kubernetes 1.20 has no CEL, so rules that span fields (S3 settings are required with transport
`s3`) are checked here; the operator reports a failure in the policy's Ready condition with
reason `InvalidSpec` and a message that names the field. Defaults equal the CRD's, so a spec
written before a default existed reads the same.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from refit_operator.injection.s3 import CaBundle, S3Settings
from refit_operator.transition_types import CoordinatorConfig
from refit_protocol.producer_api import StreamSettings
from refit_protocol.sizes import AUTO, SizeOrAuto
from refit_protocol.transports import TransportKind


class _Spec(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class SelectorRequirement(_Spec):
    key: str
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = Field(default_factory=list)


class LabelSelector(_Spec):
    """A Kubernetes label selector; the empty selector matches every pod."""

    match_labels: dict[str, str] = Field(default_factory=dict)
    match_expressions: list[SelectorRequirement] = Field(default_factory=list)

    def matches(self, labels: dict[str, str]) -> bool:
        if any(labels.get(k) != v for k, v in self.match_labels.items()):
            return False
        for req in self.match_expressions:
            present = req.key in labels
            if req.operator == "Exists" and not present:
                return False
            if req.operator == "DoesNotExist" and present:
                return False
            if req.operator == "In" and (not present or labels[req.key] not in req.values):
                return False
            if req.operator == "NotIn" and present and labels[req.key] in req.values:
                return False
        return True


class Selectors(_Spec):
    trainer: LabelSelector = Field(default_factory=LabelSelector)
    rollout: LabelSelector = Field(default_factory=LabelSelector)


class SecretKeyRef(_Spec):
    name: str = Field(min_length=1)
    key: str = "token"


class CaBundleRef(_Spec):
    """Where the PEM of the CA(s) that signed a private store's certificate lives: a key of a
    ConfigMap or of a Secret in the policy's namespace (exactly one of the two)."""

    config_map: str = ""
    secret: str = ""
    #: A ConfigMap/Secret key (the API server's rule; not `.` or `..`, checked below).
    key: str = Field("ca.crt", max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")

    @model_validator(mode="after")
    def _one_source(self) -> CaBundleRef:
        if bool(self.config_map) == bool(self.secret):
            raise ValueError("spec.s3.caBundle names exactly one of configMap and secret")
        if self.key in (".", ".."):
            raise ValueError(f"spec.s3.caBundle.key {self.key!r} is not a key")
        return self


class S3Spec(_Spec):
    """Where payload objects go and how the sidecars reach the store (docs/transports.md)."""

    bucket: str = ""
    endpoint_url: str = Field("", alias="endpointUrl")
    region: str = "us-east-1"
    prefix: str = "kuberefit"
    #: A Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; "" : the pod's own identity.
    credentials_secret: str = ""
    ca_bundle: CaBundleRef | None = None
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    server_side_encryption: Literal["", "AES256", "aws:kms"] = ""
    sse_kms_key_id: str = Field("", alias="sseKmsKeyId")
    allow_insecure: bool = False

    @model_validator(mode="after")
    def _coherent(self) -> S3Spec:
        if self.sse_kms_key_id and self.server_side_encryption != "aws:kms":
            raise ValueError("spec.s3.sseKmsKeyId needs spec.s3.serverSideEncryption: aws:kms")
        url = self.endpoint_url
        if url and not url.startswith(("https://", "http://")):
            raise ValueError(f"spec.s3.endpointUrl must be http(s)://host[:port], got {url!r}")
        if url.startswith("http://") and not self.allow_insecure:
            raise ValueError(
                f"spec.s3.endpointUrl {url} is plain HTTP: credentials and payloads would cross "
                "the network in clear; use https:// (spec.s3.caBundle for a private CA), or set "
                "spec.s3.allowInsecure"
            )
        return self

    def injected(self) -> S3Settings:
        """These settings as injection writes them into the sidecars."""
        ca = self.ca_bundle
        return S3Settings(
            bucket=self.bucket,
            prefix=self.prefix,
            endpoint_url=self.endpoint_url or None,
            region=self.region,
            addressing_style=self.addressing_style,
            server_side_encryption=self.server_side_encryption,
            sse_kms_key_id=self.sse_kms_key_id,
            allow_insecure=self.allow_insecure,
            credentials_secret=self.credentials_secret,
            ca_bundle=None
            if ca is None
            else CaBundle(
                source="secret" if ca.secret else "configMap",
                name=ca.secret or ca.config_map,
                key=ca.key,
            ),
        )


class EncodingSpec(_Spec):
    zstd_level: int = Field(1, ge=1, le=22)
    shuffle: bool = True


class SecuritySpec(_Spec):
    """How the relay tree's links are protected (docs/security.md, "Links")."""

    intra_cluster: Literal["mac", "encrypted"] = "mac"


class BaselineSpec(_Spec):
    storage: Literal["file", "memory"] = "file"


class RestoreSpec(_Spec):
    checkpoint_template: str = ""


class VerifySpec(_Spec):
    every_versions: int = Field(0, ge=0)


class PolicySpec(_Spec):
    """`spec` of a RefitPolicy (field names as in the CRD, camelCase)."""

    selector: Selectors = Field(default_factory=Selectors)
    producers: int = Field(1, ge=1)
    token_secret: SecretKeyRef
    transport: TransportKind = "zmq"
    s3: S3Spec | None = None
    encoding: EncodingSpec = Field(default_factory=EncodingSpec)
    security: SecuritySpec = Field(default_factory=SecuritySpec)
    chunk_bytes: SizeOrAuto = AUTO  # auto: sized from the checkpoint (baseline/sizing.py)
    bucket_bytes: SizeOrAuto = AUTO
    baseline: BaselineSpec = Field(default_factory=BaselineSpec)
    post_apply_checks: int = Field(0, ge=-1)
    mode: Literal["sync", "async"] = "sync"
    restore: RestoreSpec = Field(default_factory=RestoreSpec)
    verify: VerifySpec = Field(default_factory=VerifySpec)
    commit_timeout_seconds: int = Field(600, ge=1)
    control_timeout_seconds: int = Field(60, ge=1)
    flush_timeout_seconds: int = Field(600, ge=1)
    max_attempts: int = Field(5, ge=1)
    rejected_backoff_seconds: int = Field(5, ge=1)
    paused: bool = False
    keep_transitions: int = Field(20, ge=1)
    token_rotation_grace_seconds: int = Field(300, ge=1)

    @model_validator(mode="after")
    def _cross_field(self) -> PolicySpec:
        if self.transport == "s3" and (self.s3 is None or len(self.s3.bucket) < 3):
            raise ValueError(
                "spec.s3.bucket is required when spec.transport is s3 (a bucket name of 3 to "
                "63 characters)"
            )
        template = self.restore.checkpoint_template
        if self.verify.every_versions and not template:
            raise ValueError(
                "spec.verify.everyVersions needs spec.restore.checkpointTemplate: the committed "
                "checkpoint every rollout node is audited against"
            )
        if template and "{version}" not in template:
            raise ValueError(
                "spec.restore.checkpointTemplate must contain {version}, e.g. /ckpt/v{version}"
            )
        return self

    def coordinator_config(self) -> CoordinatorConfig:
        return CoordinatorConfig(
            sync=self.mode == "sync",
            relay_tree=self.transport == "zmq",
            intra_cluster=self.security.intra_cluster,
            commit_timeout_s=float(self.commit_timeout_seconds),
            control_timeout_s=float(self.control_timeout_seconds),
            flush_timeout_s=float(self.flush_timeout_seconds),
            max_attempts=self.max_attempts,
            check_samples=self.post_apply_checks,
        )

    def s3_settings(self) -> S3Settings | None:
        """What injection gives the sidecars for the store (None unless transport is s3)."""
        return self.s3.injected() if self.transport == "s3" and self.s3 is not None else None

    def stream_settings(self) -> StreamSettings:
        """What every attempt's plan tells the trainer sidecars (they follow the spec)."""
        return StreamSettings(
            zstd_level=self.encoding.zstd_level,
            shuffle=self.encoding.shuffle,
            bucket_bytes=self.bucket_bytes,
        )


class SpecError(ValueError):
    """The spec violates a rule; the message names the field (`spec.<path>`)."""


def parse_spec(spec: dict[str, object]) -> PolicySpec:
    """Validate a RefitPolicy spec; raises SpecError naming the first bad field."""
    try:
        return PolicySpec.model_validate(spec)
    except ValidationError as exc:
        messages = []
        for err in exc.errors():
            path = ".".join(str(p) for p in err["loc"])
            where = f"spec.{path}" if path else "spec"
            msg = str(err["msg"]).removeprefix("Value error, ")
            messages.append(msg if msg.startswith("spec.") else f"{where}: {msg}")
        raise SpecError("; ".join(messages)) from None
