"""What injection gives the sidecars of a policy with `spec.transport: s3`.

Both sidecars get the store's settings in their config (the trainer's under `transport`, the
receiver's as its `s3` section), never a secret in it:

- credentials: from the Secret `spec.s3.credentialsSecret` (keys `AWS_ACCESS_KEY_ID` and
  `AWS_SECRET_ACCESS_KEY`) as environment variables, which boto3's default chain reads; with no
  Secret named, the pod's own identity: the paired container's identity variables
  (`IDENTITY_VARS`: IRSA's `AWS_ROLE_ARN` and `AWS_WEB_IDENTITY_TOKEN_FILE`, EKS Pod Identity's
  `AWS_CONTAINER_CREDENTIALS_FULL_URI`, keys it sets itself) and the mounts holding their token
  files are copied to the sidecar (not `AWS_PROFILE`, config files or endpoint overrides, which
  would point the sidecar at files it lacks or at another store), and instance metadata needs
  nothing. An identity webhook that runs after KubeRefit's (EKS's) sets its variables in every
  container, the sidecar included;
- a private CA: the ConfigMap or Secret key `spec.s3.caBundle` names, mounted read-only at
  `CA_DIR` and passed as `ca_bundle`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from refit_operator.injection.pod import Container
from refit_operator.injection.resources import InjectionRefusedError

Obj = dict[str, Any]
#: The CA bundle's volume and where the sidecar finds it.
CA_VOLUME, CA_DIR = "kuberefit-s3-ca", "/etc/kuberefit/s3-ca"
#: The keys of `spec.s3.credentialsSecret` (boto3 reads these variables).
CREDENTIAL_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
#: Variables of the pod's own identity that point at a token file (its mount is copied too).
TOKEN_FILE_VARS = ("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE")
#: The paired container's variables that make up its cloud identity, copied to the sidecar.
IDENTITY_VARS = frozenset(
    {
        *CREDENTIAL_KEYS,
        *TOKEN_FILE_VARS,
        "AWS_SESSION_TOKEN",
        "AWS_ROLE_ARN",
        "AWS_ROLE_SESSION_NAME",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        "AWS_STS_REGIONAL_ENDPOINTS",
    }
)


class CaBundle(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    source: Literal["configMap", "secret"]
    name: str = Field(min_length=1)
    key: str = Field(min_length=1)


class S3Settings(BaseModel):
    """`spec.s3` as injection writes it into both sidecars (fixed for a pod's life)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bucket: str
    prefix: str
    endpoint_url: str | None
    region: str
    addressing_style: Literal["auto", "path", "virtual"]
    server_side_encryption: Literal["", "AES256", "aws:kms"]
    sse_kms_key_id: str
    allow_insecure: bool
    credentials_secret: str = ""
    ca_bundle: CaBundle | None = None

    def store(self) -> Obj:
        """The sidecars' `S3Config` (refit_sidecar.transport.s3.store), without credentials."""
        out: Obj = self.model_dump(exclude={"credentials_secret", "ca_bundle"})
        if self.ca_bundle is not None:
            out["ca_bundle"] = f"{CA_DIR}/{self.ca_bundle.key}"
        return out

    def digest(self) -> str:
        """A short digest of these settings: the pod's annotation, compared with the policy's
        to report a pod that needs recreating to take a changed `spec.s3`. Fields at their
        defaults are left out, so a field added later (with a default that keeps today's
        behaviour) does not change every pod's digest."""
        text = json.dumps(self.model_dump(mode="json", exclude_defaults=True), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def env(self, paired: Container) -> list[Obj]:
        """The sidecar's credential variables (see the module docstring)."""
        if self.credentials_secret:
            return [
                {
                    "name": key,
                    "valueFrom": {"secretKeyRef": {"name": self.credentials_secret, "key": key}},
                }
                for key in CREDENTIAL_KEYS
            ]
        return [e.model_dump(by_alias=True, exclude_none=True) for e in _identity_env(paired)]

    def volumes(self) -> list[Obj]:
        if self.ca_bundle is None:
            return []
        ca = self.ca_bundle
        items = [{"key": ca.key, "path": ca.key}]
        if ca.source == "secret":
            source: Obj = {"secret": {"secretName": ca.name, "items": items, "defaultMode": 0o444}}
        else:
            source = {"configMap": {"name": ca.name, "items": items, "defaultMode": 0o444}}
        return [{"name": CA_VOLUME, **source}]

    def mounts(self, paired: Container) -> list[Obj]:
        """The CA bundle's mount, and those holding the pod identity's token files."""
        out: list[Obj] = []
        if self.ca_bundle is not None:
            out.append({"name": CA_VOLUME, "mountPath": CA_DIR, "readOnly": True})
        if not self.credentials_secret:
            out += _identity_mounts(paired)
        return out


def _identity_env(paired: Container) -> list[Any]:
    return [e for e in paired.env or [] if e.name in IDENTITY_VARS]


def _identity_mounts(paired: Container) -> list[Obj]:
    files = [
        e.value for e in _identity_env(paired) if e.name in TOKEN_FILE_VARS and e.value is not None
    ]
    out: dict[str, Obj] = {}
    for path in files:
        holding = [m for m in paired.volume_mounts or [] if m.holds(path)]
        if not holding:
            raise InjectionRefusedError(
                f"container {paired.name!r} names the token file {path} of its cloud identity, "
                "which is under none of its volume mounts: the sidecar could not read it (set "
                "spec.s3.credentialsSecret, or mount the token)"
            )
        deepest = max(holding, key=lambda m: len(m.mount_path))
        out[deepest.mount_path] = deepest.read_only_copy()
    return list(out.values())
