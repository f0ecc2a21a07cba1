"""AdmissionReview (admission.k8s.io/v1) in and out, as pure functions.

The API server posts a review; the answer carries the same `uid`, `allowed`, an optional
base64 JSON Patch, warnings (kubectl prints them) and, for a refusal, a status message.
Anything malformed raises ReviewError, which the server answers with HTTP 400.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from refit_operator.injection.patch import Injection

API_VERSION = "admission.k8s.io/v1"
#: Kubernetes caps a warning at 256 characters (longer ones are truncated by the API server).
MAX_WARNING = 256


class ReviewError(ValueError):
    """The request is not an AdmissionReview this webhook can answer."""


@dataclass(frozen=True)
class PodAdmission:
    """The parts of a review the injector needs."""

    uid: str
    namespace: str
    operation: str
    pod: Mapping[str, Any]
    dry_run: bool


def parse_review(body: bytes) -> PodAdmission:
    try:
        review = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ReviewError(f"body is not JSON: {type(exc).__name__}") from None
    if not isinstance(review, dict) or review.get("kind") != "AdmissionReview":
        raise ReviewError("body is not an AdmissionReview")
    if review.get("apiVersion") != API_VERSION:
        raise ReviewError(f"AdmissionReview {review.get('apiVersion')}: only {API_VERSION}")
    request = review.get("request")
    if not isinstance(request, dict) or not request.get("uid"):
        raise ReviewError("AdmissionReview has no request.uid")
    kind = request.get("kind") or {}
    pod = request.get("object")
    if kind.get("kind") != "Pod" or not isinstance(pod, dict):
        raise ReviewError(f"expected a Pod, got {kind.get('kind')!r}")
    namespace = str(request.get("namespace") or (pod.get("metadata") or {}).get("namespace"))
    return PodAdmission(
        uid=str(request["uid"]),
        namespace=namespace,
        operation=str(request.get("operation") or ""),
        pod=pod,
        dry_run=bool(request.get("dryRun")),
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
