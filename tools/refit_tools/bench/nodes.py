"""Receiver node processes for the benchmarks (`python -m refit_sidecar.receiver`).

`kuberefit bench transport` starts them on loopback; `kuberefit bench refit` starts them inside
the rollout network namespace, with relays on the shaped link's address and the control plane
reached over an unshaped veth. Each node is a real process in its own process group, logging to
the work directory, stopped by `close()` (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import urllib3
from pydantic import BaseModel

from refit_protocol.kit.auth import bearer_header
from refit_protocol.receiver_api import (
    AttemptRequest,
    PrepareRequest,
    PrepareResponse,
    RelayFlushRequest,
    RelayFlushResponse,
)
from refit_sidecar.transport.relay.frames import LinkSecurity
from refit_tools.local.procs import ComponentError, ManagedProcess, free_ports

#: node index -> the node's `applier` config section (ReceiverConfig.applier)
ApplierSpec = Callable[[int], dict[str, Any]]
Wrap = Callable[[list[str]], list[str]]


class BenchNodes:
    """`n` receiver nodes sharing one token; `relays` lists their endpoints in tree order.

    The constructor only plans (ports, configs); `start()` launches the processes."""

    def __init__(
        self,
        n: int,
        workdir: Path,
        *,
        applier: ApplierSpec,
        relay_host: str = "127.0.0.1",
        http_bind: str | None = None,
        ctl_host: str | None = None,
        wrap: Wrap | None = None,
        log_level: str = "WARNING",
        start_timeout_s: float = 120.0,
        extra: dict[str, Any] | None = None,
        links: LinkSecurity = LinkSecurity.MAC,
    ) -> None:
        """`relay_host`: where relays listen and are reached (and HTTP, unless `http_bind`);
        `ctl_host`: where this process reaches the HTTP control plane (default `relay_host`);
        `wrap`: turns each node's argv into another (e.g. `ip netns exec <ns> ...`);
        `links`: how relays forward to each other (MAC-only, the product's default, or
        CurveZMQ); the producer's link to the root is CurveZMQ either way."""
        self.token = secrets.token_hex(16)
        self.names = [f"bench{i}" for i in range(n)]
        ports = free_ports(3 * n)
        self.http = [f"http://{ctl_host or relay_host}:{p}" for p in ports[:n]]
        self.relays = [f"tcp://{relay_host}:{p}" for p in ports[n : 2 * n]]
        mac = links is LinkSecurity.MAC
        self.mac_relays = [f"tcp://{relay_host}:{p}" if mac else "" for p in ports[2 * n :]]
        self.pool = urllib3.PoolManager(maxsize=2 * n, retries=False)
        self.procs: list[ManagedProcess] = []
        env = dict(os.environ, KUBEREFIT_LOG_LEVEL=log_level)
        for i, name in enumerate(self.names):
            cfg = {
                "node": name,
                "host": http_bind or relay_host,
                "port": ports[i],
                "token": self.token,
                "held_version": 0,
                "applier": applier(i),
                "relay": {
                    "bind": self.relays[i],
                    "mac_bind": self.mac_relays[i] or None,
                    "nodes": self.relays,
                },
                **(extra or {}),
            }
            path = workdir / f"{name}.json"
            path.write_text(json.dumps(cfg))
            path.chmod(0o600)
            argv = [sys.executable, "-m", "refit_sidecar.receiver", "--config", str(path)]
            self.procs.append(
                ManagedProcess(name, wrap(argv) if wrap else argv, workdir / f"{name}.log", env=env)
            )
        self.start_timeout_s = start_timeout_s

    def start(self) -> BenchNodes:
        """Boot every node in parallel and wait until each answers /healthz."""
        try:
            for proc in self.procs:
                proc.launch()
            for proc, url in zip(self.procs, self.http, strict=True):
                proc.wait_ready(partial(self._healthy, url), timeout=self.start_timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def _healthy(self, url: str) -> bool:
        return bool(self.pool.request("GET", url + "/healthz", timeout=1.0).status == 200)

    def post(self, url: str, path: str, body: BaseModel, timeout: float = 300) -> dict[str, Any]:
        """A synchronous control-plane call (JSON body, bearer token); raises on non-200."""
        resp = self.pool.request(
            "POST",
            url + "/v1" + path,
            body=body.model_dump_json().encode(),
            headers={**bearer_header(self.token), "Content-Type": "application/json"},
            timeout=timeout,
        )
        if resp.status != 200:
            raise RuntimeError(f"{url}{path}: HTTP {resp.status}: {resp.data[:300]!r}")
        data: dict[str, Any] = json.loads(resp.data)
        return data

    def each(self, fn: Callable[[str], Any]) -> list[Any]:
        """`fn(url)` on every node in parallel, in node order."""
        with ThreadPoolExecutor(len(self.http)) as ex:
            return list(ex.map(fn, self.http))

    def deliver(
        self,
        attempt: str,
        expected: dict[int, int],
        send: Callable[[], float],
        *,
        held_version: int = 0,
        timeout_s: float = 600.0,
    ) -> float:
        """Time one transport-only delivery to every node, then drop it.

        Prepares an async attempt (nodes stage payloads and never apply them), asks every node
        for a relay flush of `expected` (producer -> payloads) while `send()` streams them, and
        returns seconds from `send()`'s start (its return value, `time.monotonic()`) until the
        last node's flush succeeded: every payload arrived and was forwarded down the tree.
        """
        req = PrepareRequest(
            attempt=attempt,
            from_version=held_version,
            target_version=held_version + 1,
            mode="overwrite",
            sync=False,
            producers=sorted(expected),
            relay_tree=self.relays,
            relay_mac_tree=self.mac_relays if any(self.mac_relays) else [],
        )
        answers = self.each(lambda u: PrepareResponse(**self.post(u, "/prepare", req)))
        refused = [a for a in answers if not a.accepted]
        if refused:
            raise RuntimeError(f"prepare refused by {refused[0].node}: {refused[0].reason}")
        flush = RelayFlushRequest(attempt=attempt, expected=expected, timeout_s=timeout_s)

        def flushed(url: str) -> tuple[RelayFlushResponse, float]:
            answer = RelayFlushResponse(
                **self.post(url, "/relay-flush", flush, timeout=timeout_s + 30)
            )
            return answer, time.monotonic()

        stop = AttemptRequest(attempt=attempt)
        ex = ThreadPoolExecutor(len(self.http))
        try:
            waits = [ex.submit(flushed, u) for u in self.http]
            t0 = send()
            done = [w.result() for w in waits]
        finally:
            self.each(lambda u: self.post(u, "/stop", stop))  # also releases waiting flushes
            ex.shutdown(wait=True)
        self.each(lambda u: self.post(u, "/cleanup", stop))
        bad = [a for a, _ in done if not a.ok]
        if bad:
            raise RuntimeError(f"relay flush failed on {bad[0].node}: {bad[0].errors}")
        return max(t for _, t in done) - t0

    def alive(self, i: int) -> bool:
        return self.procs[i].alive()

    def check_alive(self) -> None:
        """Raise with the log tail of the first node that exited."""
        for proc in self.procs:
            if proc.proc is not None and not proc.alive():
                raise ComponentError(
                    f"{proc.name} exited with code {proc.proc.returncode}; log {proc.log_path}"
                )

    def close(self) -> None:
        for proc in self.procs:
            proc.stop(grace=10)
