"""AdmissionReview (admission.k8s.io/v1) in and out, as pure functions.

The API server posts a review; the answer carries the same `uid`, `allowed`, an optional
base64 JSON Patch, warnings (kubectl prints them) and, for a refusal, a status message.
Anything malformed raises ReviewError, which the server answers with HTTP 400: the body is
parsed as strict JSON (pydantic-core's parser: no NaN, no lone surrogates, nesting deeper than
200 levels refused, where a review's deepest field is about 20 down) and validated by one
model, `AdmissionReview` (its Pod is `injection.pod.Pod`), so the message names the field that
is wrong and what was expected.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, ValidationError
from pydantic_core import from_json

from refit_operator.injection.patch import Injection
from refit_operator.injection.pod import ObjectPart, Pod, describe

API_VERSION = "admission.k8s.io/v1"
#: Kubernetes caps a warning at 256 characters (longer ones are truncated by the API server).
MAX_WARNING = 256


class ReviewError(ValueError):
    """The request is not an AdmissionReview this webhook can answer."""


class PodKind(ObjectPart):
    """`request.kind`: this webhook is registered for Pods only."""

    group: str | None = None
    version: str | None = None
    kind: Literal["Pod"]


class AdmissionRequest(ObjectPart):
    uid: str = Field(min_length=1)
    kind: PodKind  # before `object`: a review of another kind is told so first
    namespace: str | None = None
    operation: str | None = None
    dry_run: bool | None = None
    pod: Pod = Field(alias="object")


class AdmissionReview(ObjectPart):
    """The review as posted (`admission.k8s.io/v1`), its Pod as injection reads it."""

    api_version: Literal["admission.k8s.io/v1"]
    kind: Literal["AdmissionReview"]
    request: AdmissionRequest


@dataclass(frozen=True)
class PodAdmission:
    """The parts of a review the injector needs."""

    uid: str
    namespace: str
    operation: str
    #: The Pod as validated (what injection reads).
    pod: Pod
    #: The Pod as posted (what the API server applies the patch to).
    posted: Mapping[str, Any]
    dry_run: bool


def parse_review(body: bytes) -> PodAdmission:
    try:
        review = from_json(body, allow_inf_nan=False)
    except ValueError as exc:
        raise ReviewError(f"body is not JSON: {str(exc)[:200]}") from None
    try:
        request = AdmissionReview.model_validate(review).request
    except ValidationError as exc:
        raise ReviewError(f"malformed AdmissionReview: {describe(exc)}") from None
    pod = request.pod
    return PodAdmission(
        uid=request.uid,
        namespace=request.namespace or pod.meta.namespace or "",
        operation=request.operation or "",
        pod=pod,
        posted=review["request"]["object"],
        dry_run=bool(request.dry_run),
    )


def review_response(uid: str, injection: Injection) -> dict[str, Any]:
    """The AdmissionReview answer for one injection decision."""
    response: dict[str, Any] = {"uid": uid, "allowed": injection.denied is None}
    if injection.denied is not None:
        response["status"] = {"code": 400, "reason": "BadRequest", "message": injection.denied}
    elif injection.patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(injection.patch).encode()).decode()
    if injection.warnings:
        response["warnings"] = [w[:MAX_WARNING] for w in injection.warnings]
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}
