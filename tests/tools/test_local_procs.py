"""Ports for child processes cannot race: they come from below the kernel's ephemeral range
(no outgoing connection or bind to port 0 takes them meanwhile) and one process never hands the
same port out twice, even after the first holder let it go."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from refit_tools.local import procs


def ephemeral_range() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def test_ports_are_outside_the_ephemeral_range_and_never_repeat() -> None:
    low, _ = ephemeral_range()
    seen: set[int] = set()
    for _ in range(50):
        ports = procs.free_ports(4)
        assert len(set(ports)) == 4
        assert all(procs.PORT_RANGE[0] <= p < procs.PORT_RANGE[1] <= low for p in ports)
        assert not seen & set(ports)  # the earlier ones are free again, yet not handed out
        seen |= set(ports)
    assert procs.free_port() not in seen


def test_a_port_taken_meanwhile_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    # Above the kernel's ephemeral ports (32768-60999) and outside the real PORT_RANGE, which
    # the suite's processes draw from: nothing else binds here while the test runs.
    low = 61000
    monkeypatch.setattr(procs, "PORT_RANGE", (low, low + 30))
    monkeypatch.setattr(procs, "_handed_out", set())
    taken = [socket.socket() for _ in range(20)]
    try:
        for n, s in enumerate(taken):
            s.bind(("127.0.0.1", low + n))  # the first 20 of the 30 are busy
        assert sorted(procs.free_ports(10)) == list(range(low + 20, low + 30))
        with pytest.raises(procs.ComponentError, match="no 1 free ports"):
            procs.free_port()  # the 10 free ones are handed out already
    finally:
        for s in taken:
            s.close()
