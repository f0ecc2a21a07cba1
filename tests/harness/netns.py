"""Two emulated clusters joined by a rate-limited link (HARNESS.md "Networks between clusters").

`trainer` and `rollout` network namespaces are joined by a veth pair whose trainer-side egress
(the payload direction) is shaped with `tc tbf`. A second, unshaped veth joins the test's own
namespace to `rollout`, so the test can drive the receivers' control plane without touching the
shaped link. Everything is deleted at `close()` (deleting a namespace deletes its veth ends).
Needs root and iproute2.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field


class NetnsError(RuntimeError):
    pass


def _run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.stdout.strip()}")


@dataclass
class Link:
    trainer_ns: str
    rollout_ns: str
    trainer_ip: str
    rollout_ip: str
    control_ip: str  # the rollout namespace's address on the unshaped control veth
    rate_mbit: float
    _created: list[str] = field(default_factory=list)
    _host_veth: str = ""

    @property
    def rate_bytes_s(self) -> float:
        return self.rate_mbit * 1e6 / 8

    def wrap(self, ns: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]

    def close(self) -> None:
        for ns in reversed(self._created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)
        if self._host_veth:
            subprocess.run(
                ["ip", "link", "del", self._host_veth], capture_output=True, timeout=30, check=False
            )
        self._created.clear()


def create_link(rate_mbit: float, *, latency_ms: int = 100) -> Link:
    """trainer --(tbf rate_mbit)--> rollout, plus host <-> rollout for control traffic."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        raise NetnsError("the link test needs root and iproute2 (`ip`, `tc`): run it as root")
    tag = secrets.token_hex(3)
    subnet = int(tag[:2], 16) % 200 + 20
    link = Link(
        trainer_ns=f"krt-{tag}",
        rollout_ns=f"krr-{tag}",
        trainer_ip=f"10.213.{subnet}.1",
        rollout_ip=f"10.213.{subnet}.2",
        control_ip=f"10.214.{subnet}.2",
        rate_mbit=rate_mbit,
    )
    t, r = link.trainer_ns, link.rollout_ns
    vt, vr, vh, vc = f"krvt{tag}", f"krvr{tag}", f"krvh{tag}", f"krvc{tag}"
    try:
        for ns in (t, r):
            _run("ip", "netns", "add", ns)
            link._created.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "link", "add", vt, "type", "veth", "peer", "name", vr)
        _run("ip", "link", "set", vt, "netns", t)
        _run("ip", "link", "set", vr, "netns", r)
        _run("ip", "-n", t, "addr", "add", f"{link.trainer_ip}/30", "dev", vt)
        _run("ip", "-n", r, "addr", "add", f"{link.rollout_ip}/30", "dev", vr)
        _run("ip", "-n", t, "link", "set", vt, "up")
        _run("ip", "-n", r, "link", "set", vr, "up")
        burst = max(16_000, int(link.rate_bytes_s / 250))  # ~4 ms of tokens
        _run(
            "tc",
            "-n",
            t,
            "qdisc",
            "add",
            "dev",
            vt,
            "root",
            "tbf",
            "rate",
            f"{rate_mbit}mbit",
            "burst",
            str(burst),
            "latency",
            f"{latency_ms}ms",
        )
        # control veth: host namespace <-> rollout namespace, unshaped
        _run("ip", "link", "add", vh, "type", "veth", "peer", "name", vc)
        link._host_veth = vh
        _run("ip", "link", "set", vc, "netns", r)
        _run("ip", "addr", "add", f"10.214.{subnet}.1/30", "dev", vh)
        _run("ip", "-n", r, "addr", "add", f"{link.control_ip}/30", "dev", vc)
        _run("ip", "link", "set", vh, "up")
        _run("ip", "-n", r, "link", "set", vc, "up")
    except BaseException:
        link.close()
        raise
    return link
