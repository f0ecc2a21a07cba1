"""The coordinator process's HTTP surface (`kuberefit coordinator serve`, when `metrics_port`
is set): `/healthz` (liveness), `/readyz` (readiness: the commit store answers, the committed
version's checkpoint is there, the coordinator acquired the store and finished its start-up)
and `/metrics` (`metrics.CoordinatorMetrics`; bearer token, as every plane).

The checkpoint check is also the start-up check (`checkpoint_problem`): a coordinator refuses to
start, with one line, when the committed version's checkpoint (version 0's at the first start)
is not where `checkpoint_template` says, since joining receivers are restored from it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
from aiohttp import web

from refit_operator.commit_store import CommitStore
from refit_operator.metrics import CoordinatorMetrics
from refit_protocol.errors import listen_error
from refit_protocol.kit.auth import require_token_or_loopback
from refit_protocol.kit.http_log import request_logger
from refit_protocol.kit.service_http import (
    ReadinessProbe,
    add_probe_routes,
    bearer_guard,
    json_errors,
)
from refit_protocol.kit.tokens import TokenRing

log = structlog.get_logger("kuberefit.coordinator_service")

#: How long /readyz waits for the commit store.
STORE_TIMEOUT_S = 2.0
Check = tuple[str, bool, str]


def checkpoint_problem(directory: str | Path, version: int) -> str | None:
    """Why the committed version's checkpoint is not usable for a dense restore (None: it is
    a directory with safetensors files)."""
    d = Path(directory)
    what = f"the checkpoint of committed version {version} (checkpoint_template)"
    if not d.exists():
        return f"{what} is missing: {d} does not exist"
    if not d.is_dir():
        return f"{what} is not a directory: {d}"
    if not any(d.glob("*.safetensors")):
        return f"{what} holds no *.safetensors files: {d}"
    return None


class CoordinatorReadiness:
    """What `/readyz` checks, and what the service tells it as it starts."""

    def __init__(self, store: CommitStore, checkpoint_of: Callable[[int], str], store_name: str):
        self.store = store
        self.checkpoint_of = checkpoint_of
        self.store_name = store_name
        self.active: str | None = None  # set once the coordinator acquired the store and started

    async def checks(self) -> list[Check]:
        out: list[Check] = []
        try:
            state = await asyncio.wait_for(self.store.read(), STORE_TIMEOUT_S)
        except Exception as exc:
            why = "no answer in time" if isinstance(exc, TimeoutError) else str(exc) or repr(exc)
            out.append(
                ("commit_store", False, f"commit store {self.store_name} unreachable: {why}")
            )
            out.append(("checkpoint", False, "unknown: the committed version cannot be read"))
        else:
            version = state.record.version
            out.append(("commit_store", True, f"{self.store_name}: version {version} committed"))
            directory = self.checkpoint_of(version)
            problem = await asyncio.to_thread(checkpoint_problem, directory, version)
            out.append(("checkpoint", problem is None, problem or f"{directory} present"))
        if self.active is None:
            out.append(("coordinator", False, "starting: recovering and restoring receivers"))
        else:
            out.append(("coordinator", True, self.active))
        return out


def coordinator_app(
    metrics: CoordinatorMetrics, readiness: CoordinatorReadiness, tokens: TokenRing
) -> web.Application:
    app = web.Application(
        middlewares=[request_logger("coordinator"), json_errors, bearer_guard(tokens)]
    )
    probe = ReadinessProbe(readiness.checks, timeout_s=STORE_TIMEOUT_S + 2.0)
    add_probe_routes(app, probe, metrics.registry)
    return app


@dataclass
class CoordinatorHttp:
    """The running server; `port` is the bound one (a `metrics_port` of 0 picks a free one)."""

    runner: web.AppRunner
    port: int

    async def close(self) -> None:
        await self.runner.cleanup()


async def serve_http(
    app: web.Application, host: str, port: int, tokens: TokenRing
) -> CoordinatorHttp:
    """Start the surface on host:port (refused beyond loopback without a token)."""
    require_token_or_loopback(
        "coordinator metrics_host", [host], tokens.sending(), allow_insecure=False
    )
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise listen_error("metrics_host/metrics_port", f"{host}:{port}", exc) from exc
    sockets = getattr(site._server, "sockets", None) or []
    bound = int(sockets[0].getsockname()[1]) if sockets else port
    log.info("coordinator.http", bind=f"{host}:{bound}", paths=["/healthz", "/readyz", "/metrics"])
    return CoordinatorHttp(runner, bound)
