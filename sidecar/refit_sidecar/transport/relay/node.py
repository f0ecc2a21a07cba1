"""A relay-tree node: a ROUTER that validates, deduplicates, stages and forwards payloads.

Per DATA frame (paper §7.1, NeMo RL guide "Transport and apply"): authenticate the frame (the
token in the metadata on the CurveZMQ ROUTER, the frame tag on the MAC-only one; unauthenticated
or malformed frames are dropped and counted, never answered), ask the
sink whether the attempt is current and the id new, verify MAC, identity and digest, let
the sink register the payload and submit its local staging, submit at most two child forwards
(the balanced binary tree of `tree.py`) to per-child bounded DEALER clients, then answer with the
staged ACK. The sink is the node's relay inbound (`inbound.RelayInbound`, over the receiver's
intake); this module knows nothing about applying.

Two ROUTERs, one per kind of link (`frames.LinkSecurity`): the CurveZMQ one (`bind`) takes the
producers' frames from the other cluster, and the relays' when a policy encrypts every link; the
plain one (`mac_bind`, optional) takes the MAC-only links of the relays inside the rollout
cluster: a ZeroMQ PLAIN server that admits only connections with the link password derived
from an accepted token (`curve.secure_mac_server`, through the context's ZAP handler). A node
forwards to a child's MAC-only ROUTER when the attempt's prepare names one (`relay_mac_tree`),
else to its CurveZMQ one. On a MAC-only link a body whose payload MAC or identity does not
verify is dropped unanswered, not rejected: whoever saw the pod network's traffic (and so the
link password) can send there, and a spliced or forged frame must not fail an attempt (its
sender resends after the ACK deadline).

Token rotation (`refit_protocol.kit.tokens`): frames, answers and MACs of every accepted token are
taken; the ROUTER serves with the ring's sending token's Curve keys and is bound again (same
address) when that token changes, after the rotation's grace (the rules: `router_keys.py`).

`drain(attempt)` is the relay-flush barrier: it waits until every forward of the attempt has been
acknowledged by the child or has failed (a dead child fails within its retry budget; the
bookkeeping: `forwards.py`).

Nothing ends the ROUTER loop but `close()`: an error raised while following the ring (a token
source, a rebind), counting handshakes or handling one frame is caught, counted
(`kuberefit_relay_loop_errors_total{where}`), logged at most every `HANDSHAKE_LOG_S` per kind,
and the loop carries on, so the node keeps answering handshakes with the keys it has.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import threading
import time
from concurrent.futures import Future
from typing import Any, Protocol

import structlog
import zmq
from prometheus_client import CollectorRegistry
from zmq.utils.monitor import recv_monitor_message

from refit_protocol.keys import link_password, payload_mac_key
from refit_protocol.kit.tokens import TokenRing, as_ring, ring_accepts
from refit_sidecar.codec.errors import CodecError
from refit_sidecar.transport.errors import TransportError
from refit_sidecar.transport.relay import tree
from refit_sidecar.transport.relay.config import RelayConfig
from refit_sidecar.transport.relay.curve import (
    HANDSHAKE_FAILURES,
    allow_clients,
    forget_mac_server,
    secure_mac_server,
    secure_server,
)
from refit_sidecar.transport.relay.dealer import RelayDealer
from refit_sidecar.transport.relay.forwards import ForwardLedger
from refit_sidecar.transport.relay.frames import (
    ACK,
    DATA,
    END,
    PROBE,
    AckMeta,
    AckStatus,
    FrameMeta,
    LinkSecurity,
    Verdict,
    parse_meta,
    sign_frame,
    tag_verifies,
    verify_body,
)
from refit_sidecar.transport.relay.metrics import RelayMetrics
from refit_sidecar.transport.relay.router_keys import RefusedHandshakes, RouterKeys

log = structlog.get_logger("kuberefit.relay")
#: Refused handshakes are logged at most this often (with a count), and at most this many
#: monitor events are read per turn of the ROUTER loop.
HANDSHAKE_LOG_S, MAX_MONITOR_EVENTS = 10.0, 64


class RelaySink(Protocol):
    """What a relay needs from the node's receiver (implemented by `inbound.RelayInbound`,
    which answers from the node's transport-neutral sink)."""

    @property
    def node(self) -> str: ...

    def relay_tree(self, attempt: str) -> list[str]:
        """Relay endpoints in tree order for `attempt` (empty: not known)."""
        ...

    def relay_mac_tree(self, attempt: str) -> list[str]:
        """The same nodes' MAC-only endpoints ("" for a node forwarded to over CurveZMQ;
        empty: every link of `attempt` is encrypted)."""
        ...

    def relay_check(self, meta: FrameMeta, *, probe: bool) -> Verdict | None:
        """Cheap pre-check; None means "new and admissible now" (READY for a probe)."""
        ...

    def relay_stage(
        self, meta: FrameMeta, body: memoryview, keep: object, children: int
    ) -> Verdict:
        """Register the verified payload and submit its local staging (atomic re-check).

        `body` passed `verify_body(meta, body)`: it is the payload `meta.digest` names (its MAC
        verified, or it hashed to the digest); the sink relies on it and does not check the
        same bytes again."""
        ...

    def relay_release(self, meta: FrameMeta, error: str | None) -> None:
        """One child forward of a staged payload finished (error: it failed)."""
        ...

    def relay_end(self, meta: FrameMeta) -> Verdict:
        """A producer's stream-end mark."""
        ...

    def relay_fail(self, attempt: str, reason: str) -> None:
        """A frame failed a check: the attempt fails on this node."""
        ...


class RelayNode:
    """The ROUTER of one node plus its child forwarders."""

    def __init__(
        self,
        config: RelayConfig,
        sink: RelaySink,
        *,
        token: str | TokenRing | None,
        registry: CollectorRegistry | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.config = config
        self.sink = sink
        self._ring = as_ring(token)
        self._ctx = context or zmq.Context.instance()
        self._keys = RouterKeys(self._ring, functools.partial(allow_clients, self._ctx, id(self)))
        self.metrics = RelayMetrics(registry, self._ring)
        self._error_logged: dict[str, float] = {}
        self._clients: dict[tuple[str, LinkSecurity], RelayDealer] = {}
        self._forwards = ForwardLedger()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._monitor: zmq.Socket[Any] | None = None
        self._mac_monitor: zmq.Socket[Any] | None = None  # the MAC-only ROUTER's handshakes
        self._refused = RefusedHandshakes(HANDSHAKE_LOG_S)
        self.bound: str = ""
        self.mac_bound: str = ""  # the MAC-only ROUTER's address ("" without one)
        self._mac_sock: zmq.Socket[Any] | None = None

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> RelayNode:
        sock = self._open(self.config.bind)
        self._sock: zmq.Socket[Any] | None = sock
        self.bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.config.mac_bind:
            try:
                self._mac_sock = self._open_plain(self.config.mac_bind)
            except Exception:
                self._close_socket(sock)
                raise
            self.mac_bound = self._mac_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="relay-router", daemon=True)
        self._thread.start()
        log.info("relay.listening", node=self.sink.node, bind=self.bound, mac_bind=self.mac_bound)
        return self

    def _open_plain(self, endpoint: str) -> zmq.Socket[Any]:
        """The MAC-only ROUTER: connections only with an accepted token's link password
        (`_admit_peer`; none needed without a token, on loopback), every frame checked by its
        tag."""
        sock: zmq.Socket[Any] = self._ctx.socket(zmq.ROUTER)
        if self._ring.accepted():
            secure_mac_server(sock, self._ctx, id(self), self._admit_peer)
            self._mac_monitor = sock.get_monitor_socket(HANDSHAKE_FAILURES)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_payload_bytes + (1 << 16))
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    def _open(self, endpoint: str) -> zmq.Socket[Any]:
        """A ROUTER serving the ring's sending token, bound to `endpoint` (retried briefly: a
        rebind may find the previous listener still closing)."""
        serving = self._keys.take()
        sock: zmq.Socket[Any] = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_payload_bytes + (1 << 16))
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        if serving:
            secure_server(sock, serving)
            self._monitor = sock.get_monitor_socket(HANDSHAKE_FAILURES)
        deadline = time.monotonic() + 5.0
        while True:
            try:
                sock.bind(endpoint)
                return sock
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    self._close_socket(sock)
                    raise
                time.sleep(0.05)

    def _close_socket(self, sock: zmq.Socket[Any]) -> None:
        if self._monitor is not None:
            sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        sock.close(linger=0)

    def _follow_rotation(self) -> bool:
        """Admit the ring's accepted clients; bind again when the sending token changed.
        True when the socket was replaced."""
        if not self._keys.follow():
            return False
        if self._sock is not None:
            self._close_socket(self._sock)
            self._sock = None
        self._reopen()
        return True

    def _reopen(self) -> bool:
        """Bind the relay's address again with the keys of the sending token; on failure the
        node serves no relay frame until a later try succeeds (logged, retried by `_run`)."""
        try:
            self._sock = self._open(self.bound)
        except Exception as exc:
            log.error("relay.rebind_failed", node=self.sink.node, bind=self.bound, error=str(exc))
            return False
        log.info("relay.keys_rotated", node=self.sink.node, bind=self.bound)
        return True

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        for client in list(self._clients.values()):
            client.close()
        self._clients.clear()

    # -- barrier and abort ------------------------------------------------------------------------
    def drain(self, attempt: str, timeout: float) -> list[str]:
        """Wait until no forward of `attempt` is pending; the forwarding errors seen."""
        return self._forwards.drain(attempt, timeout)

    def abort(self, attempt: str) -> None:
        """Stop forwarding `attempt` (its pending forwards fail and are released)."""
        for client in list(self._clients.values()):
            client.abort(attempt, "attempt stopped on the relay")

    def forget(self, attempt: str) -> None:
        self._forwards.forget(attempt)

    # -- the ROUTER loop --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._serve_socket()
                except Exception as exc:  # a bug: count it, say so, keep serving
                    self._loop_error("loop", exc)
                    self._stop.wait(0.1)
        finally:
            with contextlib.suppress(Exception):
                allow_clients(self._ctx, id(self), ())
            with contextlib.suppress(Exception):
                forget_mac_server(self._ctx, id(self))
            if self._sock is not None:
                self._close_socket(self._sock)
            if self._mac_sock is not None:
                if self._mac_monitor is not None:
                    self._mac_sock.disable_monitor()
                    self._mac_monitor.close(linger=0)
                self._mac_sock.close(linger=0)

    def _serve_socket(self) -> None:
        """Serve the current socket until it is replaced (a rotation) or the node stops."""
        if self._sock is None and not self._reopen():
            self._stop.wait(1.0)  # a rebind failed: try again
            return
        sock = self._sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if self._mac_sock is not None:
            poller.register(self._mac_sock, zmq.POLLIN)
        for monitor in (self._monitor, self._mac_monitor):
            if monitor is not None:
                poller.register(monitor, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if self._follow_rotation():
                    return  # a new socket (or none yet): start over
            except Exception as exc:  # the ring or a rebind failed: keep the keys in force
                self._loop_error("rotation", exc)
                if self._sock is not sock:
                    return
            events = dict(poller.poll(100))
            if events:
                self._serve(events)

    def _loop_error(self, where: str, exc: BaseException) -> None:
        """Count an error the loop survived; log it at most every HANDSHAKE_LOG_S per place."""
        self.metrics.loop_errors.labels(where).inc()
        now = time.monotonic()
        if now - self._error_logged.get(where, float("-inf")) >= HANDSHAKE_LOG_S:
            self._error_logged[where] = now
            log.error(
                "relay.loop_error",
                node=self.sink.node,
                where=where,
                error=f"{type(exc).__name__}: {exc}",
                exc_info=exc,
            )

    def _serve(self, events: dict[Any, int]) -> None:
        for monitor in (self._monitor, self._mac_monitor):
            if monitor is not None and monitor in events:
                try:
                    self._handshake_failures(monitor)
                except Exception as exc:  # counting must never stop the relay
                    self._loop_error("monitor", exc)
        for sock, link in ((self._sock, LinkSecurity.CURVE), (self._mac_sock, LinkSecurity.MAC)):
            if sock is not None and sock in events:
                self._take(sock, link)

    def _take(self, sock: zmq.Socket[Any], link: LinkSecurity) -> None:
        """Handle every frame waiting on one ROUTER."""
        while True:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                self._handle(frames, link)
            except Exception as exc:  # never let one frame kill the relay
                self._loop_error("frame", exc)

    def _handshake_failures(self, monitor: zmq.Socket[Any]) -> None:
        """Count connections refused at a handshake (CurveZMQ, or the MAC-only port's link
        password: no frame of theirs was ever buffered); log
        them at most once per HANDSHAKE_LOG_S with a count, so a flood cannot flood the log.
        At most MAX_MONITOR_EVENTS are read per turn: frames of real peers are not starved."""
        for _ in range(MAX_MONITOR_EVENTS):
            try:
                event = recv_monitor_message(monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            self.metrics.dropped.labels(self._refused.count(event)).inc()
        due = self._refused.report(time.monotonic())
        if due is not None:
            log.warning(
                "relay.handshakes_refused", node=self.sink.node, count=due[0], last_peer=due[1]
            )

    def _handle(self, frames: list[zmq.Frame], link: LinkSecurity) -> None:
        mac = link is LinkSecurity.MAC
        head = 4 if mac else 3  # [ident, kind, meta] and, on a MAC-only link, the tag
        kind = frames[1].bytes if len(frames) >= head else b""
        if kind not in (DATA, PROBE, END) or len(frames) != head + (kind == DATA):
            self.metrics.dropped.labels("malformed").inc()
            return
        ident, raw = frames[0].bytes, frames[2].buffer
        if mac and not tag_verifies(self._ring.accepted(), kind, raw, frames[3].buffer):
            self._unauthenticated(link, "frame tag")
            return
        meta = parse_meta(raw)
        if meta is None:
            self.metrics.dropped.labels("malformed").inc()
            return
        if not mac and not ring_accepts(self._ring, meta.token):
            self._unauthenticated(link, "token", meta.attempt)
            return
        if kind == PROBE:
            verdict: Verdict | None = self.sink.relay_check(meta, probe=True) or (
                AckStatus.READY,
                "",
            )
        elif kind == END:
            verdict = self._end(meta)
        else:
            verdict = self._data(meta, frames[-1], link)
        if verdict is None:  # a MAC-only link's body that did not verify: dropped
            return
        self.metrics.frames.labels(kind.decode(), verdict[0].value).inc()
        self._reply(ident, "END" if kind == END else "DATA", meta, verdict, link)

    def _admit_peer(self, password: bytes) -> bool:
        """May a connection with `password` use the MAC-only ROUTER? Only with the link
        password of an accepted token (runs in the ZAP handler's thread; a refusal is a failed
        handshake, counted and logged from the socket's monitor like the CurveZMQ port's)."""
        return any(hmac.compare_digest(password, link_password(t)) for t in self._ring.accepted())

    def _unauthenticated(self, link: LinkSecurity, what: str, attempt: str = "") -> None:
        """Count a dropped frame; log it at most every HANDSHAKE_LOG_S per kind of link."""
        self.metrics.dropped.labels("unauthenticated").inc()
        now, where = time.monotonic(), f"unauthenticated-{link.value}"
        if now - self._error_logged.get(where, float("-inf")) < HANDSHAKE_LOG_S:
            return
        self._error_logged[where] = now
        log.warning(
            "relay.unauthenticated_frame",
            node=self.sink.node,
            link=link.value,
            failed=what,
            attempt=attempt,
        )

    def _data(self, meta: FrameMeta, frame: zmq.Frame, link: LinkSecurity) -> Verdict | None:
        pre = self.sink.relay_check(meta, probe=False)
        if pre is not None:
            return pre
        kids = self._children(meta)
        if kids is None:
            return (
                AckStatus.REJECTED,
                f"{self.config.endpoint} is not in the attempt's relay tree",
            )
        body = frame.buffer
        self.metrics.bytes.inc(body.nbytes)
        try:
            verify_body(meta, body, mac_key=[payload_mac_key(t) for t in self._ring.accepted()])
        except CodecError as exc:
            reason = f"payload {meta.producer}/{meta.payload_id}: {type(exc).__name__}: {exc}"
            if link is LinkSecurity.MAC:  # anyone can send here: the attempt is not failed
                self._unauthenticated(link, reason, meta.attempt)
                return None
            self.sink.relay_fail(meta.attempt, reason)
            return (AckStatus.REJECTED, reason)
        verdict = self.sink.relay_stage(meta, body, frame, len(kids))
        if verdict[0] is AckStatus.STAGED:
            root = meta.root if meta.root is not None else self._index(meta.attempt)
            fwd = meta.model_copy(update={"root": root, "token": ""})
            for child in kids:
                self._forward(child, fwd, frame)
        return verdict

    def _end(self, meta: FrameMeta) -> Verdict:
        verdict = self.sink.relay_end(meta)
        if verdict[0] in (AckStatus.STAGED, AckStatus.DUPLICATE):
            kids = self._children(meta) or []
            root = meta.root if meta.root is not None else self._index(meta.attempt)
            fwd = meta.model_copy(update={"root": root, "token": ""})
            for child in kids:
                self._forward(child, fwd, None)
        return verdict

    def _index(self, attempt: str) -> int | None:
        nodes = self.sink.relay_tree(attempt)
        try:
            return nodes.index(self.config.endpoint)
        except ValueError:
            return None

    def _children(self, meta: FrameMeta) -> list[tuple[str, str]] | None:
        """This node's children for `meta`'s subtree: (tree endpoint, MAC-only endpoint or "")."""
        nodes = self.sink.relay_tree(meta.attempt)
        index = self._index(meta.attempt)
        if index is None:
            return None
        root = meta.root if meta.root is not None else index
        if root >= len(nodes):
            return None
        macs = self.sink.relay_mac_tree(meta.attempt)
        macs = macs if len(macs) == len(nodes) else [""] * len(nodes)
        return [(nodes[i], macs[i]) for i in tree.children(index, root, len(nodes))]

    def _client(self, endpoint: str, link: LinkSecurity) -> RelayDealer:
        client = self._clients.get((endpoint, link))
        if client is not None and client.dead:  # its I/O thread ended: a fresh one
            client.close()
            client = None
        if client is None:
            client = RelayDealer(
                endpoint,
                token=self._ring,
                config=self.config.forward,
                context=self._ctx,
                name=f"forward->{endpoint}",
                link=link,
            )
            self._clients[(endpoint, link)] = client
        return client

    def _forward(self, kid: tuple[str, str], meta: FrameMeta, body: zmq.Frame | None) -> None:
        child, mac_endpoint = kid
        if not self._forwards.start(meta.attempt, child):
            self.metrics.forwards.labels("skipped").inc()
            if body is not None:
                self.sink.relay_release(meta, f"child {child} already failed")
            return
        client: RelayDealer | None = None
        try:
            if mac_endpoint:
                client = self._client(mac_endpoint, LinkSecurity.MAC)
            else:
                client = self._client(child, LinkSecurity.CURVE)
            fut = client.submit_data(meta, body) if body is not None else client.submit_end(meta)
        except Exception as exc:  # e.g. no socket or pipe left: this forward fails, typed
            fut = Future()
            fut.set_exception(TransportError(f"cannot forward to {child}: {exc!r}"))
        fut.add_done_callback(lambda f: self._forwarded(child, client, meta, body is not None, f))

    def _forwarded(
        self,
        child: str,
        client: RelayDealer | None,
        meta: FrameMeta,
        data: bool,
        fut: Future[AckStatus],
    ) -> None:
        exc = fut.exception()
        via = "" if client is None or client.endpoint == child else f" via {client.endpoint}"
        error = None if exc is None else f"forward to {child}{via}: {type(exc).__name__}: {exc}"
        error, first = self._forwards.finish(meta.attempt, child, error)
        if first and client is not None:
            # One payload gave up on this child: fail its other pending forwards now instead of
            # letting each wait out its own retries (relay flush reports the error either way).
            client.abort(meta.attempt, f"child {child} failed")
        self.metrics.forwards.labels("ok" if error is None else "failed").inc()
        if error is not None:
            log.warning("relay.forward_failed", node=self.sink.node, child=child, error=error)
        if data:
            self.sink.relay_release(meta, error)

    def _reply(
        self, ident: bytes, kind: str, meta: FrameMeta, verdict: Verdict, link: LinkSecurity
    ) -> None:
        mac = link is LinkSecurity.MAC
        sending = self._ring.sending() or ""
        ack = AckMeta(
            kind="END" if kind == "END" else "DATA",
            attempt=meta.attempt,
            producer=meta.producer,
            payload_id=meta.payload_id,
            digest=meta.digest,
            status=verdict[0],
            error=verdict[1],
            node=self.sink.node,
            token="" if mac else sending,  # never in the clear
        )
        sock = self._mac_sock if mac else self._sock
        if sock is None:
            return
        raw = ack.model_dump_json().encode()
        frames = [ident, ACK, raw, sign_frame(sending, ACK, raw)] if mac else [ident, ACK, raw]
        with contextlib.suppress(zmq.ZMQError):
            sock.send_multipart(frames)
