"""The token source of a policy's loop, on the real API server: only a Secret marked for
KubeRefit is read, once per refresh period; a rotation keeps the previous token in the ring;
a missing, unmarked or keyless Secret is a named reason (`PolicyToken.error`), never an
exception."""

from __future__ import annotations

import base64

from kubernetes import client

from refit_operator.kube.api import KubeApi
from refit_operator.kube.names import TOKEN_LABEL
from refit_operator.policy_spec import parse_spec
from refit_operator.policy_token import TOKEN_REFRESH_S, PolicyToken


def put_secret(
    api: KubeApi, namespace: str, value: str, *, key: str = "token", marked: bool = True
) -> None:
    core = client.CoreV1Api(api.api_client)
    labels = {TOKEN_LABEL: "true"} if marked else {}
    body = {
        "metadata": {"name": "refit-token", "labels": labels},
        "data": {key: base64.b64encode(value.encode()).decode()},
    }
    try:
        core.replace_namespaced_secret("refit-token", namespace, body)
    except client.ApiException as exc:
        if exc.status != 404:
            raise
        core.create_namespaced_secret(namespace, body)


async def test_reads_follow_rotation_and_name_what_is_wrong(api: KubeApi, namespace: str) -> None:
    now = [1000.0]
    source = PolicyToken(api, namespace, clock=lambda: now[0])
    spec = parse_spec({"tokenSecret": {"name": "refit-token"}})

    assert await source.current(spec) is None
    assert source.error is not None
    assert source.error[0] == "TokenSecretMissing"
    assert f"Secret {namespace}/refit-token" in source.error[1]

    put_secret(api, namespace, "first", marked=False)  # any Secret of the namespace: refused
    assert await source.current(spec) is None
    assert source.error is not None
    assert source.error[0] == "TokenSecretRefused"
    assert f"lacks the label {TOKEN_LABEL}=true" in source.error[1]

    put_secret(api, namespace, "first")
    assert await source.current(spec) == "first"
    assert source.error is None

    put_secret(api, namespace, "second")
    now[0] += TOKEN_REFRESH_S / 2  # not re-read yet: the ring still sends the first
    assert await source.current(spec) == "first"
    now[0] += TOKEN_REFRESH_S  # re-read: the ring follows the rotation
    assert await source.current(spec) in ("first", "second")
    ring = source.ring
    assert ring is not None
    assert ring.newest() == "second"
    assert set(ring.accepted()) == {"first", "second"}  # the previous one, for the grace period

    put_secret(api, namespace, "x", key="other")
    now[0] += TOKEN_REFRESH_S + 1
    assert await source.current(spec) is None
    assert source.error is not None
    assert source.error[0] == "TokenSecretRefused"
    assert "no key 'token'" in source.error[1]
