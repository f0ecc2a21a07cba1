"""The socket's ceiling for `kuberefit bench transport`: a bare pyzmq forward of the same frames.

Each bare node is a process (as each receiver node is) with a ROUTER secured like the product's
relays for the run's kind of link (CurveZMQ keyed by `curve_keys(token)`, or a plain socket
for MAC-only links) and one DEALER per child of the same balanced binary tree
(`refit_sidecar.transport.relay.tree`). Per DATA frame it checks what the mode's security
needs and nothing else (on a MAC-only link the frame's tag; on either the body's payload MAC),
answers an ACK to the sender and forwards the frame, unchanged and without a copy, to its
children; nothing is parsed, deduplicated or staged (with `keep`, each frame is held until the
end, as a node that stages payloads holds them: fresh memory for every frame). When a node has
received every frame it
tells the bench on a PUSH socket. The bench sends the same DATA frames as the relay measurement
through the same number of processes and the same tree, with no send window (the product's
dealers keep 4 frames in flight and wait for ACKs) and no flush call, so `relay GB/s / bare
GB/s` is what the product's hop (authentication, MAC and identity checks, dedup, staging,
windowed forwards, flush) keeps of what ZeroMQ itself can carry here. With fewer cores than
processes both share the cores, so the ratio can come out near (or even above) 1.

`aesgcm=True` measures a cipher the product does not have yet, for the choice issue 36 asks
for ("the fastest sound cipher available on the host, measured against CurveZMQ"): plain
sockets, every DATA frame's body sealed with AES-256-GCM (a random 96-bit nonce per frame, the
metadata as associated data) by the sender inside the timed window, and every node opening it
(which authenticates the link and yields the bytes a node must read) before checking the payload
MAC, answering and forwarding the sealed frame unchanged: one encryption per payload however
deep the tree, one decryption per node.

Benchmark only: the bare node accepts any Curve client key (no ZAP handler) and never runs
outside a benchmark.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import zmq

from refit_protocol.keys import payload_mac_key
from refit_sidecar.codec.decode import verify_mac
from refit_sidecar.transport.relay import tree
from refit_sidecar.transport.relay.curve import curve_keys
from refit_sidecar.transport.relay.frames import LinkSecurity, tag_verifies
from refit_tools.local.procs import free_ports

ACK, DATA, PROBE = b"ACK", b"DATA", b"PROBE"
DONE = b"DONE"
#: A bare node that has not seen its frames after this long gives up (a broken run).
IDLE_TIMEOUT_S = 120.0


def aesgcm_of(token: str) -> Any:
    """The benchmark's AES-256-GCM key, derived from the token (`cryptography`, with the
    CPU's AES instructions where it has them)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(hashlib.sha256(b"kuberefit-bench-aesgcm\0" + token.encode()).digest())


def seal(frames: Sequence[Sequence[bytes]], token: str) -> list[list[bytes]]:
    """AES-GCM frames [DATA, meta, nonce, sealed body] of plain [DATA, meta, body] frames."""
    aead = aesgcm_of(token)
    out = []
    for kind, meta, body in frames:
        nonce = os.urandom(12)
        out.append([kind, meta, nonce, aead.encrypt(nonce, body, meta)])
    return out


def _server(ctx: zmq.Context[Any], token: str, endpoint: str, curve: bool) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve:
        keys = curve_keys(token)
        sock.curve_server = True
        sock.curve_secretkey, sock.curve_publickey = keys.secret, keys.public
    sock.bind(endpoint)
    return sock


def _client(ctx: zmq.Context[Any], token: str, endpoint: str, curve: bool) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve:
        keys = curve_keys(token)
        sock.curve_secretkey, sock.curve_publickey = keys.secret, keys.public
        sock.curve_serverkey = keys.public
    sock.connect(endpoint)
    return sock


def serve_node(
    index: int,
    endpoints: Sequence[str],
    done: str,
    frames: int,
    token: str,
    links: LinkSecurity = LinkSecurity.CURVE,
    aesgcm: bool = False,
    keep: bool = False,
) -> None:
    """Forward `frames` DATA frames down the tree rooted at position 0, then report DONE.
    `keep`: hold every received frame until the end, as a node that stages payloads must."""
    ctx: zmq.Context[Any] = zmq.Context()
    curve, key = links is LinkSecurity.CURVE and not aesgcm, payload_mac_key(token)
    aead = aesgcm_of(token) if aesgcm else None
    router = _server(ctx, token, endpoints[index], curve)
    kids = [
        _client(ctx, token, endpoints[i], curve) for i in tree.children(index, 0, len(endpoints))
    ]
    report: zmq.Socket[Any] = ctx.socket(zmq.PUSH)
    report.connect(done)
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    for kid in kids:
        poller.register(kid, zmq.POLLIN)
    seen, acks, last = 0, 0, time.monotonic()
    held: list[list[zmq.Frame]] = []
    prober, probe_acks = b"", 0
    while seen < frames or acks < frames * len(kids):
        events = dict(poller.poll(1000))
        if not events and time.monotonic() - last > IDLE_TIMEOUT_S:
            raise SystemExit(f"bare node {index}: {seen} of {frames} frames, then nothing")
        if router in events:
            msg = router.recv_multipart(copy=False)
            kind = msg[1].bytes
            if kind == PROBE:  # answered once the whole subtree is connected
                prober = msg[0].bytes
                for kid in kids:
                    kid.send(PROBE)
                if not kids:
                    router.send_multipart([prober, ACK, PROBE])
                continue
            if aead is not None:  # opening the body authenticates the link
                verify_mac(aead.decrypt(msg[3].bytes, msg[4].bytes, msg[2].bytes), key)
            elif not curve and not tag_verifies(
                [token], msg[1].bytes, msg[2].buffer, msg[3].buffer
            ):
                raise SystemExit(f"bare node {index}: a frame's tag does not verify")
            else:
                verify_mac(msg[-1].buffer, key)
            router.send_multipart([msg[0], ACK, DATA])
            if keep:
                held.append(msg)
            for kid in kids:
                kid.send_multipart(msg[1:], copy=False)
            seen, last = seen + 1, time.monotonic()
            if seen == frames:
                report.send(DONE)
        for kid in kids:
            if kid in events:
                answer = kid.recv_multipart()
                if answer[-1] == PROBE:
                    probe_acks += 1
                    if probe_acks == len(kids):
                        router.send_multipart([prober, ACK, PROBE])
                else:
                    acks += 1
    report.close(linger=1000)
    ctx.destroy(linger=0)


def _node_args(
    index: int,
    done: str,
    frames: int,
    endpoints: Sequence[str],
    links: LinkSecurity,
    aesgcm: bool,
    keep: bool = False,
) -> list[str]:
    return [
        *("--index", str(index), "--done", done, "--frames", str(frames)),
        *(["--aesgcm"] if aesgcm else []),
        *(["--keep"] if keep else []),
        *("--links", links.value, *endpoints),
    ]


def run_bare_forward(
    n: int,
    frames: Sequence[Sequence[bytes]],
    token: str,
    links: LinkSecurity = LinkSecurity.CURVE,
    *,
    aesgcm: bool = False,
    keep: bool = False,
    timeout_s: float = 300.0,
) -> float:
    """Seconds from the first send until every one of `n` bare nodes received every frame.
    `aesgcm`: `frames` are plain [DATA, meta, body] frames, sealed (`seal`) one by one by the
    sender inside the timed window; `links` is then ignored (plain sockets). `keep`: every node
    holds each frame it received until the end instead of dropping it once forwarded."""
    ports = free_ports(n + 1)
    endpoints = [f"tcp://127.0.0.1:{p}" for p in ports[:n]]
    done = f"tcp://127.0.0.1:{ports[n]}"
    ctx: zmq.Context[Any] = zmq.Context()
    pull: zmq.Socket[Any] = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(done)
    env = os.environ | {"KUBEREFIT_TOKEN": token}
    procs: list[subprocess.Popen[bytes]] = []
    sender = _client(ctx, token, endpoints[0], links is LinkSecurity.CURVE and not aesgcm)
    try:
        for i in range(n):
            args = _node_args(i, done, len(frames), endpoints, links, aesgcm, keep)
            argv = [sys.executable, "-m", __name__, *args]
            procs.append(subprocess.Popen(argv, env=env))
        sender.send(PROBE)  # answered when every link of the tree has completed its handshake
        if not sender.poll(int(timeout_s * 1000)):
            raise RuntimeError("the bare root never answered")
        sender.recv_multipart()
        t0 = time.monotonic()
        for f in frames:
            sender.send_multipart(seal([f], token)[0] if aesgcm else list(f), copy=False)
        for _ in range(n):
            if not pull.poll(int(timeout_s * 1000)):
                raise RuntimeError("a bare node never received every frame")
            pull.recv()
        elapsed = time.monotonic() - t0
        for _ in frames:
            if not sender.poll(int(timeout_s * 1000)):
                raise RuntimeError("the bare root did not answer every frame")
            sender.recv_multipart()
        return elapsed
    finally:
        sender.close(linger=0)
        pull.close(linger=0)
        ctx.destroy(linger=0)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A bare forwarding node (benchmark only).")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--done", required=True)
    parser.add_argument("--frames", type=int, required=True)
    parser.add_argument("--links", choices=[m.value for m in LinkSecurity], default="curve")
    parser.add_argument("--aesgcm", action="store_true", help="AES-GCM sealed bodies.")
    parser.add_argument("--keep", action="store_true", help="Hold every frame received.")
    parser.add_argument("endpoints", nargs="+")
    args = parser.parse_args(argv)
    token = os.environ["KUBEREFIT_TOKEN"]
    links = LinkSecurity(args.links)
    serve_node(
        args.index, args.endpoints, args.done, args.frames, token, links, args.aesgcm, args.keep
    )


if __name__ == "__main__":
    main()
