"""An on-path observer for the link tests: capture raw frames on a network device, rebuild a
TCP byte stream from them, and replay it to a listener (what an attacker between the clusters
could do with what it sees).

`python -m tests.harness.wire_capture capture DEV OUT` (run inside a network namespace, as root)
writes every frame seen on DEV to OUT (4-byte length + frame) until SIGTERM;
`python -m tests.harness.wire_capture replay HOST PORT FILE` connects and sends FILE's bytes.
No tcpdump needed: an AF_PACKET socket is enough.
"""

from __future__ import annotations

import argparse
import signal
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

ETH_P_ALL = 0x0003


@dataclass(frozen=True)
class Segment:
    """One IPv4 TCP segment's addressing, sequence number and payload."""

    src: str
    dst: str
    sport: int
    dport: int
    seq: int
    payload: bytes


def capture(dev: str, out: Path) -> None:
    # Protocol 0 at creation: no frame is queued until the bind names the device (a socket
    # created with ETH_P_ALL sees every interface's traffic until then).
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)  # no drops under load
    sock.bind((dev, ETH_P_ALL))  # Python converts the protocol to network order itself
    sock.settimeout(0.2)
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    out.with_suffix(".ready").touch()
    with out.open("wb") as fh:
        while not stop:
            try:
                frame = sock.recv(1 << 18)  # GSO/GRO frames can exceed 64 KiB
            except TimeoutError:
                continue
            fh.write(struct.pack("<I", len(frame)) + frame)


def frames(path: Path) -> list[bytes]:
    data, out, pos = path.read_bytes(), [], 0
    while pos + 4 <= len(data):
        (n,) = struct.unpack_from("<I", data, pos)
        out.append(data[pos + 4 : pos + 4 + n])
        pos += 4 + n
    return out


def segments(path: Path) -> list[Segment]:
    """The IPv4 TCP segments among the captured Ethernet frames."""
    found = []
    for frame in frames(path):
        if len(frame) < 34 or frame[12:14] != b"\x08\x00":
            continue
        ip = frame[14:]
        ihl, proto = (ip[0] & 0x0F) * 4, ip[9]
        total = struct.unpack_from(">H", ip, 2)[0]
        if proto != 6:
            continue
        tcp = ip[ihl:total]
        sport, dport, seq = struct.unpack_from(">HHI", tcp, 0)
        offset = (tcp[12] >> 4) * 4
        found.append(
            Segment(
                socket.inet_ntoa(ip[12:16]),
                socket.inet_ntoa(ip[16:20]),
                sport,
                dport,
                seq,
                bytes(tcp[offset:]),
            )
        )
    return found


def client_stream(segs: list[Segment], dst: str, dport: int) -> bytes:
    """What the first client connection to dst:dport sent, in sequence order (retransmissions
    counted once)."""
    mine = [s for s in segs if s.dst == dst and s.dport == dport and s.payload]
    if not mine:
        return b""
    first = mine[0].sport
    isn = mine[0].seq
    # Offsets from the first segment, modulo 2**32: sequence numbers wrap.
    by_offset = {(s.seq - isn) % (1 << 32): s.payload for s in mine if s.sport == first}
    return b"".join(by_offset[k] for k in sorted(by_offset))


def replay(host: str, port: int, data: bytes, linger_s: float = 2.0) -> str:
    """Send `data` on a fresh connection; how the listener reacted ("reset": it hung up)."""
    with socket.create_connection((host, port), timeout=5) as sock:
        try:
            sock.sendall(data)
            time.sleep(linger_s)
        except (ConnectionResetError, BrokenPipeError):
            return "reset"
    return "sent"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.harness.wire_capture")
    sub = parser.add_subparsers(dest="cmd", required=True)
    cap = sub.add_parser("capture")
    cap.add_argument("dev")
    cap.add_argument("out", type=Path)
    rep = sub.add_parser("replay")
    rep.add_argument("host")
    rep.add_argument("port", type=int)
    rep.add_argument("file", type=Path)
    args = parser.parse_args()
    if args.cmd == "capture":
        capture(args.dev, args.out)
    else:
        print(replay(args.host, args.port, args.file.read_bytes()))


if __name__ == "__main__":
    main()
