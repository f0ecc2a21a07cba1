"""A local rollout node: a vLLM OpenAI server with the worker extension, and its receiver.

Both are real processes: `python -m vllm.entrypoints.openai.api_server` with the refit control
path loaded through `--middleware` (`refit_sidecar.vllm.control_path`: the refit worker methods,
pause and resume, for a loopback peer with the node's token; never vLLM's development mode) and
`python -m refit_sidecar.receiver` (control plane, relay-tree node, applier that reaches that path
with payload files on /dev/shm). Killing the node kills both, as losing a pod would.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refit_sidecar.vllm.control_path import MIDDLEWARE_QUALNAME
from refit_sidecar.vllm.quirks.cpu_unpacked_layout import ENV_SWITCH
from refit_sidecar.vllm.worker_extension import EXTENSION_QUALNAME
from refit_tools.local.procs import ManagedProcess, free_ports, http_ok
from refit_tools.local.vllm_rpc import vllm_rpc

__all__ = ["LocalNode", "vllm_rpc", "vllm_server_argv", "vllm_server_env"]


def vllm_server_argv(model_dir: Path, host: str, port: int) -> list[str]:
    """A vLLM OpenAI server as a rollout pod runs it: the refit worker extension, the refit
    control path as middleware, no tokenizer, eager, BF16."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        host,
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--enforce-eager",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "256",
        "--worker-extension-cls",
        EXTENSION_QUALNAME,
        "--middleware",
        MIDDLEWARE_QUALNAME,
    ]


def vllm_server_env(token: str) -> dict[str, str]:
    """Its environment: the control path's token, the CPU layout the loaders can write, never
    vLLM's development mode."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", KUBEREFIT_TOKEN=token)
    env.pop("VLLM_SERVER_DEV_MODE", None)
    env[ENV_SWITCH] = "1"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


@dataclass
class LocalNode:
    """One rollout node; `start(model_dir, held_version)` loads that checkpoint densely."""

    name: str
    workdir: Path
    token: str
    relay_port: int = 0
    relay_mac_port: int = 0
    http_port: int = 0
    vllm_port: int = 0
    relay_nodes: list[str] = field(default_factory=list)
    vllm: ManagedProcess | None = None
    receiver: ManagedProcess | None = None
    generation: int = 0

    @property
    def shm_dir(self) -> Path:
        """Where the receiver stages payload files for the vLLM workers (shared memory)."""
        return _shm_root() / f"kuberefit-{os.getpid()}-{self.name}"

    @property
    def relay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.relay_port}"

    @property
    def relay_mac_endpoint(self) -> str:
        """The relay's MAC-only ROUTER, for the other relays ("" before the first start)."""
        return f"tcp://127.0.0.1:{self.relay_mac_port}" if self.relay_mac_port else ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def vllm_url(self) -> str:
        return f"http://127.0.0.1:{self.vllm_port}"

    def start_vllm(self, model_dir: Path, ports: list[int] | None = None) -> None:
        """Launch the server (wait with `wait_vllm`). `ports`: four distinct free ports for
        the server, the receiver and the relay's two ROUTERs (allocate several nodes' at once: a
        port chosen but not yet bound is not reserved)."""
        self.generation += 1
        # Fresh ports per start: the dead generation's ports may have been reused meanwhile.
        # The coordinator passes the current relay endpoints with every prepare.
        (self.vllm_port, self.http_port, self.relay_port, self.relay_mac_port) = (
            ports or free_ports(4)
        )
        self.vllm = ManagedProcess(
            f"{self.name}-vllm",
            vllm_server_argv(model_dir, "127.0.0.1", self.vllm_port),
            self.workdir / f"{self.name}-vllm-{self.generation}.log",
            env=vllm_server_env(self.token),
        ).launch()

    def wait_vllm(self, timeout: float = 300) -> None:
        assert self.vllm is not None
        self.vllm.wait_ready(lambda: http_ok(self.vllm_url + "/health"), timeout=timeout)

    def start_receiver(self, held_version: int | None, *, s3: dict[str, Any] | None = None) -> None:
        """Start the receiver; `held_version=None` when the server's bits are not known to be a
        committed version (a restarted sidecar): the coordinator then restores the node.
        With `s3` (an `S3Config` as JSON) payloads arrive through object storage instead of the
        relay tree."""
        config: dict[str, Any] = {
            "node": self.name,
            "host": "127.0.0.1",
            "port": self.http_port,
            "token": self.token,
            "held_version": held_version,
            "relay": None
            if s3
            else {
                "bind": self.relay_endpoint,
                "mac_bind": self.relay_mac_endpoint or None,
                "nodes": self.relay_nodes,
            },
            "s3": s3,
            "applier": {
                "kind": "vllm",
                "vllm_url": self.vllm_url,
                "shm_dir": str(self.shm_dir),
            },
        }
        path = self.workdir / f"{self.name}-receiver.json"
        path.write_text(json.dumps(config))
        path.chmod(0o600)
        self.receiver = ManagedProcess(
            f"{self.name}-receiver",
            [
                sys.executable,
                "-m",
                "refit_sidecar.receiver",
                "--config",
                str(path),
                "--log-level",
                "WARNING",
            ],
            self.workdir / f"{self.name}-receiver-{self.generation}.log",
        )
        self.receiver.start(lambda: http_ok(self.url + "/healthz"), timeout=60)

    def alive(self) -> bool:
        return bool(self.vllm and self.vllm.alive() and self.receiver and self.receiver.alive())

    def kill(self) -> None:
        """SIGKILL both processes of the node, as a crashed pod."""
        for proc in (self.receiver, self.vllm):
            if proc is not None:
                proc.kill()

    def stop(self) -> None:
        for proc in (self.receiver, self.vllm):
            if proc is not None:
                proc.stop()
        shutil.rmtree(self.shm_dir, ignore_errors=True)

    def rpc(self, method: str, *args: Any) -> list[Any]:
        return vllm_rpc(self.vllm_url, self.token, method, *args)


def _shm_root() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
