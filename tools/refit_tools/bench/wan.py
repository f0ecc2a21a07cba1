"""A link that behaves more like one between regions: round-trip delay and packet loss on the
bench's trainer -> rollout link (`netns.Link`), for `kuberefit bench refit --delay-ms --loss`.

This kernel has no `netem`, so both are emulated:

- **delay** in user space: an nftables rule in the trainer namespace redirects the producer's
  connections to the root relay into a small TCP relay (this module's `main`, run in that
  namespace), which holds every chunk for half the round trip in each direction before passing
  it on over the shaped link (its own upstream connection carries a firewall mark, so it is
  not redirected again). Nothing in the product is told about it.
- **loss** with nftables: a `numgen random` rule drops that fraction of the packets arriving
  at either end of the link, in both directions (TCP retransmits them).

How this differs from a real WAN (docs/performance.md): the delay is added per chunk of a TCP
stream between two TCP connections, so each side's TCP sees a short, loss-free hop to the relay
and the relay's buffering (at most `QUEUE_CHUNKS` reads) rather than one long path: the
producer's congestion window is not limited by the round trip as it would be end to end, while
the relay's reads and writes cost CPU on this machine. Loss is uniform and independent per
packet (real loss comes in bursts). Only the producer's connections to the root relay are
delayed; the relay tree inside the rollout namespace stays a local network, as inside a
cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys
import time
from pathlib import Path

from refit_tools.bench.netns import Link, NetnsError
from refit_tools.bench.netns import run_checked as _run
from refit_tools.local.procs import ManagedProcess

#: Firewall mark of the delaying relay's own connections (never redirected).
MARK = 0x4B52
#: The relay's listening port inside the trainer namespace (its own port space).
RELAY_PORT = 17_470
#: Chunks held per direction (bounds the relay's memory to QUEUE_CHUNKS x 64 KiB).
QUEUE_CHUNKS = 256
_TABLE = "kuberefit_wan"


def add_loss(link: Link, fraction: float) -> None:
    """Drop `fraction` of the packets crossing the link, each way, where they arrive (so a lost
    packet used the link's rate, as on a WAN, and the sender gets no local error)."""
    if not 0 < fraction < 1:
        raise ValueError(f"loss must be in (0, 1), got {fraction}")
    per_million = str(max(1, round(fraction * 1_000_000)))
    for ns, dev in ((link.rollout_ns, link.rollout_dev), (link.trainer_ns, link.shaped_dev)):
        _nft(ns, "add", "table", "inet", _TABLE)
        _nft(ns, "add", "chain", "inet", _TABLE, "loss", "{ type filter hook input priority 0; }")
        _nft(
            ns, "add", "rule", "inet", _TABLE, "loss", "iifname", dev,
            "numgen", "random", "mod", "1000000", "<", per_million, "drop",
        )  # fmt: skip


def start_delay(link: Link, root: str, rtt_ms: float, log_dir: Path) -> ManagedProcess:
    """Delay the trainer namespace's connections to `root` (tcp://host:port, on the rollout end
    of the link) by `rtt_ms` of round trip; returns the relay process (stop it at the end)."""
    host, port = root.removeprefix("tcp://").rsplit(":", 1)
    ns = link.trainer_ns
    _nft(ns, "add", "table", "ip", _TABLE)
    _nft(ns, "add", "chain", "ip", _TABLE, "delay", "{ type nat hook output priority -100; }")
    _nft(
        ns, "add", "rule", "ip", _TABLE, "delay", "ip", "daddr", host, "tcp", "dport", port,
        "meta", "mark", "!=", hex(MARK), "redirect", "to", f":{RELAY_PORT}",
    )  # fmt: skip
    argv = [
        sys.executable, "-m", "refit_tools.bench.wan",
        "--to", f"{host}:{port}", "--one-way-ms", str(rtt_ms / 2),
    ]  # fmt: skip
    proc = ManagedProcess("wan-delay", link.wrap(ns, argv), log_dir / "wan-delay.log")
    return proc.start(lambda: _listening(link), timeout=30)


def _listening(link: Link) -> bool:
    out = _run("ip", "netns", "exec", link.trainer_ns, "ss", "-Hltn", f"sport = :{RELAY_PORT}")
    return bool(out.strip())


def _nft(ns: str, *words: str) -> None:
    try:
        _run("ip", "netns", "exec", ns, "nft", *words)
    except NetnsError as exc:
        raise NetnsError(f"{exc} (needs nftables: `apt-get install nftables`)") from exc


# -------------------------------------------------------------------------- the delaying relay
async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy one direction, each chunk written `delay` seconds after it was read."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)

    async def read() -> None:
        while chunk := await reader.read(64 << 10):
            await queue.put((time.monotonic() + delay, chunk))
        await queue.put((time.monotonic() + delay, b""))

    async def write() -> None:
        while True:
            due, chunk = await queue.get()
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if not chunk:
                with contextlib.suppress(OSError):
                    writer.write_eof()
                return
            writer.write(chunk)
            await writer.drain()

    reading = asyncio.create_task(read())
    try:
        await write()
    finally:
        reading.cancel()


async def _serve(to: tuple[str, int], delay: float) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, MARK)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, to)
        except OSError:
            sock.close()
            client_w.close()
            return
        up_r, up_w = await asyncio.open_connection(sock=sock)
        try:
            await asyncio.gather(_pump(client_r, up_w, delay), _pump(up_r, client_w, delay))
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in (up_w, client_w):
                w.close()

    server = await asyncio.start_server(handle, "0.0.0.0", RELAY_PORT)  # noqa: S104 - its netns
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m refit_tools.bench.wan")
    parser.add_argument("--to", required=True, help="HOST:PORT the connections go on to")
    parser.add_argument("--one-way-ms", type=float, required=True, help="delay each way")
    args = parser.parse_args(argv)
    host, port = args.to.rsplit(":", 1)
    asyncio.run(_serve((host, int(port)), args.one_way_ms / 1000))


if __name__ == "__main__":
    main()
