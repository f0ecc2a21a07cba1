"""The sending half of a relay hop: a ZeroMQ DEALER with a window, retries and backpressure.

Producers use it to reach their root relay; every relay uses one per child to forward. One I/O
thread owns the socket (ZeroMQ sockets are not thread-safe); `submit` only enqueues and returns
a future that resolves with the relay's final answer. Retries resend the same metadata and the
same body bytes, so the relay's (attempt, producer, payload) + digest dedup makes them harmless.

Backpressure: a relay whose queue is full answers WAIT and drops the body. The client then holds
the payload (the window bounds how many) and sends a body-less PROBE with exponential backoff
until the relay answers READY, and only then the body again. No frame is lost on a full queue and
no relay buffers more than it admitted. These rules (window, deadlines, retries, backoff) are the
hop's `SendSchedule` (`send_schedule.py`); this module owns the sockets and the I/O thread.

Token rotation (`refit_protocol.kit.tokens`): frames carry the ring's sending token; answers must
carry an accepted one. A relay serves with one key, its own ring's sending token, which during a
rotation (or on a pod whose copy of the Secret is older) need not be this client's. The client
therefore connects once per *likely* token (`TokenRing.likely`: the sending one, the newest, the
one it replaced, the second listed; at most four), each socket sending only once its handshake
completed (ZMQ_IMMEDIATE), so frames go to whichever of those keys the relay serves with. Only
when the relay refuses the handshake of every likely key (a Secret listing many tokens, a relay
serving one deep in the list) are the other accepted tokens tried, `HUNT_WIDTH` at a time, each
until the relay refuses it; the one that completes a handshake is kept while it is accepted. So
the sockets of a hop do not grow with the number of tokens a Secret lists (at most four likely,
one found and `HUNT_WIDTH` being tried), and no token is left untried: the hop's `KeyHunt`
(`key_hunt.py`) decides which links it keeps. In-flight frames are resent when the socket they
went out on is closed.

MAC-only links (`link=LinkSecurity.MAC`, relay to relay inside the rollout cluster): one plain
socket, no key hunt; the metadata carries no token, every frame carries a tag made with the
ring's sending token's frame key (`frames.sign_frame`), and an answer counts only with a tag of
an accepted token's key. The socket connects as a ZeroMQ PLAIN client with the sending token's
link password (`curve.mac_client`); libzmq never retries a refused handshake, so a refused link
is connected again `MAC_RETRY_S` later (a relay whose copy of a rotated Secret is older).

Failures: any error in the send path resolves the frames it concerns with a `TransportError`
(a socket that cannot be opened, e.g. libzmq's socket limit, fails every pending frame at once);
an unexpected error in the I/O thread fails what is pending and the client carries on, and a
client whose thread ended anyway fails every later submit at once. No future is left pending.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import structlog
import zmq
from zmq.utils.monitor import recv_monitor_message

from refit_protocol.kit.tokens import TokenRing, as_ring, ring_accepts
from refit_sidecar.transport.errors import TransportError
from refit_sidecar.transport.relay.config import DealerConfig
from refit_sidecar.transport.relay.curve import HANDSHAKE_FAILURES, mac_client, secure_client
from refit_sidecar.transport.relay.frames import (
    ACK,
    DATA,
    END,
    PROBE,
    AckMeta,
    AckStatus,
    FrameMeta,
    LinkSecurity,
    parse_ack,
    sign_frame,
    tag_verifies,
)
from refit_sidecar.transport.relay.key_hunt import KeyHunt, LinkState
from refit_sidecar.transport.relay.send_schedule import Body, Outgoing, SendSchedule

log = structlog.get_logger("kuberefit.transport.client")

#: Errors of the same kind are logged at most this often (each is counted in `errors`).
ERROR_LOG_S = 10.0
_LINK_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILURES
#: A MAC-only link the relay refused is connected again this much later.
MAC_RETRY_S = 0.5


@dataclass(eq=False, kw_only=True)
class _Link(LinkState):
    """One DEALER socket connected with one token's keys ("" : a plain connection)."""

    sock: zmq.Socket[Any]
    monitor: zmq.Socket[Any]


class RelayDealer:
    """A DEALER connected to one relay endpoint; thread-safe `submit_*`, `abort`, `close`."""

    def __init__(
        self,
        endpoint: str,
        *,
        token: str | TokenRing | None,
        config: DealerConfig | None = None,
        context: zmq.Context[Any] | None = None,
        name: str = "relay-client",
        link: LinkSecurity = LinkSecurity.CURVE,
    ) -> None:
        self.endpoint = endpoint
        self.name = name
        self.config = config or DealerConfig()
        self.link = link
        self._ring = as_ring(token)
        self._mac = link is LinkSecurity.MAC
        self._mac_retry_at: float | None = None  # when to connect a refused MAC-only link again
        self._links: dict[str, _Link] = {}  # by token, the likely ones first
        self._monitors: dict[zmq.Socket[Any], _Link] = {}
        self._open_error: str | None = None  # why a socket last could not be opened
        self._ctx = context or zmq.Context.instance()
        self._cmds: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._schedule = SendSchedule(self.config, self._put, name=name, endpoint=endpoint)
        self._keys = KeyHunt(
            as_ring(None) if self._mac else self._ring,  # a MAC-only link: one plain socket
            self._links,
            open_link=self._open_link,
            close_link=self._close_link,
            pending=lambda: self._schedule.pending,
            name=name,
            endpoint=endpoint,
        )
        self._closed = False
        self._dead = False  # the I/O thread ended: every submit fails at once
        self._life = threading.Lock()  # orders submits against the thread's end
        self._logged: dict[str, float] = {}
        self.bad_replies = 0
        self.errors = 0  # errors caught in the I/O thread (each resolved pending frames)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    # -- public, any thread ---------------------------------------------------------------------
    def submit_data(self, meta: FrameMeta, body: Body) -> Future[AckStatus]:
        """Send one payload; the future resolves with STAGED/DUPLICATE or a TransportError."""
        size = body.nbytes if isinstance(body, memoryview) else len(body)
        return self._submit(DATA, meta, body, size)

    def submit_end(self, meta: FrameMeta) -> Future[AckStatus]:
        """Announce the end of a producer's stream (meta.total set)."""
        return self._submit(END, meta, None, 0)

    def abort(self, attempt: str, reason: str) -> None:
        """Fail every pending frame of `attempt` with TransportStoppedError, send nothing more."""
        self._command("abort", (attempt, reason))

    @property
    def resends(self) -> int:
        """Frames sent again after no answer came in time."""
        return self._schedule.resends

    @property
    def dead(self) -> bool:
        """True when the I/O thread ended (closed, or a failure it could not survive)."""
        return self._dead

    def close(self, timeout: float = 5.0) -> None:
        """Fail what is pending, close the socket (linger 0) and join the I/O thread."""
        if self._closed:
            return
        self._command("close", None)
        self._thread.join(timeout)
        self._closed = True
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- internals --------------------------------------------------------------------------------
    def _submit(
        self, kind: bytes, meta: FrameMeta, body: Body | None, size: int
    ) -> Future[AckStatus]:
        fut: Future[AckStatus] = Future()
        try:
            token = "" if self._mac else self._ring.sending() or ""
            meta = meta.model_copy(update={"token": token})
            item = Outgoing(kind, meta, meta.model_dump_json().encode(), body, size, fut)
            item.backoff = self.config.wait_backoff_min_s
        except Exception as exc:
            fut.set_exception(TransportError(f"{self.name}: cannot send: {exc!r}"))
            return fut
        with self._life:
            if self._closed or self._dead:
                fut.set_exception(TransportError(f"{self.name}: client closed"))
                return fut
            self._command("submit", item)
        return fut

    def _command(self, what: str, arg: Any) -> None:
        self._cmds.put((what, arg))
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def _run(self) -> None:
        try:
            self._poller = zmq.Poller()
            self._poller.register(self._wake_r, zmq.POLLIN)
        finally:
            self._ready.set()
        try:
            while self._take_commands():
                try:
                    self._turn()
                except Exception as exc:
                    # A bug or a socket error: resolve what is pending, start over, carry on.
                    self._error("turn", exc)
                    self._schedule.fail_all(TransportError(f"{self.name}: I/O failed: {exc!r}"))
                    self._close_links(time.monotonic())
                    self._keys.resync()
                    time.sleep(0.05)  # a failure that repeats must not spin
        except Exception as exc:  # pragma: no cover - the poller itself failed: never hang
            log.exception("relay_client.crashed", client=self.name)
            self._schedule.fail_all(TransportError(f"{self.name}: I/O thread failed: {exc!r}"))
        finally:
            with self._life:
                self._dead = True
            self._schedule.fail_all(TransportError(f"{self.name}: client closed"))
            self._drain_commands()
            self._close_links(time.monotonic())

    def _turn(self) -> None:
        now = time.monotonic()
        if self._mac_retry_at is not None and now >= self._mac_retry_at:
            self._mac_retry_at = None
            refused = self._links.get("")
            if refused is not None and refused.refused:
                self._close_link(refused, now)  # `sync` connects it again at once
        self._keys.sync(now)
        self._schedule.expire(now)
        if not self._links and self._keys.open_failed is not None and self._schedule.pending:
            # No socket at all (libzmq refused them): nothing can be sent, say so at once.
            self._schedule.fail_all(TransportError(f"{self.name}: {self._open_error}"))
        self._schedule.transmit(now)
        timeout_ms = self._schedule.poll_timeout_ms(time.monotonic())
        if self._mac_retry_at is not None:  # wake for the retry of a refused link
            due = int((self._mac_retry_at - time.monotonic()) * 1000) + 1
            timeout_ms = min(timeout_ms, max(due, 0))
        for s, _ in self._poller.poll(timeout_ms):
            if not isinstance(s, zmq.Socket):
                with contextlib.suppress(BlockingIOError, OSError):
                    os.read(self._wake_r, 4096)
            elif s.closed:
                continue  # its link was closed by an event read earlier in this turn
            elif s in self._monitors:
                self._link_events(self._monitors[s], time.monotonic())
            else:
                self._receive(s)

    def _drain_commands(self) -> None:
        """Fail the submits that reached the queue after the thread's last look."""
        while True:
            try:
                what, arg = self._cmds.get_nowait()
            except queue.Empty:
                return
            if what == "submit" and not arg.future.done():
                arg.future.set_exception(TransportError(f"{self.name}: client closed"))

    def _error(self, what: str, exc: BaseException) -> None:
        """Count an error; log it at most every ERROR_LOG_S per kind."""
        self.errors += 1
        now = time.monotonic()
        if now - self._logged.get(what, float("-inf")) >= ERROR_LOG_S:
            self._logged[what] = now
            log.error(
                "relay_client.error",
                client=self.name,
                endpoint=self.endpoint,
                what=what,
                error=repr(exc),
                errors=self.errors,
            )

    # -- the links: one socket per token the key hunt wants --------------------------------------
    def _open_link(self, token: str, fallback: bool, now: float) -> bool:
        """Connect one socket with `token`'s keys; False (pending frames failed when no link is
        left to send on) when libzmq refuses, e.g. at its socket limit."""
        sock: zmq.Socket[Any] | None = None
        monitor: zmq.Socket[Any] | None = None
        try:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            sock.setsockopt(zmq.CONNECT_TIMEOUT, int(self.config.connect_timeout_s * 1000))
            sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # sends only once its handshake completed
            if token:
                secure_client(sock, token)
            elif self._mac and (sending := self._ring.sending()):
                mac_client(sock, sending)
            monitor = sock.get_monitor_socket(_LINK_EVENTS)
            sock.connect(self.endpoint)
        except zmq.ZMQError as exc:
            if sock is not None:
                if monitor is not None:
                    with contextlib.suppress(zmq.ZMQError):
                        sock.disable_monitor()
                    monitor.close(linger=0)
                sock.close(linger=0)
            self._error("socket", exc)
            self._open_error = f"cannot open a socket to {self.endpoint}: {exc}"
            if not self._links:
                self._schedule.fail_all(TransportError(f"{self.name}: {self._open_error}"))
            return False
        link = _Link(token=token, fallback=fallback, opened=now, sock=sock, monitor=monitor)
        self._links[token] = link
        self._monitors[monitor] = link
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)
        return True

    def _close_link(self, link: _Link, now: float) -> None:
        self._links.pop(link.token, None)
        self._monitors.pop(link.monitor, None)
        for sock in (link.sock, link.monitor):
            with contextlib.suppress(KeyError):
                self._poller.unregister(sock)
        with contextlib.suppress(zmq.ZMQError):
            link.sock.disable_monitor()
        link.monitor.close(linger=0)
        link.sock.close(linger=0)
        self._schedule.link_closed(link.token, now)  # its answers can no longer arrive

    def _close_links(self, now: float) -> None:
        for link in list(self._links.values()):
            self._close_link(link, now)

    def _link_events(self, link: _Link, now: float) -> None:
        while self._links.get(link.token) is link:
            try:
                event = recv_monitor_message(link.monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self._keys.handshake(link, int(event.get("event", 0)), now)
            if self._mac and link.refused and self._mac_retry_at is None:
                self._mac_retry_at = now + MAC_RETRY_S

    def _take_commands(self) -> bool:
        while True:
            try:
                what, arg = self._cmds.get_nowait()
            except queue.Empty:
                return True
            if what == "close":
                return False
            if what == "submit":
                self._schedule.add(arg)
            elif what == "abort":
                self._schedule.abort(*arg)

    def _put(self, item: Outgoing, probe: bool) -> str | None:
        """Hand a frame to a link (the schedule's `put`); the token of the one that took it."""
        token = self._ring.sending() or ""
        kind = PROBE if probe else item.kind
        frames: list[Any]
        if self._mac:  # tagged with the token in force now (it may have rotated)
            frames = [kind, item.meta_json, sign_frame(token, kind, item.meta_json)]
        else:
            if item.meta.token != token:  # rotated since it was queued: send the one in force
                item.meta = item.meta.model_copy(update={"token": token})
                item.meta_json = item.meta.model_dump_json().encode()
            frames = [kind, item.meta_json]
        if not probe and item.body is not None:
            frames.append(item.body)
        # Only a link whose handshake completed takes it (ZMQ_IMMEDIATE): the ready ones first.
        for link in sorted(self._links.values(), key=lambda link: not link.ready):
            try:
                link.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return link.token
            except zmq.Again:
                continue
        return None

    def _receive(self, sock: zmq.Socket[Any]) -> None:
        while True:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            ack = self._answer(frames)
            if ack is None:
                self.bad_replies += 1
                continue
            key = (ack.kind, ack.attempt, ack.producer, ack.payload_id, ack.digest)
            self._schedule.answer(key, ack.status, ack.error, ack.node, time.monotonic())

    def _answer(self, frames: list[bytes]) -> AckMeta | None:
        """The relay's answer if it is well-formed and authenticated (an accepted token in it,
        or on a MAC-only link a tag of an accepted token's key); None otherwise."""
        if not frames or frames[0] != ACK or len(frames) != (3 if self._mac else 2):
            return None
        if self._mac and not tag_verifies(self._ring.accepted(), ACK, frames[1], frames[2]):
            return None
        ack = parse_ack(frames[1])
        if ack is None or (not self._mac and not ring_accepts(self._ring, ack.token)):
            return None
        return ack
