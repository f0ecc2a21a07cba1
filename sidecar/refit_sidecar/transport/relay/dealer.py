"""The sending half of a relay hop: a ZeroMQ DEALER with a window, retries and backpressure.

Producers use it to reach their root relay; every relay uses one per child to forward. One I/O
thread owns the socket (ZeroMQ sockets are not thread-safe); `submit` only enqueues and returns
a future that resolves with the relay's final answer. Retries resend the same metadata and the
same body bytes, so the relay's (attempt, producer, payload) + digest dedup makes them harmless.

Backpressure: a relay whose queue is full answers WAIT and drops the body. The client then holds
the payload (the window bounds how many) and sends a body-less PROBE with exponential backoff
until the relay answers READY, and only then the body again. No frame is lost on a full queue and
no relay buffers more than it admitted.

Token rotation (`refit_protocol.tokens`): frames carry the ring's sending token; answers must
carry an accepted one. A relay serves with one key, its own ring's sending token, which during a
rotation (or on a pod whose copy of the Secret is older) need not be this client's. The client
therefore connects once per *likely* token (`TokenRing.likely`: the sending one, the newest, the
one it replaced, the second listed; at most four), each socket sending only once its handshake
completed (ZMQ_IMMEDIATE), so frames go to whichever of those keys the relay serves with. Only
when the relay refuses the handshake of every likely key (a Secret listing many tokens, a relay
serving one deep in the list) are the other accepted tokens tried, `HUNT_WIDTH` at a time, each
until the relay refuses it; the one that completes a handshake is kept while it is accepted. So
the sockets of a hop do not grow with the number of tokens a Secret lists (at most four likely,
one found and `HUNT_WIDTH` being tried), and no token is left untried. In-flight frames are
resent when the socket they went out on is closed.

Failures: any error in the send path resolves the frames it concerns with a `TransportError`
(a socket that cannot be opened, e.g. libzmq's socket limit, fails every pending frame at once);
an unexpected error in the I/O thread fails what is pending and the client carries on, and a
client whose thread ended anyway fails every later submit at once. No future is left pending.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq
from pydantic import BaseModel, ConfigDict, Field
from zmq.utils.monitor import recv_monitor_message

from refit_protocol.tokens import TokenRing, as_ring, key_id, ring_accepts
from refit_sidecar.transport.errors import (
    AttemptObsoleteError,
    DeliveryTimeoutError,
    PayloadRejectedError,
    TransportError,
    TransportStoppedError,
)
from refit_sidecar.transport.relay.curve import secure_client
from refit_sidecar.transport.relay.frames import (
    ACK,
    DATA,
    END,
    PROBE,
    AckStatus,
    FrameMeta,
    parse_ack,
)

log = structlog.get_logger("kuberefit.transport.client")

Body = bytes | bytearray | memoryview | zmq.Frame
_Key = tuple[str, str, int, int, str]

#: Fallback keys tried at once per hop while the relay refuses every likely one.
HUNT_WIDTH = 4
#: Most sockets one hop holds, however many tokens the ring lists: the likely keys
#: (`TokenRing.likely`, at most 4), a fallback key found, and HUNT_WIDTH being tried.
MAX_LINKS = 4 + 1 + HUNT_WIDTH
#: How long a fallback key is given to complete or fail its handshake (a relay that does not
#: answer at all refuses nothing).
HUNT_PROBE_S = 2.0
#: After a round over every accepted token found no key, the next round starts this much later.
HUNT_ROUND_PAUSE_S = 2.0
#: After sockets could not be opened, the next try is this much later (pending frames fail).
REOPEN_BACKOFF_S = 1.0
#: Errors of the same kind are logged at most this often (each is counted in `errors`).
ERROR_LOG_S = 10.0
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_LINK_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED


class DealerConfig(BaseModel):
    """Window, timeouts and backoff of one DEALER hop (producer -> root, relay -> child)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    window: int = Field(default=4, ge=1, description="Frames sent and not yet answered.")
    ack_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Base wait for an answer before resending (plus the transfer time of the "
        "bytes in flight at `min_bandwidth_bytes_s`).",
    )
    min_bandwidth_bytes_s: float = Field(
        default=12.5e6, gt=0, description="Slowest link assumed when sizing ACK deadlines."
    )
    max_retries: int = Field(
        default=3, ge=0, description="Resends after a missing answer before the payload fails."
    )
    wait_backoff_min_s: float = Field(default=0.01, gt=0, description="First PROBE delay.")
    wait_backoff_max_s: float = Field(default=0.5, gt=0, description="Longest PROBE delay.")
    max_wait_s: float = Field(
        default=3600.0,
        gt=0,
        description="How long a payload may be held back by WAIT answers (backpressure).",
    )
    unknown_attempt_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="How long to retry while the relay does not know the attempt (prepare race).",
    )
    connect_timeout_s: float = Field(default=10.0, gt=0, description="TCP connect timeout.")


@dataclass(eq=False)
class _Item:
    kind: bytes
    meta: FrameMeta
    meta_json: bytes
    body: Body | None
    size: int
    future: Future[AckStatus]
    state: str = "queued"  # queued | awaiting | waiting | done
    probe: bool = False
    tries: int = 0
    deadline: float = 0.0
    next_at: float = 0.0
    backoff: float = 0.0
    wait_deadline: float | None = None
    wait_status: AckStatus | None = None
    sent_at: float = field(default=0.0)
    via: str | None = None  # the token of the link it was last sent on

    @property
    def key(self) -> _Key:
        kind = "END" if self.kind == END else "DATA"
        m = self.meta
        return (kind, m.attempt, m.producer, m.payload_id, m.digest)


@dataclass(eq=False)
class _Link:
    """One DEALER socket connected with one token's keys ("" : a plain connection)."""

    token: str
    sock: zmq.Socket[Any]
    monitor: zmq.Socket[Any]
    fallback: bool  # one of the other accepted tokens, being tried
    opened: float
    ready: bool = False  # its handshake completed and it has not disconnected since
    refused: bool = False  # its last handshake failed: the relay serves another key


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
    ) -> None:
        self.endpoint = endpoint
        self.name = name
        self.config = config or DealerConfig()
        self._ring = as_ring(token)
        self._links: dict[str, _Link] = {}  # by token, the likely ones first
        self._monitors: dict[zmq.Socket[Any], _Link] = {}
        self._accepted: tuple[str, ...] = ()
        self._base: tuple[str, ...] = ()  # tokens always connected: likely (+ the one found)
        self._found: str | None = None  # a fallback token whose handshake completed
        self._tried: set[str] = set()  # fallback tokens refused in this round
        self._round_over: float | None = None  # when a round found no key
        self._open_failed: float | None = None  # when sockets last could not be opened
        self._open_error: str | None = None
        self._gen = -1
        self._ctx = context or zmq.Context.instance()
        self._cmds: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._items: dict[_Key, _Item] = {}
        self._queued: collections.deque[_Item] = collections.deque()
        # When the socket first refused a queued frame (no connected peer, e.g. a handshake the
        # relay keeps refusing): without it such frames would never time out.
        self._blocked_since: float | None = None
        self._closed = False
        self._dead = False  # the I/O thread ended: every submit fails at once
        self._life = threading.Lock()  # orders submits against the thread's end
        self._logged: dict[str, float] = {}
        self.bad_replies = 0
        self.resends = 0
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
            meta = meta.model_copy(update={"token": self._ring.sending() or ""})
            item = _Item(kind, meta, meta.model_dump_json().encode(), body, size, fut)
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
                    self._fail_all(TransportError(f"{self.name}: I/O failed: {exc!r}"))
                    self._close_links(time.monotonic())
                    self._gen = -1
                    time.sleep(0.05)  # a failure that repeats must not spin
        except Exception as exc:  # pragma: no cover - the poller itself failed: never hang
            log.exception("relay_client.crashed", client=self.name)
            self._fail_all(TransportError(f"{self.name}: I/O thread failed: {exc!r}"))
        finally:
            with self._life:
                self._dead = True
            self._fail_all(TransportError(f"{self.name}: client closed"))
            self._drain_commands()
            self._close_links(time.monotonic())

    def _turn(self) -> None:
        now = time.monotonic()
        self._sync_links(now)
        self._expire(now)
        self._transmit(now)
        timeout_ms = self._poll_timeout_ms(time.monotonic())
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

    # -- the links: one socket per likely token, plus the fallback hunt -------------------------
    def _sync_links(self, now: float) -> None:
        """Follow the ring: connect with each likely token (one plain socket without a token),
        close links of tokens no longer wanted, retry sockets that could not be opened, and try
        the other accepted tokens while the relay refuses every likely one."""
        gen = self._ring.current_generation()
        if gen != self._gen:
            accepted = self._ring.accepted()
            likely = self._ring.likely()
            self._gen = gen
            self._accepted = accepted
            if self._found is not None and self._found not in accepted:
                self._found = None
            base = likely + ((self._found,) if self._found and self._found not in likely else ())
            self._base = base if accepted else ("",)
            self._tried &= set(accepted)
            closed = 0
            for token, link in list(self._links.items()):
                if token in self._base:
                    link.fallback = False
                elif not (link.fallback and token in accepted):
                    self._close_link(link, now)
                    closed += 1
            if closed:
                log.info("relay_client.keys_changed", client=self.name, keys=len(self._base))
        missing = [t for t in self._base if t not in self._links]
        if missing and (self._open_failed is None or now - self._open_failed >= REOPEN_BACKOFF_S):
            for token in missing:
                if not self._open_link(token, fallback=False, now=now):
                    break
            else:
                self._open_failed, self._open_error = None, None
        self._hunt(now)

    def _open_link(self, token: str, *, fallback: bool, now: float) -> bool:
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
            self._open_failed = now
            self._open_error = f"cannot open a socket to {self.endpoint}: {exc}"
            if not self._links:
                self._fail_all(TransportError(f"{self.name}: {self._open_error}"))
            return False
        link = _Link(token, sock, monitor, fallback, now)
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
        for item in self._items.values():
            if item.state == "awaiting" and item.via == link.token:
                item.deadline = now  # its answer can no longer arrive: resend now (a try)

    def _close_links(self, now: float) -> None:
        for link in list(self._links.values()):
            self._close_link(link, now)

    def _link_events(self, link: _Link, now: float) -> None:
        while self._links.get(link.token) is link:
            try:
                event = recv_monitor_message(link.monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = int(event.get("event", 0))
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.ready, link.refused = True, False
                if link.fallback:
                    self._key_found(link, now)
            elif kind & _HANDSHAKE_FAILED:
                link.ready, link.refused = False, True
                if link.fallback:  # not this one either: try the next
                    self._tried.add(link.token)
                    self._close_link(link, now)
            elif kind == zmq.EVENT_DISCONNECTED:
                link.ready = False

    def _keys_known(self) -> bool:
        """Whether some link completed its handshake, or a likely one has not been refused yet
        (it may still connect): then no other token is tried."""
        base = [self._links.get(t) for t in self._base]
        return any(link is not None and link.ready for link in self._links.values()) or any(
            link is None or not link.refused for link in base
        )

    def _hunt(self, now: float) -> None:
        """While frames wait and the relay refuses every likely key, try the other accepted
        tokens, HUNT_WIDTH at a time, each until refused (or HUNT_PROBE_S without an answer)."""
        fallbacks = [link for link in self._links.values() if link.fallback]
        if self._keys_known() or not self._pending_frames():
            for link in fallbacks:
                self._close_link(link, now)
            return
        for link in fallbacks:
            if not link.ready and now - link.opened >= HUNT_PROBE_S:
                self._tried.add(link.token)
                self._close_link(link, now)
        fallbacks = [link for link in self._links.values() if link.fallback]
        untried = (t for t in self._accepted if t not in self._links and t not in self._tried)
        while len(fallbacks) < HUNT_WIDTH:
            token = next(untried, None)
            if token is None:
                break
            if not self._open_link(token, fallback=True, now=now):
                return
            fallbacks.append(self._links[token])
        if fallbacks:
            self._round_over = None
        elif self._round_over is None:
            self._round_over = now
            tried_others = len(self._accepted) > len(self._base)  # else: a plain rotation
            if tried_others and now - self._logged.get("no_key", float("-inf")) >= ERROR_LOG_S:
                self._logged["no_key"] = now
                log.warning(
                    "relay_client.no_key",
                    client=self.name,
                    endpoint=self.endpoint,
                    tried=len(self._accepted),
                    detail="the relay refused a handshake with every accepted token",
                )
        elif now - self._round_over >= HUNT_ROUND_PAUSE_S:
            self._tried.clear()
            self._round_over = None

    def _key_found(self, link: _Link, now: float) -> None:
        """A fallback token completed its handshake: keep it while accepted, stop trying."""
        link.fallback = False
        self._found = link.token
        if link.token not in self._base:
            self._base = (*self._base, link.token)
        self._tried.clear()
        self._round_over = None
        for other in [x for x in self._links.values() if x.fallback]:
            self._close_link(other, now)
        log.info(
            "relay_client.key_found",
            client=self.name,
            endpoint=self.endpoint,
            key=key_id(link.token),
        )

    def _pending_frames(self) -> bool:
        return any(i.state != "done" for i in self._items.values())

    def _take_commands(self) -> bool:
        while True:
            try:
                what, arg = self._cmds.get_nowait()
            except queue.Empty:
                return True
            if what == "close":
                return False
            if what == "submit":
                item: _Item = arg
                old = self._items.get(item.key)
                if old is not None and old.state != "done":
                    # The same frame is already on its way: share its outcome.
                    old.future.add_done_callback(functools.partial(_chain, dst=item.future))
                    continue
                self._items[item.key] = item
                self._queued.append(item)
            elif what == "abort":
                attempt, reason = arg
                for it in [i for i in self._items.values() if i.meta.attempt == attempt]:
                    self._finish(it, exc=TransportStoppedError(f"{attempt}: {reason}"))

    def _awaiting(self) -> int:
        return sum(1 for i in self._items.values() if i.state == "awaiting")

    def _transmit(self, now: float) -> None:
        if not self._links and self._open_error is not None and self._items:
            # No socket at all (libzmq refused them): nothing can be sent, say so at once.
            self._fail_all(TransportError(f"{self.name}: {self._open_error}"))
        if not self._queued:
            self._blocked_since = None
        room = self.config.window - self._awaiting()
        if room <= 0:
            return
        # Payloads held back by WAIT are older than anything queued: they go first.
        for item in sorted(
            (i for i in self._items.values() if i.state == "waiting" and i.next_at <= now),
            key=lambda i: i.next_at,
        ):
            if room <= 0:
                return
            if self._send(item, probe=item.probe, now=now):
                room -= 1
        while room > 0 and self._queued:
            item = self._queued[0]
            if item.state == "done":
                self._queued.popleft()
                continue
            if not self._send(item, probe=False, now=now):
                if self._blocked_since is None:
                    self._blocked_since = now
                return
            self._blocked_since = None
            self._queued.popleft()
            room -= 1

    def _send(self, item: _Item, *, probe: bool, now: float) -> bool:
        token = self._ring.sending() or ""
        if item.meta.token != token:  # rotated since it was queued: send the token in force
            item.meta = item.meta.model_copy(update={"token": token})
            item.meta_json = item.meta.model_dump_json().encode()
        frames: list[Any] = [PROBE if probe else item.kind, item.meta_json]
        if not probe and item.body is not None:
            frames.append(item.body)
        # Only a link whose handshake completed takes it (ZMQ_IMMEDIATE): the ready ones first.
        links = sorted(self._links.values(), key=lambda link: not link.ready)
        for link in links:
            try:
                link.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                continue
        else:
            return False
        item.via = link.token
        item.state = "awaiting"
        item.probe = probe
        item.sent_at = now
        in_flight = sum(
            i.size for i in self._items.values() if i.state == "awaiting" and not i.probe
        )
        transfer = 0.0 if probe else in_flight / self.config.min_bandwidth_bytes_s
        item.deadline = now + self.config.ack_timeout_s + transfer
        return True

    def _blocked_budget_s(self) -> float:
        return self.config.ack_timeout_s * (self.config.max_retries + 1)

    def _expire(self, now: float) -> None:
        if (
            self._blocked_since is not None
            and now - self._blocked_since >= self._blocked_budget_s()
        ):
            self._blocked_since = None
            waited = self._blocked_budget_s()
            for item in [i for i in self._queued if i.state == "queued"]:
                self._finish(
                    item,
                    exc=DeliveryTimeoutError(
                        f"{self.name}: {self.endpoint} took no frame for {waited:.1f} s; "
                        f"{_ids(item)} was never sent (no connected peer: is the relay up, "
                        "and does it accept this client's token?)"
                    ),
                )
            self._queued.clear()
        for item in list(self._items.values()):
            if (
                item.state == "waiting"
                and item.wait_deadline is not None
                and now > item.wait_deadline
            ):
                self._finish(
                    item,
                    exc=DeliveryTimeoutError(
                        f"{self.name}: {self.endpoint} held {_ids(item)} back for too long"
                    ),
                )
            elif item.state == "awaiting" and now >= item.deadline:
                item.tries += 1
                if item.tries > self.config.max_retries:
                    self._finish(
                        item,
                        exc=DeliveryTimeoutError(
                            f"{self.name}: no answer from {self.endpoint} for {_ids(item)} "
                            f"after {item.tries} tries"
                        ),
                    )
                    continue
                self.resends += 1
                log.debug("relay_client.resend", client=self.name, ids=_ids(item), tries=item.tries)
                if not self._send(item, probe=item.probe, now=now):
                    item.deadline = now + self.config.ack_timeout_s

    def _poll_timeout_ms(self, now: float) -> int:
        nxt = now + 1.0
        for item in self._items.values():
            if item.state == "awaiting":
                nxt = min(nxt, item.deadline)
            elif item.state == "waiting":
                nxt = min(nxt, item.next_at)
        if self._queued and self._awaiting() < self.config.window:
            nxt = min(nxt, now + 0.01)  # HWM reached: try again soon
        if self._blocked_since is not None:
            nxt = min(nxt, self._blocked_since + self._blocked_budget_s())
        return max(0, int((nxt - now) * 1000) + 1)

    def _receive(self, sock: zmq.Socket[Any]) -> None:
        while True:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            ack = parse_ack(frames[1]) if len(frames) == 2 and frames[0] == ACK else None
            if ack is None or not ring_accepts(self._ring, ack.token):
                self.bad_replies += 1
                continue
            key = (ack.kind, ack.attempt, ack.producer, ack.payload_id, ack.digest)
            item = self._items.get(key)
            if item is None or item.state == "done":
                continue  # a late answer to a resend
            self._on_ack(item, ack.status, ack.error, ack.node)

    def _on_ack(self, item: _Item, status: AckStatus, error: str, node: str) -> None:
        now = time.monotonic()
        if status in (AckStatus.STAGED, AckStatus.DUPLICATE):
            self._finish(item, result=status)
        elif status is AckStatus.OBSOLETE:
            self._finish(item, exc=AttemptObsoleteError(f"{node or self.endpoint}: {error}"))
        elif status is AckStatus.REJECTED:
            self._finish(item, exc=PayloadRejectedError(f"{node or self.endpoint}: {error}"))
        elif item.state != "awaiting":
            return  # a late WAIT/READY for a frame we already re-sent
        elif status is AckStatus.READY:
            if not self._send(item, probe=False, now=now):
                item.state, item.next_at, item.probe = "waiting", now, False
        else:  # WAIT, UNKNOWN_ATTEMPT
            limit = (
                self.config.max_wait_s
                if status is AckStatus.WAIT
                else self.config.unknown_attempt_timeout_s
            )
            if item.wait_deadline is None or item.wait_status is not status:
                item.wait_deadline = now + limit  # each kind of waiting has its own budget
                item.wait_status = status
            item.state = "waiting"
            item.tries = 0
            item.probe = item.kind == DATA
            item.next_at = now + item.backoff
            item.backoff = min(item.backoff * 2, self.config.wait_backoff_max_s)

    def _finish(
        self, item: _Item, *, result: AckStatus | None = None, exc: BaseException | None = None
    ) -> None:
        item.state = "done"
        item.body = None
        self._items.pop(item.key, None)
        if item.future.done():
            return
        if exc is not None:
            item.future.set_exception(exc)
        else:
            assert result is not None
            item.future.set_result(result)

    def _fail_all(self, exc: BaseException) -> None:
        for item in list(self._items.values()):
            self._finish(item, exc=exc)
        self._queued.clear()


def _chain(src: Future[AckStatus], dst: Future[AckStatus]) -> None:
    if dst.done():
        return
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())


def _ids(item: _Item) -> str:
    m = item.meta
    kind = "END" if item.kind == END else "payload"
    return f"{kind} {m.attempt}/{m.producer}/{m.payload_id}"
