"""The parts of a Pod that injection reads, as one validated model (pure).

Injection reads a few fields of a Pod and writes JSON Patch ops at positions it found in them;
everything else in the Pod is left as posted (never re-serialized, so nothing is reordered or
dropped). Those fields are validated here once, with the types of the Kubernetes API (strict:
no coercion), so the code that builds the patch never meets a string where it expects a list.
The API server only ever sends well-typed Pods (it decodes them before admission); the model
is for anyone else who posts to the webhook, and it turns their mistakes into a message that
names the field and what was expected (`describe`).

Fields a Pod may carry that injection does not read are allowed and not validated (`extra`);
a field is `None` when absent or JSON null, as the API server's decoder treats null.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.alias_generators import to_camel

#: Kubernetes string maps (annotations, labels, quantities).
StrMap = dict[str, str]


class ObjectPart(BaseModel):
    """A part of a Kubernetes object: JSON (camelCase) names only, no coercion, other fields
    kept as posted."""

    model_config = ConfigDict(
        alias_generator=to_camel, extra="allow", strict=True, frozen=True, hide_input_in_errors=True
    )


class ObjectMeta(ObjectPart):
    name: str | None = None
    generate_name: str | None = None
    namespace: str | None = None
    annotations: StrMap | None = None
    labels: StrMap | None = None


class EnvVar(ObjectPart):
    name: str
    value: str | None = None
    value_from: dict[str, Any] | None = None


class VolumeMount(ObjectPart):
    name: str
    mount_path: str
    read_only: bool | None = None
    sub_path: str | None = None
    sub_path_expr: str | None = None
    mount_propagation: str | None = None

    def holds(self, path: str) -> bool:
        return path == self.mount_path or path.startswith(self.mount_path.rstrip("/") + "/")

    def read_only_copy(self) -> dict[str, Any]:
        """This mount for another container of the pod, read-only (what it mounts kept)."""
        kept = {
            "subPath": self.sub_path,
            "subPathExpr": self.sub_path_expr,
            "mountPropagation": self.mount_propagation,
        }
        mount = {"name": self.name, "mountPath": self.mount_path, "readOnly": True}
        return mount | {k: v for k, v in kept.items() if v}


class ContainerPort(ObjectPart):
    container_port: int
    name: str | None = None
    protocol: str | None = None


class ResourceRequirements(ObjectPart):
    #: Quantities, which the API server always serializes as strings.
    limits: StrMap | None = None
    requests: StrMap | None = None


class Container(ObjectPart):
    name: str
    image: str | None = None
    command: list[str] | None = None
    args: list[str] | None = None
    env: list[EnvVar] | None = None
    volume_mounts: list[VolumeMount] | None = None
    ports: list[ContainerPort] | None = None
    resources: ResourceRequirements | None = None
    security_context: dict[str, Any] | None = None


class Volume(ObjectPart):
    name: str


class LocalObjectReference(ObjectPart):
    name: str | None = None


class PodSpec(ObjectPart):
    containers: list[Container] | None = None
    init_containers: list[Container] | None = None
    ephemeral_containers: list[Container] | None = None
    volumes: list[Volume] | None = None
    image_pull_secrets: list[LocalObjectReference] | None = None
    security_context: dict[str, Any] | None = None
    restart_policy: str | None = None
    subdomain: str | None = None  # LeaderWorkerSet sets it: its leader's DNS name uses it


class Pod(ObjectPart):
    metadata: ObjectMeta | None = None
    spec: PodSpec | None = None

    @property
    def meta(self) -> ObjectMeta:
        return self.metadata or _NO_META

    @property
    def annotations(self) -> Mapping[str, str]:
        return self.meta.annotations or {}

    @property
    def labels(self) -> Mapping[str, str]:
        return self.meta.labels or {}

    @property
    def pod_spec(self) -> PodSpec:
        return self.spec or _NO_SPEC


_NO_META, _NO_SPEC = ObjectMeta(), PodSpec()


class PodError(ValueError):
    """The object is not a Pod injection can read (the message names the field)."""


def parse_pod(obj: object) -> Pod:
    """`obj` (a Pod as JSON would give it, or an already validated Pod) as a `Pod`."""
    if isinstance(obj, Pod):
        return obj
    try:
        return Pod.model_validate(obj)
    except ValidationError as exc:
        raise PodError(describe(exc, "pod")) from None


#: What each kind of validation error expected, in JSON's words.
_EXPECTED = {
    "string_type": "a string",
    "bool_type": "true or false",
    "int_type": "an integer",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "missing": "a value (the field is required)",
    "string_too_short": "a non-empty string",
}


def describe(exc: ValidationError, root: str = "") -> str:
    """The first error of `exc` as `root.path.to[3].field: expected X, got Y` (JSON names)."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    where = root
    for part in first["loc"]:
        where += f"[{part}]" if isinstance(part, int) else f".{part}" if where else str(part)
    where = where or "(top level)"
    if len(where) > 160:  # a hostile key in a map: the message stays one readable line
        where = where[:160] + "..."
    got = "nothing" if first["type"] == "missing" else _json_type(first.get("input"))
    expected = _EXPECTED.get(first["type"])
    if expected is None and first["type"] == "literal_error":
        expected = str((first.get("ctx") or {}).get("expected", "another value"))
    if expected is None:
        expected = first["msg"]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: expected {expected}, got {got}{more}"


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({str(value)[:20]})"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:40] + "..."
        return f"a string ({shown!r})"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
