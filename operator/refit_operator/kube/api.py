"""The operator's few Kubernetes calls, typed and asynchronous.

The official client is synchronous; each call runs in a worker thread so the operator's event
loop (kopf's) never blocks. Everything the operator writes goes through here, so this file is
also the list its RBAC role must grant (`charts/kuberefit/files/operator-clusterrole.yaml`).
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
from typing import Any

from refit_operator.kube.names import (
    API_VERSION,
    COMPONENT,
    GROUP,
    POLICIES,
    TOKEN_LABEL,
    TRANSITIONS,
    VERSION,
)

Obj = dict[str, Any]
#: (connect, read) seconds of every call: a half-open connection must not hang a policy loop.
REQUEST_TIMEOUT_S = (5.0, 30.0)


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def object_ref(obj: Obj) -> Obj:
    """An ObjectReference (Events' involvedObject) to `obj`."""
    meta = obj["metadata"]
    return {
        "apiVersion": obj.get("apiVersion", "v1"),
        "kind": obj["kind"],
        "name": meta["name"],
        "namespace": meta.get("namespace"),
        "uid": meta.get("uid"),
        "resourceVersion": meta.get("resourceVersion"),
    }


class NotFoundError(LookupError):
    """The object does not exist (HTTP 404)."""


class SecretRefusedError(ValueError):
    """The token Secret exists but cannot be used (unmarked, key missing or empty)."""


class ConflictError(RuntimeError):
    """The write lost a race: the object changed or already exists (HTTP 409)."""


class KubeApi:
    """Thin async wrapper over `kubernetes.client` for what the operator reads and writes."""

    def __init__(self, api_client: Any) -> None:
        from kubernetes import client

        self.api_client = api_client
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.coordination = client.CoordinationV1Api(api_client)

    @classmethod
    def from_environment(cls) -> KubeApi:
        """In-cluster service account, else $KUBECONFIG / ~/.kube/config."""
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return cls(client.ApiClient())

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.rest import ApiException

        kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT_S)
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except ApiException as exc:
            if exc.status == 404:
                raise NotFoundError(str(exc.reason)) from exc
            if exc.status == 409:
                raise ConflictError(str(exc.reason)) from exc
            raise

    async def server_version(self) -> tuple[str, str]:
        """The API server's (major, minor), as /version spells them (minor may be "29+")."""
        from kubernetes import client

        info = await self._run(client.VersionApi(self.api_client).get_code)
        return str(info.major), str(info.minor)

    # -- RefitPolicy ------------------------------------------------------------------------
    async def get_policy(self, namespace: str, name: str) -> Obj:
        """The RefitPolicy (NotFoundError when there is none)."""
        obj: Obj = await self._run(
            self.custom.get_namespaced_custom_object, GROUP, VERSION, namespace, POLICIES, name
        )
        return obj

    async def patch_policy_status(self, namespace: str, name: str, status: Obj) -> None:
        await self._run(
            self.custom.patch_namespaced_custom_object_status,
            GROUP,
            VERSION,
            namespace,
            POLICIES,
            name,
            {"status": status},
        )

    async def remove_policy_annotation(self, namespace: str, name: str, key: str) -> None:
        await self._run(
            self.custom.patch_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            POLICIES,
            name,
            {"metadata": {"annotations": {key: None}}},
        )

    async def remove_policy_finalizer(
        self, namespace: str, name: str, finalizers: list[str], finalizer: str
    ) -> None:
        """Remove `finalizer` from a policy whose finalizers were read as `finalizers`: a JSON
        patch that tests the entry first, so another controller's finalizers are never touched
        (a 422 if the list changed meanwhile: the next watch event tries again)."""
        at = f"/metadata/finalizers/{finalizers.index(finalizer)}"
        await self._run(
            self.custom.patch_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            POLICIES,
            name,
            [{"op": "test", "path": at, "value": finalizer}, {"op": "remove", "path": at}],
            _content_type="application/json-patch+json",
        )

    # -- RefitTransition --------------------------------------------------------------------
    async def get_transition(self, namespace: str, name: str) -> Obj:
        obj: Obj = await self._run(
            self.custom.get_namespaced_custom_object, GROUP, VERSION, namespace, TRANSITIONS, name
        )
        return obj

    async def create_transition(self, namespace: str, body: Obj) -> Obj:
        obj: Obj = await self._run(
            self.custom.create_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            TRANSITIONS,
            body,
        )
        return obj

    async def patch_transition_status(self, namespace: str, name: str, status: Obj) -> Obj:
        obj: Obj = await self._run(
            self.custom.patch_namespaced_custom_object_status,
            GROUP,
            VERSION,
            namespace,
            TRANSITIONS,
            name,
            {"status": status},
        )
        return obj

    async def list_transitions(self, namespace: str) -> list[Obj]:
        out: Obj = await self._run(
            self.custom.list_namespaced_custom_object, GROUP, VERSION, namespace, TRANSITIONS
        )
        return list(out.get("items") or [])

    async def delete_transition(self, namespace: str, name: str) -> None:
        await self._run(
            self.custom.delete_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            TRANSITIONS,
            name,
        )

    # -- Secrets and Events -----------------------------------------------------------------
    async def read_secret_key(self, namespace: str, name: str, key: str) -> str:
        """The decoded value of `key` in Secret `name`.

        Only a Secret labelled `kuberefit.io/token: "true"` is read: the operator sends the
        value to the policy's pods, so whoever may create a RefitPolicy must not be able to
        point it at any Secret of the namespace. SecretRefusedError otherwise."""
        secret = await self._run(self.core.read_namespaced_secret, name, namespace)
        labels = secret.metadata.labels or {}
        if labels.get(TOKEN_LABEL) != "true":
            raise SecretRefusedError(
                f"Secret {namespace}/{name} lacks the label {TOKEN_LABEL}=true that marks it "
                f"for KubeRefit (kubectl label secret {name} {TOKEN_LABEL}=true)"
            )
        data = secret.data or {}
        if key not in data:
            raise SecretRefusedError(f"Secret {namespace}/{name} has no key {key!r}")
        value = base64.b64decode(data[key]).decode().strip()
        if not value:
            raise SecretRefusedError(f"key {key!r} of Secret {namespace}/{name} is empty")
        return value

    async def post_event(
        self, involved: Obj, reason: str, message: str, *, warning: bool = False
    ) -> None:
        """A core/v1 Event on `involved` (an object_ref); what `kubectl describe` shows."""
        stamp = now_iso()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "generateName": f"{involved['name']}.",
                "namespace": involved["namespace"],
            },
            "involvedObject": involved,
            "reason": reason,
            "message": message[:1024],
            "type": "Warning" if warning else "Normal",
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        await self._run(self.core.create_namespaced_event, involved["namespace"], body)

    # -- Leases -----------------------------------------------------------------------------
    async def read_lease(self, namespace: str, name: str) -> Any:
        return await self._run(self.coordination.read_namespaced_lease, name, namespace)

    async def create_lease(self, namespace: str, body: Obj) -> Any:
        return await self._run(self.coordination.create_namespaced_lease, namespace, body)

    async def replace_lease(self, namespace: str, name: str, body: Obj) -> Any:
        return await self._run(self.coordination.replace_namespaced_lease, name, namespace, body)


def owner_reference(obj: Obj) -> Obj:
    """Makes `obj` (a RefitPolicy) the owner: its transitions go when it goes."""
    meta = obj["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": obj["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": False,
    }
