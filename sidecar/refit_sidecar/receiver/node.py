"""Assembles one receiver node: applier + core + the transports' inbounds + HTTP service."""

from __future__ import annotations

import asyncio
import signal

import structlog
from aiohttp import web

from refit_protocol.errors import listen_error
from refit_protocol.kit.auth import open_ring, require_token_or_loopback
from refit_protocol.kit.cli import mark_started
from refit_protocol.kit.logs import configure_logging, log_settings
from refit_sidecar.receiver import appliers
from refit_sidecar.receiver.appliers.base import Applier
from refit_sidecar.receiver.appliers.vllm_host import VllmHostApplier
from refit_sidecar.receiver.appliers.vllm_http import VllmHttpApplier
from refit_sidecar.receiver.config import ReceiverConfig
from refit_sidecar.receiver.core import ReceiverCore, receiving
from refit_sidecar.receiver.metrics import ReceiverMetrics
from refit_sidecar.receiver.service import create_app

log = structlog.get_logger("kuberefit.receiver")


class ReceiverNode:
    """One node's receiver: start() brings up the inbounds (the relay tree's ROUTER, the S3
    downloads) and the HTTP site, close() stops them."""

    def __init__(self, config: ReceiverConfig, applier: Applier | None = None) -> None:
        self.config = config
        self.tokens = open_ring(
            config.token, config.token_file, grace_s=config.token_rotation_grace_s
        )
        self.token = self.tokens.sending()
        hosts = [config.host]
        for plugin, settings in receiving(config):
            hosts += plugin.listen_hosts(settings)
        require_token_or_loopback(
            f"receiver {config.node}", hosts, self.token, allow_insecure=config.allow_insecure
        )
        if not self.token:
            log.warning("receiver.no_token", node=config.node, hosts=hosts)
        self.metrics = ReceiverMetrics()
        self.applier = applier if applier is not None else appliers.make(config.applier)
        if isinstance(self.applier, VllmHttpApplier) and config.applier.control_token is None:
            # The vLLM server in this pod checks the pod's token on its refit control path.
            self.applier.tokens = self.tokens
        if isinstance(self.applier, VllmHostApplier):
            # The server leader's receiver holds the same policy token.
            self.applier.tokens = self.tokens
        self.core = ReceiverCore(config, self.applier, metrics=self.metrics)
        # With a token, only payloads sealed with the policy's key(s) are decoded.
        self.core.intake.tokens = self.tokens
        self.inbounds = self.core.open_inbounds(self.tokens)
        self._runner: web.AppRunner | None = None
        self._absence: asyncio.Task[None] | None = None
        self.port = 0

    async def start(self) -> None:
        if self.core.state.held_version is None:
            # Unknown bits (e.g. a restarted sidecar whose server may hold partial writes) must
            # not serve: hold the gate closed until a dense restore.
            await asyncio.to_thread(self.core.control.close_gate_for_unknown_bits)
        for inbound in self.inbounds:
            await asyncio.to_thread(inbound.start)
        app = create_app(self.core, token=self.tokens)
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=5.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        try:
            await site.start()
        except OSError as exc:
            address = f"{self.config.host}:{self.config.port}"
            raise listen_error("host/port", address, exc) from exc
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.port = int(sockets[0].getsockname()[1]) if sockets else self.config.port
        if self.config.gate_release_s > 0:
            self._absence = asyncio.create_task(self._watch_absence())
        log.info(
            "receiver.ready",
            node=self.config.node,
            http=f"{self.config.host}:{self.port}",
            inbounds=[inbound.readiness()[2] for inbound in self.inbounds],
        )

    async def _watch_absence(self) -> None:
        """Operator absence (`receiver.absence`): look a few times per `gate_release_s`
        whether a gate should reopen."""
        every = min(5.0, self.config.gate_release_s / 4)
        while True:
            await asyncio.sleep(every)
            try:
                await asyncio.to_thread(self.core.control.release_stale_gate)
            except Exception as exc:  # the runtime did not answer: the next look tries again
                log.warning("receiver.gate_release_failed", node=self.config.node, error=str(exc))

    async def close(self) -> None:
        if self._absence is not None:
            self._absence.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        self.core.close()
        self.applier.close()

    async def run_forever(self) -> None:
        """Serve until SIGTERM/SIGINT."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await self.start()
            mark_started()
            log_settings("receiver", self.config)
            await stop.wait()
        finally:
            await self.close()


def serve_forever(config: ReceiverConfig) -> None:
    """Run the node until SIGTERM (`kuberefit receiver serve`)."""
    configure_logging()
    asyncio.run(ReceiverNode(config).run_forever())
