"""`kuberefit operator selftest`: what the chart's `helm test` hook runs.

It asks the webhook, as the API server would, to admit a sample opted-in pod (a dry-run
AdmissionReview: nothing is created anywhere) through the Service or URL the
MutatingWebhookConfiguration names, verifying the serving certificate with the chart's CA. It
passes when the answer injects the sidecar, so one command proves the route, the certificate
(its names and chain) and the injection together. It needs no Kubernetes API access.
"""

from __future__ import annotations

import base64
import json
import ssl
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refit_operator.kube.names import INJECT, POLICY, SIDECAR_CONTAINER

#: The policy the sample pod names: it need not exist (injection then uses the chart defaults).
SAMPLE_POLICY = "kuberefit-selftest"


@dataclass(frozen=True)
class SelfTestResult:
    ok: bool
    lines: list[str]


def sample_review(namespace: str) -> dict[str, Any]:
    """A dry-run AdmissionReview of an opted-in trainer pod in `namespace`."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "kuberefit-selftest",
            "namespace": namespace,
            "annotations": {INJECT: "trainer", POLICY: SAMPLE_POLICY},
        },
        "spec": {"containers": [{"name": "trainer", "image": "selftest", "args": ["train"]}]},
    }
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "namespace": namespace,
            "operation": "CREATE",
            "dryRun": True,
            "object": pod,
        },
    }


def check_answer(answer: dict[str, Any], uid: str) -> SelfTestResult:
    """Whether the webhook's answer admits the sample pod with the sidecar injected."""
    response = answer.get("response") or {}
    if response.get("uid") != uid:
        return SelfTestResult(False, [f"FAIL the answer's uid is {response.get('uid')!r}"])
    if not response.get("allowed"):
        why = (response.get("status") or {}).get("message", "no reason given")
        return SelfTestResult(False, [f"FAIL the sample pod was refused: {why}"])
    patch = json.loads(base64.b64decode(response.get("patch") or "W10="))
    added = [
        op.get("value")
        for op in patch
        if op.get("op") == "add"
        # a native sidecar (Kubernetes 1.29+) is an init container
        and str(op.get("path", "")).startswith(("/spec/containers", "/spec/initContainers"))
    ]
    names = {
        c.get("name")
        for value in added
        for c in (value if isinstance(value, list) else [value])
        if isinstance(c, dict)
    }
    if SIDECAR_CONTAINER not in names:
        return SelfTestResult(False, [f"FAIL the answer does not add {SIDECAR_CONTAINER}"])
    lines = [f"ok   the webhook injects {SIDECAR_CONTAINER} into an opted-in pod"]
    lines += [f"note {w}" for w in response.get("warnings") or []]
    return SelfTestResult(True, lines)


def run_selftest(url: str, ca_file: Path, namespace: str, timeout_s: float) -> SelfTestResult:
    """POST the sample review to `url` (the webhook's /mutate-pods) over verified TLS."""
    if not url.startswith("https://"):
        return SelfTestResult(False, [f"FAIL {url} is not an https:// URL"])
    try:
        context = ssl.create_default_context(cafile=str(ca_file))
    except (OSError, ssl.SSLError) as exc:
        return SelfTestResult(False, [f"FAIL cannot read the CA bundle {ca_file}: {exc}"])
    review = sample_review(namespace)
    request = urllib.request.Request(  # noqa: S310 - https only (checked above)
        url,
        data=json.dumps(review).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as resp:  # noqa: S310
            answer = json.loads(resp.read(1 << 20))
    except urllib.error.HTTPError as exc:
        return SelfTestResult(False, [f"FAIL the webhook answered HTTP {exc.code}: {exc.reason}"])
    except (OSError, ssl.SSLError, ValueError) as exc:
        return SelfTestResult(False, [f"FAIL no answer from {url}: {exc}"])
    reached = f"ok   {url} answers over TLS verified with {ca_file}"
    result = check_answer(answer, review["request"]["uid"])
    return SelfTestResult(result.ok, [reached, *result.lines])
