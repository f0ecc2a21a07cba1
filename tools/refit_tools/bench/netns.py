"""Two emulated clusters joined by a rate-limited link (docs/performance.md, "Refit end to end").

`trainer` and `rollout` network namespaces are joined by a veth pair whose trainer-side egress
(the payload direction) is shaped with `tc tbf`. A second, unshaped veth joins the caller's own
namespace to `rollout`, so the caller can drive the receivers' control plane without touching
the shaped link; `trainer_control=True` adds a third one to `trainer` (for a producer's control
plane). Everything is deleted by `close()` (deleting a namespace deletes its veth ends).
Needs root and iproute2. Used by `kuberefit bench refit` and by the link tests.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass, field

#: The payload link's addresses are 10.213.<s>.0/30; control veths 10.214.<s> (rollout) and
#: 10.215.<s> (trainer). <s> is chosen so that no host route of another link uses it.
_PAYLOAD_NET, _ROLLOUT_CTL_NET, _TRAINER_CTL_NET = "10.213", "10.214", "10.215"


class NetnsError(RuntimeError):
    """The namespaces or the shaped link could not be set up (message says what to do)."""


#: Deadlines (ACK windows, timeouts) on an unshaped link are sized for this rate: far below
#: what two cores move through a veth, so a slow moment never fails a run.
UNSHAPED_DEADLINE_BYTES_S = 50e6


def require_netns_tools() -> None:
    """Fail early, with a clear message, when namespaces cannot be created here."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsError(
            f"{', '.join(missing)} not found: install iproute2 (`apt-get install iproute2`)"
        )
    if os.geteuid() != 0:
        raise NetnsError(
            "network namespaces and tc need root: run as root (e.g. `sudo -E .venv/bin/kuberefit "
            "bench refit`)"
        )


def run_checked(*argv: str) -> str:
    """Run a setup command (ip, tc, nft); its stdout, or NetnsError with its message."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


@dataclass
class Link:
    """A created link; `close()` removes everything it made (idempotent)."""

    trainer_ns: str
    rollout_ns: str
    trainer_ip: str  # trainer end of the shaped veth
    rollout_ip: str  # rollout end of the shaped veth (bind relays here)
    control_ip: str  # the rollout namespace's address on the unshaped control veth
    rate_mbit: float
    trainer_control_ip: str = ""  # the trainer namespace's control address (trainer_control)
    shaped_dev: str = ""  # the tbf-shaped device, inside trainer_ns
    rollout_dev: str = ""  # the payload veth's other end, inside rollout_ns
    _created: list[str] = field(default_factory=list)
    _host_veths: list[str] = field(default_factory=list)

    @property
    def shaped(self) -> bool:
        """False for rate 0: the veth is left unshaped (as fast as the two cores move bytes)."""
        return self.rate_mbit > 0

    @property
    def rate_bytes_s(self) -> float | None:
        """The tbf rate (None when unshaped)."""
        return self.rate_mbit * 1e6 / 8 if self.shaped else None

    @property
    def deadline_bytes_s(self) -> float:
        """The rate deadlines are sized for: the tbf rate, or UNSHAPED_DEADLINE_BYTES_S."""
        return self.rate_bytes_s or UNSHAPED_DEADLINE_BYTES_S

    def wrap(self, ns: str, argv: list[str]) -> list[str]:
        """`argv` run inside namespace `ns` (`ip netns exec` execs, so the PID is argv's)."""
        return ["ip", "netns", "exec", ns, *argv]

    def shaped_bytes(self) -> int:
        """Bytes sent over the payload link so far (L2 frames): the tbf qdisc's count, or the
        veth's transmit counter when the link is unshaped."""
        if not self.shaped:
            out = run_checked(
                "ip", "-n", self.trainer_ns, "-s", "-j", "link", "show", "dev", self.shaped_dev
            )
            return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])
        out = run_checked(
            "tc", "-n", self.trainer_ns, "-s", "-j", "qdisc", "show", "dev", self.shaped_dev
        )
        for qdisc in json.loads(out or "[]"):
            if qdisc.get("kind") == "tbf":
                return int(qdisc.get("bytes", 0))
        raise NetnsError(f"no tbf qdisc on {self.shaped_dev} in {self.trainer_ns}")

    def cut(self, seconds: float) -> None:
        """Take the payload link down for `seconds` (its rollout end: the trainer side loses
        carrier and every packet on the link is lost), then up again; blocks meanwhile.
        The control veths stay up, as a cluster's own network does when the link between
        the clusters drops."""
        run_checked("ip", "-n", self.rollout_ns, "link", "set", self.rollout_dev, "down")
        try:
            time.sleep(seconds)
        finally:
            run_checked("ip", "-n", self.rollout_ns, "link", "set", self.rollout_dev, "up")

    def close(self) -> None:
        for ns in reversed(self._created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)
        for dev in self._host_veths:
            subprocess.run(["ip", "link", "del", dev], capture_output=True, timeout=30, check=False)
        self._created.clear()
        self._host_veths.clear()


def _free_subnet() -> int:
    """A third octet no host route uses yet (several links may exist at once)."""
    routes = run_checked("ip", "-o", "-4", "route", "show")
    for _ in range(64):
        s = secrets.randbelow(200) + 20
        if f"{_ROLLOUT_CTL_NET}.{s}." not in routes and f"{_TRAINER_CTL_NET}.{s}." not in routes:
            return s
    raise NetnsError("no free 10.214.x/10.215.x subnet for the control veths")


def create_link(rate_mbit: float, *, latency_ms: int = 100, trainer_control: bool = False) -> Link:
    """trainer --(tbf rate_mbit; 0: unshaped)--> rollout, plus host <-> rollout (and host <->
    trainer) for control traffic."""
    require_netns_tools()
    tag = secrets.token_hex(3)
    s = _free_subnet()
    link = Link(
        trainer_ns=f"krt-{tag}",
        rollout_ns=f"krr-{tag}",
        trainer_ip=f"{_PAYLOAD_NET}.{s}.1",
        rollout_ip=f"{_PAYLOAD_NET}.{s}.2",
        control_ip=f"{_ROLLOUT_CTL_NET}.{s}.2",
        rate_mbit=rate_mbit,
        shaped_dev=f"krvt{tag}",
        rollout_dev=f"krvr{tag}",
    )
    t, r = link.trainer_ns, link.rollout_ns
    vt, vr = link.shaped_dev, link.rollout_dev
    try:
        for ns in (t, r):
            run_checked("ip", "netns", "add", ns)
            link._created.append(ns)
            run_checked("ip", "-n", ns, "link", "set", "lo", "up")
        run_checked("ip", "link", "add", vt, "type", "veth", "peer", "name", vr)
        link._host_veths.append(vt)  # until both ends moved; deleting a missing link is harmless
        run_checked("ip", "link", "set", vt, "netns", t)
        run_checked("ip", "link", "set", vr, "netns", r)
        run_checked("ip", "-n", t, "addr", "add", f"{link.trainer_ip}/30", "dev", vt)
        run_checked("ip", "-n", r, "addr", "add", f"{link.rollout_ip}/30", "dev", vr)
        run_checked("ip", "-n", t, "link", "set", vt, "up")
        run_checked("ip", "-n", r, "link", "set", vr, "up")
        if link.rate_bytes_s is not None:
            _shape(link, latency_ms)
        link.control_ip = _control_veth(link, r, f"krvh{tag}", f"krvc{tag}", _ROLLOUT_CTL_NET, s)
        if trainer_control:
            link.trainer_control_ip = _control_veth(
                link, t, f"krvg{tag}", f"krvd{tag}", _TRAINER_CTL_NET, s
            )
    except BaseException:
        link.close()
        raise
    return link


def _shape(link: Link, latency_ms: int) -> None:
    """tbf on the trainer end of the payload veth (the payload direction)."""
    assert link.rate_bytes_s is not None
    burst = max(16_000, int(link.rate_bytes_s / 250))  # ~4 ms of tokens
    run_checked(
        "tc",
        "-n",
        link.trainer_ns,
        "qdisc",
        "add",
        "dev",
        link.shaped_dev,
        "root",
        "tbf",
        "rate",
        f"{link.rate_mbit}mbit",
        "burst",
        str(burst),
        "latency",
        f"{latency_ms}ms",
    )


def _control_veth(link: Link, ns: str, host_dev: str, ns_dev: str, net: str, s: int) -> str:
    """An unshaped veth between the caller's namespace and `ns`; returns `ns`'s address."""
    run_checked("ip", "link", "add", host_dev, "type", "veth", "peer", "name", ns_dev)
    link._host_veths.append(host_dev)
    run_checked("ip", "link", "set", ns_dev, "netns", ns)
    run_checked("ip", "addr", "add", f"{net}.{s}.1/30", "dev", host_dev)
    run_checked("ip", "-n", ns, "addr", "add", f"{net}.{s}.2/30", "dev", ns_dev)
    run_checked("ip", "link", "set", host_dev, "up")
    run_checked("ip", "-n", ns, "link", "set", ns_dev, "up")
    return f"{net}.{s}.2"
