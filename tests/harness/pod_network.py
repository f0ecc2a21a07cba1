"""A pod network for the harness: each pod its own network namespace on one bridge, as a CNI
plugin gives it (`eth0` with the pod's IP, a default route), plus the names a cluster's DNS
would answer, kept in one hosts file that every pod mounts at /etc/hosts.

The test's own namespace holds the bridge's address (.254), so processes outside the pods (the
operator, a trainer run on a loopback address) reach every pod IP, as nodes reach pods.
Needs root, iproute2 and util-linux. `close()` removes the namespaces and the bridge.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness.netns import NetnsError, require_netns_tools
from tests.harness.netns import run_checked as _run

#: Bridges are 10.219.<s>.0/24.
_NET = "10.219"


@dataclass(frozen=True)
class PodAddress:
    """A pod's place on the network: `exec_prefix` runs a command in its namespace."""

    ns: str
    ip: str
    dev: str = "eth0"

    @property
    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]

    @contextlib.contextmanager
    def dropping(self, *ports: int) -> Iterator[None]:
        """While inside: the pod drops TCP arriving at `ports` (an nftables rule in its
        namespace), so what streams to it stalls instead of arriving late. Needs nftables."""
        nft = [*self.exec_prefix, "nft"]
        _run(*nft, "add", "table", "inet", "kr-drop")
        try:
            hook = "{ type filter hook input priority 0; }"
            _run(*nft, "add", "chain", "inet", "kr-drop", "in", hook)
            dports = "{ " + ", ".join(str(p) for p in ports) + " }"
            _run(*nft, "add", "rule", "inet", "kr-drop", "in", "tcp", "dport", dports, "drop")
            yield
        finally:
            _run(*nft, "delete", "table", "inet", "kr-drop")


@dataclass
class PodNetwork:
    """One bridge and the pods on it (see the module docstring)."""

    bridge: str
    subnet: str  # e.g. 10.219.7
    hosts_file: Path
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _names: dict[str, tuple[str, list[str]]] = field(default_factory=dict)  # ns -> (ip, names)

    @property
    def gateway(self) -> str:
        return f"{self.subnet}.254"

    @classmethod
    def create(cls, hosts_file: Path) -> PodNetwork:
        require_netns_tools()
        tag = secrets.token_hex(2)
        net = cls(f"krs{tag}", f"{_NET}.{int(tag, 16) % 250 + 1}", hosts_file)
        try:
            _run("ip", "link", "add", net.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{net.gateway}/24", "dev", net.bridge)
            _run("ip", "link", "set", net.bridge, "up")
        except BaseException:
            net.close()
            raise
        net._write_hosts()
        return net

    def add(self, names: list[str] | None = None) -> PodAddress:
        """A new namespace with `eth0` on the bridge; `names` resolve to it in every pod."""
        i = next(self._ids)
        if i >= 254:
            raise NetnsError(f"bridge {self.bridge}: no address left")
        ns, outer, inner = f"{self.bridge}-{i}", f"{self.bridge}o{i}", f"{self.bridge}i{i}"
        ip = f"{self.subnet}.{i}"
        _run("ip", "netns", "add", ns)
        try:
            _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            _run("ip", "link", "set", inner, "netns", ns)
            _run("ip", "-n", ns, "link", "set", inner, "name", "eth0")
            _run("ip", "link", "set", outer, "master", self.bridge)
            _run("ip", "link", "set", outer, "up")
            _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "route", "add", "default", "via", self.gateway)
        except BaseException:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
            raise
        self._names[ns] = (ip, list(names or []))
        self._write_hosts()
        return PodAddress(ns, ip)

    def remove(self, address: PodAddress) -> None:
        """Delete the pod's namespace (its veth goes with it) and its names."""
        subprocess.run(["ip", "netns", "del", address.ns], capture_output=True, check=False)
        if self._names.pop(address.ns, None) is not None:
            self._write_hosts()

    def _write_hosts(self) -> None:
        """Rewritten in place: every pod's bind mount of the file sees the change."""
        lines = ["127.0.0.1\tlocalhost"]
        lines += [f"{ip}\t{' '.join(names)}" for ip, names in self._names.values() if names]
        self.hosts_file.parent.mkdir(parents=True, exist_ok=True)
        with self.hosts_file.open("r+" if self.hosts_file.exists() else "w") as fh:
            fh.seek(0)
            fh.write("\n".join(lines) + "\n")
            fh.truncate()

    def close(self) -> None:
        for ns in list(self._names):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self._names.clear()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
