"""Receiver nodes as real processes (`python -m refit_sidecar.receiver`) and a synchronous
control-plane client for tests: every node is its own process, killable with SIGKILL."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import urllib3
from pydantic import BaseModel

from refit_protocol.keys import payload_mac_key
from refit_protocol.receiver_api import (
    API_PREFIX,
    AttemptRequest,
    CommitNotice,
    FlushRequest,
    FlushResponse,
    GateRequest,
    PrepareRequest,
    PrepareResponse,
    PrewarmRequest,
    PrewarmResponse,
    ReceiverStatus,
    RelayFlushRequest,
    RelayFlushResponse,
    StopResponse,
)
from refit_protocol.tensors import TensorMetaModel
from tests.harness.procs import ManagedProcess, free_ports

#: The receivers' token unless a test names another (payloads signed with HARNESS_MAC_KEY by
#: tests.sidecar.receiver.models are then accepted: every token-holding receiver checks MACs).
HARNESS_TOKEN = "kuberefit-harness-9f3c1e7a5b2d4680"
HARNESS_MAC_KEY = payload_mac_key(HARNESS_TOKEN)

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class HttpFailureError(AssertionError):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


class Ctl:
    """Synchronous JSON client of one receiver node's control plane."""

    def __init__(self, base: str, token: str | None, *, timeout: float = 60.0) -> None:
        self.base = base.rstrip("/")
        self.token = token
        self.http = urllib3.PoolManager(maxsize=4, retries=False)
        self.timeout = timeout

    def raw(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        token: str | bool | None = True,
        timeout: float | None = None,
    ) -> tuple[int, Any]:
        headers = {"Content-Type": "application/json"}
        tok = self.token if token is True else token
        if tok:
            headers["Authorization"] = f"Bearer {tok}"
        resp = self.http.request(
            method,
            self.base + path,
            body=body,
            headers=headers,
            timeout=urllib3.Timeout(total=timeout or self.timeout),
        )
        try:
            data = json.loads(resp.data) if resp.data else None
        except ValueError:
            data = resp.data.decode(errors="replace")
        return resp.status, data

    def call(
        self, path: str, req: BaseModel | None, out: type[M], *, timeout: float | None = None
    ) -> M:
        method = "GET" if req is None else "POST"
        body = None if req is None else req.model_dump_json().encode()
        status, data = self.raw(method, API_PREFIX + path, body, timeout=timeout)
        if status not in (200, 202):
            raise HttpFailureError(status, data)
        return out.model_validate(data)

    def status(self) -> ReceiverStatus:
        return self.call("/status", None, ReceiverStatus)

    def prewarm(self, metas: list[TensorMetaModel]) -> PrewarmResponse:
        return self.call("/prewarm", PrewarmRequest(metas=metas), PrewarmResponse)

    def prepare(self, req: PrepareRequest) -> PrepareResponse:
        return self.call("/prepare", req, PrepareResponse)

    def gate(self, attempt: str, closed: bool) -> ReceiverStatus:
        return self.call("/gate", GateRequest(attempt=attempt, closed=closed), ReceiverStatus)

    def open_apply(self, attempt: str) -> ReceiverStatus:
        return self.call("/open-apply", AttemptRequest(attempt=attempt), ReceiverStatus)

    def relay_flush(
        self, attempt: str, expected: dict[int, int], timeout_s: float = 30.0
    ) -> RelayFlushResponse:
        req = RelayFlushRequest(attempt=attempt, expected=expected, timeout_s=timeout_s)
        return self.call("/relay-flush", req, RelayFlushResponse, timeout=timeout_s + 30)

    def flush(
        self, attempt: str, expected: dict[int, int], timeout_s: float = 60.0
    ) -> FlushResponse:
        req = FlushRequest(attempt=attempt, expected=expected, timeout_s=timeout_s)
        return self.call("/flush", req, FlushResponse, timeout=timeout_s + 30)

    def stop(self, attempt: str) -> StopResponse:
        return self.call("/stop", AttemptRequest(attempt=attempt), StopResponse)

    def cleanup(self, attempt: str) -> ReceiverStatus:
        return self.call("/cleanup", AttemptRequest(attempt=attempt), ReceiverStatus)

    def commit(self, attempt: str, version: int) -> ReceiverStatus:
        return self.call("/commit", CommitNotice(attempt=attempt, version=version), ReceiverStatus)


@dataclass
class NodeProc:
    name: str
    http: str
    relay: str
    config_path: Path
    applied_log: Path
    proc: ManagedProcess
    ctl: Ctl
    relay_mac: str = ""  # the relay's MAC-only ROUTER ("" without one)


def metric_sum(node: NodeProc, prefix: str) -> float:
    """The sum of every series of the node's /metrics whose line starts with `prefix`."""
    resp = node.ctl.http.request(
        "GET", node.http + "/metrics", headers={"Authorization": f"Bearer {node.ctl.token}"}
    )
    assert resp.status == 200, resp.status
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in resp.data.decode().splitlines()
        if line.startswith(prefix)
    )


@dataclass
class Cluster:
    """Receiver node processes sharing one token; calls fan out to every node in parallel."""

    nodes: list[NodeProc]
    token: str
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(16))

    @property
    def relay_tree(self) -> list[str]:
        return [n.relay for n in self.nodes]

    @property
    def relay_mac_tree(self) -> list[str]:
        """The nodes' MAC-only relay endpoints (empty: the relays link over CurveZMQ only)."""
        macs = [n.relay_mac for n in self.nodes]
        return macs if any(macs) else []

    def each(self, fn: Callable[[NodeProc], T], nodes: Sequence[NodeProc] | None = None) -> list[T]:
        return list(self.pool.map(fn, nodes if nodes is not None else self.nodes))

    def stop_all(self) -> None:
        for n in self.nodes:
            n.proc.stop(grace=5)
        self.pool.shutdown(wait=False, cancel_futures=True)


def node_config(
    name: str,
    *,
    http_port: int,
    relay_port: int | None,
    token: str | None,
    relay_mac_port: int | None = None,
    nodes: list[str],
    applier: dict[str, Any],
    host: str = "127.0.0.1",
    **extra: Any,
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "node": name,
        "host": host,
        "port": http_port,
        "held_version": 0,
        "applier": applier,
        **extra,
    }
    if token is not None:
        cfg["token"] = token
    if relay_port is not None:
        endpoint = f"tcp://{host}:{relay_port}"
        cfg["relay"] = {
            "bind": endpoint,
            "mac_bind": f"tcp://{host}:{relay_mac_port}" if relay_mac_port else None,
            "nodes": nodes,
            "forward": {"ack_timeout_s": 2.0, "max_retries": 1, "unknown_attempt_timeout_s": 5.0},
        }
    return cfg


def start_cluster(
    workdir: Path,
    n: int,
    *,
    applier: Callable[[int, Path], dict[str, Any]],
    relay: bool = True,
    host: str = "127.0.0.1",
    http_bind: str | None = None,
    ctl_host: str | None = None,
    token: str | None = None,
    token_file: Callable[[int], Path] | None = None,
    wrap: Callable[[list[str]], list[str]] | None = None,
    env: dict[str, str] | None = None,
    mac_links: bool = True,
    **extra: Any,
) -> Cluster:
    """Start `n` receiver processes; `applier(i, applied_log)` gives node i's applier config.

    `host` is where relays listen (and HTTP unless `http_bind`); the test reaches HTTP at
    `ctl_host` (default `host`). `wrap` turns the argv into another (`ip netns exec ns ...`).
    `token_file(i)`: node i reads its token from that file (followed: rotations apply live)
    instead of its config; `token` is then what the test's clients send. `mac_links`: each relay
    also binds a MAC-only ROUTER (`Cluster.relay_mac_tree`, for prepares that use it)."""
    token = token or HARNESS_TOKEN
    ports = free_ports(3 * n)
    http_ports, relay_ports, mac_ports = ports[:n], ports[n : 2 * n], ports[2 * n :]
    relay_eps = [f"tcp://{host}:{p}" for p in relay_ports]
    with_mac = relay and mac_links
    env = dict(os.environ) | (env or {})
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("KUBEREFIT_LOG_LEVEL", "INFO")
    nodes: list[NodeProc] = []
    for i in range(n):
        name = f"node{i}"
        log = workdir / f"{name}.applied.jsonl"
        cfg = node_config(
            name,
            http_port=http_ports[i],
            relay_port=relay_ports[i] if relay else None,
            relay_mac_port=mac_ports[i] if with_mac else None,
            token=None if token_file is not None else token,
            nodes=relay_eps if relay else [],
            applier=applier(i, log),
            host=host,
            **extra,
        )
        if http_bind is not None:
            cfg["host"] = http_bind
        if token_file is not None:
            cfg["token_file"] = str(token_file(i))
        path = workdir / f"{name}.json"
        path.write_text(json.dumps(cfg))
        argv = [
            str(REPO / ".venv/bin/python"),
            "-m",
            "refit_sidecar.receiver",
            "--config",
            str(path),
        ]
        argv = wrap(argv) if wrap else argv
        proc = ManagedProcess(name, argv, workdir / f"{name}.log", env=env, cwd=REPO)
        base = f"http://{ctl_host or host}:{http_ports[i]}"
        mac = f"tcp://{host}:{mac_ports[i]}" if with_mac else ""
        nodes.append(
            NodeProc(name, base, relay_eps[i], path, log, proc, Ctl(base, token), relay_mac=mac)
        )

    def start(node: NodeProc) -> None:
        def ready() -> bool:
            status, _ = node.ctl.raw("GET", "/healthz", token=False, timeout=1.0)
            return status == 200

        node.proc.start(ready, timeout=60)

    cluster = Cluster(nodes, token)
    try:
        cluster.each(start)
    except BaseException:
        cluster.stop_all()
        raise
    return cluster
