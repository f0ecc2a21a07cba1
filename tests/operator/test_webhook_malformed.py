"""Hostile and malformed AdmissionReviews, over the webhook's real HTTP endpoint (issue 34).

The API server only ever sends well-typed Pods (it decodes them before admission), but anyone
who can reach the webhook's port can post anything. Whatever is posted, the answer is an
AdmissionReview (HTTP 200: allowed, or denied with a reason) or HTTP 400 naming the field that
is wrong and what was expected; never a 500, and the server keeps serving. `inject`, a pure
function, never raises whatever it is given.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import http.client
import json
import threading
from collections.abc import Iterator
from typing import Any

import aiohttp
import jsonpatch
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refit_operator.injection import Injection, InjectionConfig, PolicyFacts, inject
from refit_operator.injection.config import TokenSecretRef
from refit_operator.webhook import MAX_REVIEW_BYTES, PATH, webhook_app
from tests.operator.test_webhook import SlowApiServerFault

CFG = InjectionConfig()
POLICY = PolicyFacts(exists=True, token_secret=TokenSecretRef(name="alpha-token"), producers=2)


def _rollout_pod() -> dict[str, Any]:
    """A rollout pod that exercises every part of the pod injection reads."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": "rollout-",
            "namespace": "rl",
            "labels": {"app": "rollout"},
            "annotations": {
                "kuberefit.io/inject": "rollout",
                "kuberefit.io/policy": "alpha",
                "kuberefit.io/sidecar-cpu": "500m",
            },
        },
        "spec": {
            "securityContext": {"runAsUser": 0},
            "imagePullSecrets": [{"name": "regcred"}],
            "initContainers": [{"name": "fetch", "image": "busybox", "command": ["true"]}],
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai",
                    "command": ["vllm", "serve"],
                    "args": ["/models/v0", "--port", "8000"],
                    "env": [
                        {"name": "PYTHONPATH", "value": "/app"},
                        {"name": "HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    ],
                    "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
                    "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
                    "resources": {"limits": {"cpu": "8", "memory": "64Gi"}},
                    "securityContext": {"allowPrivilegeEscalation": False},
                }
            ],
            "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
        },
    }


def _trainer_pod() -> dict[str, Any]:
    pod = _rollout_pod()
    pod["metadata"]["annotations"] = {
        "kuberefit.io/inject": "trainer",
        "kuberefit.io/policy": "alpha",
        "kuberefit.io/producer-index": "0",
        "kuberefit.io/reference-checkpoint": "/models/v0",
    }
    container = pod["spec"]["containers"][0]
    container["name"], container["command"], container["args"] = "train", ["torchrun"], ["t.py"]
    return pod


def _review(pod: Any, **request: Any) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u-1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "rl",
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:rl:deployer"},
            "object": pod,
            "dryRun": False,
            **request,
        },
    }


class Served:
    """The webhook app on a free loopback port, in an event loop of its own thread, so that
    synchronous (hypothesis) tests can post to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start() -> web.AppRunner:
            runner = web.AppRunner(webhook_app(SlowApiServerFault(0.0), CFG))
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            return runner

        self.runner = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        self.port = self.runner.addresses[0][1]

    def post(self, body: bytes) -> tuple[int, dict[str, Any]]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("POST", f"{PATH}?timeout=5s", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
            try:
                return response.status, json.loads(data)
            except ValueError:  # aiohttp's plain-text 500 page
                return response.status, {"text": data.decode(errors="replace")}
        finally:
            conn.close()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    server = Served()
    try:
        yield server
    finally:
        server.close()


def _assert_answered(served: Served, review: Any) -> tuple[int, dict[str, Any]]:
    """The webhook's answer to `review` is an AdmissionReview for its uid or a 400 that says
    why; an allowed answer's patch applies to the posted pod."""
    status, body = served.post(json.dumps(review).encode())
    assert status in (200, 400), (status, body)
    if status == 400:
        assert body["error"], body
        return status, body
    assert body["apiVersion"] == "admission.k8s.io/v1"
    assert body["kind"] == "AdmissionReview"
    response = body["response"]
    assert response["uid"] == review["request"]["uid"]
    if response["allowed"] is False:
        assert response["status"]["message"], response
    elif "patch" in response:
        patch = json.loads(base64.b64decode(response["patch"]))
        jsonpatch.apply_patch(review["request"]["object"], patch)
    return status, body


def _mutated(path: tuple[Any, ...], value: Any, pod: dict[str, Any] | None = None) -> Any:
    review = copy.deepcopy(_review(_rollout_pod() if pod is None else pod))
    node: Any = review
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return review


# -- the reproductions of issue 34, item 4 --------------------------------------------------------
CONTAINER = ("request", "object", "spec", "containers", 0)
TRAINER = _trainer_pod()


@pytest.mark.parametrize(
    ("review", "names"),
    [
        pytest.param(_mutated(("request", "kind"), "Pod"), "request.kind", id="kind-a-string"),
        pytest.param(
            _mutated(("request", "object", "metadata"), "x"),
            "request.object.metadata",
            id="metadata-a-string",
        ),
        pytest.param(
            _mutated(("request", "object", "spec"), "x"), "request.object.spec", id="spec-a-string"
        ),
        pytest.param(
            _mutated(("request", "object", "spec", "containers"), ["vllm"]),
            "request.object.spec.containers[0]",
            id="containers-of-strings",
        ),
        pytest.param(
            _mutated(("request", "object", "spec", "volumes"), ["models"]),
            "request.object.spec.volumes[0]",
            id="volumes-of-strings",
        ),
        pytest.param(
            _mutated((*CONTAINER, "env"), ["PYTHONPATH=/app"]),
            "request.object.spec.containers[0].env[0]",
            id="env-of-strings",
        ),
        pytest.param(
            _mutated((*CONTAINER, "args"), 8000),
            "request.object.spec.containers[0].args",
            id="args-an-integer",
        ),
        pytest.param(
            _mutated((*CONTAINER, "args"), ["--port", 8000]),
            "request.object.spec.containers[0].args[1]",
            id="an-integer-in-args",
        ),
        pytest.param(
            _mutated((*CONTAINER, "volumeMounts"), [{"mountPath": "/models"}], TRAINER),
            "request.object.spec.containers[0].volumeMounts[0].name",
            id="volume-mount-without-a-name",
        ),
        pytest.param(
            _mutated(("request", "object", "metadata", "annotations"), ["kuberefit.io/inject"]),
            "request.object.metadata.annotations",
            id="annotations-a-list",
        ),
        pytest.param(
            _mutated((*CONTAINER, "resources"), {"limits": ["cpu"]}),
            "request.object.spec.containers[0].resources.limits",
            id="limits-a-list",
        ),
    ],
)
def test_a_malformed_review_is_a_400_that_names_the_field(
    served: Served, review: Any, names: str
) -> None:
    status, body = served.post(json.dumps(review).encode())
    assert status == 400, (status, body)
    assert names in body["error"], body["error"]
    assert "expected" in body["error"], body["error"]
    # ... and the server keeps serving well-formed reviews.
    status, body = served.post(json.dumps(_review(_rollout_pod())).encode())
    assert (status, body["response"]["allowed"]) == (200, True)
    assert body["response"]["patch"]


def test_deep_nesting_and_oversized_bodies_are_refused(served: Served) -> None:
    """Nesting beyond 200 levels is refused by the parser (a review's deepest real field is
    about 20 down: 100 levels in a field injection does not read still pass); bodies over
    MAX_REVIEW_BYTES are refused while they are read."""
    for depth, answered in ((100, 200), (500, 400)):
        deep = _review(_rollout_pod())
        deep["request"]["object"]["spec"]["affinity"] = json.loads("[" * depth + "]" * depth)
        status, body = served.post(json.dumps(deep).encode())
        assert status == answered, body
    status, body = served.post(b"[" * 200_000 + b"]" * 200_000)
    assert status == 400, body
    status, body = served.post(b" " * (MAX_REVIEW_BYTES + 1))
    assert status == 413, body
    status, body = served.post(json.dumps(_review(_rollout_pod())).encode())
    assert (status, body["response"]["allowed"]) == (200, True)


def test_fields_injection_does_not_know_are_left_untouched(served: Served) -> None:
    pod = _rollout_pod()
    pod["status"] = {"phase": "Pending"}
    pod["spec"]["affinity"] = {"nodeAffinity": {"x": [1, 2, {"y": None}]}}
    pod["spec"]["containers"][0]["lifecycle"] = {"preStop": {"exec": {"command": ["sleep"]}}}
    pod["spec"]["containers"][0]["volumeMounts"][0]["x-future"] = {"a": 1}
    pod["spec"]["volumes"][0]["x-future"] = [True]
    status, body = _assert_answered(served, _review(pod))
    assert status == 200
    patch = json.loads(base64.b64decode(body["response"]["patch"]))
    after = jsonpatch.apply_patch(pod, patch)
    assert after["status"] == pod["status"]
    assert after["spec"]["affinity"] == pod["spec"]["affinity"]
    vllm = after["spec"]["containers"][0]
    assert vllm["lifecycle"] == pod["spec"]["containers"][0]["lifecycle"]
    assert vllm["volumeMounts"][0] == pod["spec"]["containers"][0]["volumeMounts"][0]
    assert after["spec"]["volumes"][0] == pod["spec"]["volumes"][0]
    assert after["spec"]["containers"][0]["args"][:3] == pod["spec"]["containers"][0]["args"]
    assert all(op["op"] in ("add", "replace") for op in patch)


class GarbagePolicyApi:
    """`get_policy` answers something that is not an object: deciding fails unexpectedly."""

    async def get_policy(self, namespace: str, name: str) -> Any:
        return "not a RefitPolicy"


async def test_a_failure_while_deciding_denies_the_pod_with_a_reason() -> None:
    runner = web.AppRunner(webhook_app(GarbagePolicyApi(), CFG))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}{PATH}"
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(url, data=json.dumps(_review(_rollout_pod()))) as response,
        ):
            assert response.status == 200
            answer = (await response.json())["response"]
    finally:
        await runner.cleanup()
    assert answer["allowed"] is False
    assert "KubeRefit failed to decide on this pod (AttributeError)" in answer["status"]["message"]


def test_inject_refuses_rather_than_raises_when_it_fails_unexpectedly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr("refit_operator.injection.patch.wire_vllm", broken)
    result = inject(_rollout_pod(), CFG, POLICY)
    assert result.patch == []
    assert result.denied is not None
    assert result.denied.startswith("KubeRefit failed to inject this pod (RuntimeError: boom)")


# -- properties ------------------------------------------------------------------------------------
KEYS = st.sampled_from(
    ["name", "value", "valueFrom", "mountPath", "kind", "uid", "annotations", "args", "env", "x"]
)
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(["Pod", "CREATE", "rollout", "trainer", "alpha", "/models", "--port"]),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(KEYS | st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if prefix:
        yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, (*prefix, i))


BASES = [_review(_rollout_pod()), _review(_trainer_pod())]
PATHS = [(b, p) for b, base in enumerate(BASES) for p in _paths(base)]


_GONE = object()


def _child(node: Any, key: Any) -> Any:
    """`node[key]`, or _GONE where an earlier mutation replaced or removed the path."""
    if isinstance(node, dict) and isinstance(key, str) and key in node:
        return node[key]
    if isinstance(node, list) and isinstance(key, int) and key < len(node):
        return node[key]
    return _GONE


@st.composite
def mutated_reviews(draw: st.DrawFn) -> Any:
    """A valid review with 1 to 3 of its subtrees replaced by random JSON or removed."""
    base = draw(st.sampled_from(range(len(BASES))))
    review = copy.deepcopy(BASES[base])
    for _ in range(draw(st.integers(1, 3))):
        _, path = draw(st.sampled_from([p for p in PATHS if p[0] == base]))
        node: Any = review
        for key in path[:-1]:
            node = _child(node, key)
        if isinstance(node, dict) and draw(st.booleans()) and draw(st.booleans()):
            node.pop(path[-1], None)
        elif _child(node, path[-1]) is not _GONE:
            node[path[-1]] = draw(JSON)
    return review


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(review=mutated_reviews())
def test_any_mutated_review_is_answered_never_a_500(served: Served, review: Any) -> None:
    status, body = served.post(json.dumps(review).encode())
    assert status in (200, 400), (status, body)
    if status == 200:
        assert body["kind"] == "AdmissionReview"
        response = body["response"]
        assert response["uid"] == review["request"]["uid"]
        assert isinstance(response["allowed"], bool)
        if not response["allowed"]:
            assert response["status"]["message"]
        elif "patch" in response:
            patch = json.loads(base64.b64decode(response["patch"]))
            jsonpatch.apply_patch(review["request"]["object"], patch)
    else:
        assert body["error"]


def test_the_server_serves_after_the_mutated_reviews(served: Served) -> None:
    _assert_answered(served, _review(_trainer_pod()))
    status, body = served.post(json.dumps(_review(_rollout_pod())).encode())
    assert (status, body["response"]["allowed"]) == (200, True)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pod=st.one_of(
        mutated_reviews().map(
            lambda r: r["request"].get("object") if isinstance(r.get("request"), dict) else r
        ),
        JSON,
    )
)
def test_inject_never_raises(pod: Any) -> None:
    snapshot = copy.deepcopy(pod)
    result = inject(pod, CFG, POLICY)
    assert isinstance(result, Injection)
    assert pod == snapshot  # pure: the input is never changed
    if result.denied is not None:
        assert result.patch == []
        assert result.denied
    elif result.patch:
        jsonpatch.apply_patch(pod, result.patch)
