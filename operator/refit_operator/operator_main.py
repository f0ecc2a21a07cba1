"""`kuberefit operator serve`: the kopf operator with its health and metrics endpoints.

One process serves every RefitPolicy it can see (cluster-wide, or the namespaces given). Next
to kopf it serves `/healthz` (the event loop answers), `/readyz` (kopf has started and its
indices are filled) and `/metrics` (Prometheus; bearer token required unless bound to
loopback) on `--metrics-bind`, and with `--webhook-bind` the sidecar-injecting admission
webhook over HTTPS (`refit_operator.webhook`).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from pathlib import Path

import structlog
from aiohttp import web
from prometheus_client import REGISTRY
from pydantic import BaseModel, ConfigDict, Field

from refit_operator import metrics as _metrics  # noqa: F401 - the families /metrics serves
from refit_operator.injection.config import load_injection_config, with_native_sidecars
from refit_operator.server_thread import ServerThread
from refit_operator.webhook import DEFAULT_DRAIN_S
from refit_protocol.kit.auth import require_token_or_loopback, resolve_token
from refit_protocol.kit.http_log import request_logger
from refit_protocol.kit.service_http import Readiness, add_probe_routes, bearer_guard, json_errors
from refit_protocol.kit.tokens import as_ring

log = structlog.get_logger("kuberefit.operator")


def default_identity() -> str:
    """The pod name in a cluster (stable across container restarts), else host and pid."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


class OperatorConfig(BaseModel):
    """Settings of `kuberefit operator serve` (all but `status_interval_s` are command-line
    flags)."""

    model_config = ConfigDict(extra="forbid")

    namespaces: list[str] = Field(
        default_factory=list, description="Namespaces to serve (empty: cluster-wide)."
    )
    identity: str = Field(default_factory=default_identity, description="Lease holder name.")
    metrics_host: str = Field(
        "0.0.0.0",  # noqa: S104 - kubelet probes and Prometheus reach the pod IP
        description="Health and metrics bind address.",
    )
    metrics_port: int = Field(8080, ge=0, le=65535, description="Health and metrics port.")
    metrics_token_file: Path | None = Field(
        None, description="Bearer token for /metrics (default $KUBEREFIT_TOKEN)."
    )
    poll_s: float = Field(0.5, gt=0, description="How often each policy's loop looks around.")
    lease_s: int = Field(15, ge=3, description="Lease duration of each policy's coordinator.")
    lease_namespace: str | None = Field(
        default_factory=lambda: os.environ.get("POD_NAMESPACE") or None,
        description="Namespace of the policies' Leases: the operator's own ($POD_NAMESPACE), "
        "where its Role allows Lease writes. Default with one --namespace and no "
        "$POD_NAMESPACE: that namespace.",
    )
    status_interval_s: float = Field(
        1.0, gt=0, description="Least time between RefitTransition progress patches."
    )
    webhook_host: str | None = Field(
        None, description="Bind address of the sidecar-injecting webhook (None: no webhook)."
    )
    webhook_port: int = Field(9443, ge=0, le=65535, description="Its HTTPS port.")
    webhook_cert_dir: Path | None = Field(
        None, description="Directory with tls.crt and tls.key (the chart's serving Secret)."
    )
    injection_config: Path | None = Field(
        None, description="What the webhook injects (the chart's injection.json)."
    )
    webhook_drain_s: float = Field(
        DEFAULT_DRAIN_S,
        ge=0,
        le=300,
        description="Seconds a stopping operator keeps answering admission reviews, each answer "
        "closing its connection, so that the API server moves to the replicas that stay.",
    )

    def leases_in(self) -> str:
        """The Leases' namespace, or ValueError naming the fix."""
        if self.lease_namespace:
            return self.lease_namespace
        if len(self.namespaces) == 1:
            return self.namespaces[0]
        raise ValueError(
            "the operator keeps its Leases in its own namespace: set $POD_NAMESPACE (the chart "
            "does, from the downward API) or --lease-namespace"
        )


def health_app(
    ready: threading.Event, token: str | None, stopping: threading.Event | None = None
) -> web.Application:
    """`/healthz`, `/readyz` (kopf started, not stopping) and `/metrics` (bearer `token`)."""

    async def readiness() -> Readiness:
        started = ready.is_set()
        detail = "started, indices filled" if started else "starting: kopf's indices not filled"
        checks = [("kopf", started, detail)]
        if stopping is not None and stopping.is_set():
            checks.append(("stopping", False, "stopping: the webhook drains"))
        return Readiness.of(checks)

    app = web.Application(
        middlewares=[request_logger("operator"), json_errors, bearer_guard(as_ring(token))]
    )
    add_probe_routes(app, readiness, REGISTRY)
    return app


async def run(config: OperatorConfig) -> None:
    """Run until SIGTERM/SIGINT (kopf handles the signals), then drain the webhook."""
    import kopf

    from refit_operator.handlers import Memo, registry
    from refit_operator.kube.api import KubeApi
    from refit_operator.policy_runner import RunnerSettings
    from refit_operator.webhook import serve_webhook

    token = resolve_token(None, config.metrics_token_file)
    require_token_or_loopback(
        "operator metrics", [config.metrics_host], token, allow_insecure=False
    )
    injection = load_injection_config(config.injection_config)
    if config.webhook_host is not None and config.webhook_cert_dir is None:
        raise ValueError("--webhook-bind needs --webhook-cert-dir (tls.crt and tls.key)")
    settings = RunnerSettings(
        identity=config.identity,
        poll_s=config.poll_s,
        lease_s=config.lease_s,
        status_interval_s=config.status_interval_s,
        lease_namespace=config.leases_in(),
    )
    api = await asyncio.to_thread(KubeApi.from_environment)
    if injection.native_sidecars == "auto":
        major, minor = await api.server_version()
        injection = with_native_sidecars(injection, major, minor)
        log.info(
            "operator.native_sidecars",
            server=f"{major}.{minor}",
            native_sidecars=injection.native_sidecars,
        )
    # The servers run on their own loop: kopf's shutdown would cancel their connections.
    servers = ServerThread()
    ready, stopping = threading.Event(), threading.Event()
    try:
        runner = await servers.call(
            _serve_health(
                health_app(ready, token, stopping), config.metrics_host, config.metrics_port
            )
        )
        webhook = None
        if config.webhook_host is not None and config.webhook_cert_dir is not None:
            webhook = await servers.call(
                serve_webhook(
                    api,
                    injection,
                    config.webhook_host,
                    config.webhook_port,
                    config.webhook_cert_dir,
                )
            )
        log.info(
            "operator.starting",
            identity=config.identity,
            namespaces=config.namespaces or "cluster-wide",
            metrics=f"{config.metrics_host}:{config.metrics_port}",
        )
        try:
            await kopf.operator(
                registry=registry,
                standalone=True,
                clusterwide=not config.namespaces,
                namespaces=config.namespaces,
                memo=Memo(api=api, settings=settings),
                ready_flag=ready,
            )
        finally:
            stopping.set()
            log.info("operator.stopping", webhook_drain_s=config.webhook_drain_s if webhook else 0)
            if webhook is not None:
                await servers.call(webhook.stop(config.webhook_drain_s))
            await servers.call(runner.cleanup())
    finally:
        await servers.close()
        log.info("operator.stopped")


async def _serve_health(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
