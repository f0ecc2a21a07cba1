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
carry an accepted one. While two tokens are accepted the client holds one socket per token, each
sending only once its handshake completed (ZMQ_IMMEDIATE), so frames go to whichever key the
relay serves with; in-flight frames are resent when the set of sockets changes.
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

from refit_protocol.tokens import TokenRing, as_ring, ring_accepts
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

    @property
    def key(self) -> _Key:
        kind = "END" if self.kind == END else "DATA"
        m = self.meta
        return (kind, m.attempt, m.producer, m.payload_id, m.digest)


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
        self._socks: list[zmq.Socket[Any]] = []
        self._sock_tokens: tuple[str, ...] | None = None
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
        self.bad_replies = 0
        self.resends = 0
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
        if self._closed:
            fut.set_exception(TransportError(f"{self.name}: client closed"))
            return fut
        meta = meta.model_copy(update={"token": self._ring.sending() or ""})
        item = _Item(kind, meta, meta.model_dump_json().encode(), body, size, fut)
        item.backoff = self.config.wait_backoff_min_s
        self._command("submit", item)
        return fut

    def _command(self, what: str, arg: Any) -> None:
        self._cmds.put((what, arg))
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def _run(self) -> None:
        self._poller = zmq.Poller()
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._sync_sockets(time.monotonic())
        self._ready.set()
        try:
            while True:
                if not self._take_commands():
                    break
                now = time.monotonic()
                self._sync_sockets(now)
                self._expire(now)
                self._transmit(now)
                timeout_ms = self._poll_timeout_ms(time.monotonic())
                for s, _ in self._poller.poll(timeout_ms):
                    if isinstance(s, zmq.Socket):
                        self._receive(s)
                    else:
                        with contextlib.suppress(BlockingIOError, OSError):
                            os.read(self._wake_r, 4096)
        except Exception as exc:  # pragma: no cover - a bug: fail loudly, never hang callers
            log.exception("relay_client.crashed", client=self.name)
            self._fail_all(TransportError(f"{self.name}: I/O thread failed: {exc!r}"))
        finally:
            self._fail_all(TransportError(f"{self.name}: client closed"))
            self._close_sockets()

    def _sync_sockets(self, now: float) -> None:
        """One socket per accepted token (one plain socket without a token); rebuilt when the
        ring's accepted tokens change, and frames awaiting an answer are then resent."""
        gen = self._ring.current_generation()
        if gen == self._gen:
            return
        self._gen = gen
        tokens = self._ring.accepted()
        if tokens == self._sock_tokens:
            return
        rebuilt = self._sock_tokens is not None
        self._close_sockets()
        self._sock_tokens = tokens
        for token in tokens or (None,):
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            sock.setsockopt(zmq.CONNECT_TIMEOUT, int(self.config.connect_timeout_s * 1000))
            sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
            if len(tokens) > 1:
                sock.setsockopt(zmq.IMMEDIATE, 1)  # only the socket whose handshake completed
            if token:
                secure_client(sock, token)
            sock.connect(self.endpoint)
            self._poller.register(sock, zmq.POLLIN)
            self._socks.append(sock)
        if rebuilt:
            log.info("relay_client.keys_changed", client=self.name, sockets=len(self._socks))
            for item in self._items.values():
                if item.state == "awaiting":  # its socket is gone: resend now (a counted try)
                    item.deadline = now

    def _close_sockets(self) -> None:
        for sock in self._socks:
            with contextlib.suppress(KeyError):
                self._poller.unregister(sock)
            sock.close(linger=0)
        self._socks = []

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
        for sock in self._socks:  # more than one only during a token rotation
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                continue
        else:
            return False
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
