"""The WAN emulation of `bench refit` (`refit_tools.bench.wan`) on a real link between two
namespaces: a connection from the trainer side to the rollout side is delayed by the round
trip asked for, in both directions, and transparently (the client dials the real address);
packet loss drops about the fraction asked for, each way."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from refit_tools.bench.wan import add_loss, start_delay
from tests.harness.netns import create_link

ECHO = (
    "import socket; s = socket.create_server(('{host}', {port})); c, _ = s.accept(); "
    "[c.sendall(d) for d in iter(lambda: c.recv(4096), b'')]"
)
UDP_ECHO = (
    "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
    "s.bind(('{host}', 18002)); [s.sendto(*s.recvfrom(64)) for _ in iter(int, 1)]"
)
UDP_CLIENT = (
    "import socket, time; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
    "s.setsockopt(socket.SOL_SOCKET, 33, 8 << 20); "  # SO_RCVBUFFORCE: keeps every echo
    "s.settimeout(1); [(s.sendto(b'x', ('{host}', 18002)), time.sleep(0.001)) "
    "for _ in range(1000)]; n = 0\n"
    "try:\n    while True: s.recv(64); n += 1\nexcept OSError: print(n)"
)
CLIENT = (
    "import socket, sys, time; c = socket.create_connection(('{host}', {port})); "
    "t = time.monotonic(); c.sendall(b'ping'); c.recv(4); print(time.monotonic() - t)"
)


def test_the_delay_is_a_round_trip_on_the_real_address(tmp_path: Path) -> None:
    link = create_link(0)
    echo = None
    try:
        port = 18_001
        echo = subprocess.Popen(
            link.wrap(
                link.rollout_ns,
                [sys.executable, "-c", ECHO.format(host=link.rollout_ip, port=port)],
            )
        )
        time.sleep(0.5)
        relay = start_delay(link, f"tcp://{link.rollout_ip}:{port}", 300, tmp_path)
        try:
            client = [sys.executable, "-c", CLIENT.format(host=link.rollout_ip, port=port)]
            out = subprocess.run(
                link.wrap(link.trainer_ns, client),
                capture_output=True, text=True, timeout=30, check=True,
            )  # fmt: skip
        finally:
            relay.stop()
        rtt = float(out.stdout)
        assert 0.3 <= rtt < 1.0, rtt  # 150 ms each way, once
    finally:
        if echo is not None:
            echo.kill()
        link.close()


def test_loss_drops_about_the_fraction_asked_each_way() -> None:
    link = create_link(0)
    echo = None
    try:
        add_loss(link, 0.3)  # a datagram and its echo each cross: 1 - 0.7^2 = 51% lost
        echo = subprocess.Popen(
            link.wrap(
                link.rollout_ns, [sys.executable, "-c", UDP_ECHO.format(host=link.rollout_ip)]
            )
        )
        time.sleep(0.5)
        client = [sys.executable, "-c", UDP_CLIENT.format(host=link.rollout_ip)]
        out = subprocess.run(
            link.wrap(link.trainer_ns, client),
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        back = int(out.stdout) / 1000
        assert 0.35 <= back <= 0.63, back
    finally:
        if echo is not None:
            echo.kill()
        link.close()
