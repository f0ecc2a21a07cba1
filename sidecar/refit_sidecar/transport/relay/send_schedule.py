"""The send schedule of one DEALER hop: which frame goes out when, and what an answer means.

Why on its own: the rules of a hop (`RelayDealer`) are about time and answers, not about the
socket. A window bounds the frames sent and not yet answered; a frame held back by WAIT goes
before anything queued, as a body-less PROBE after an exponential backoff, and its body only
after READY; each kind of waiting (WAIT, UNKNOWN_ATTEMPT) has its own budget; an answer is
awaited for `ack_timeout_s` plus the transfer time of the bytes in flight, then the frame is
resent, up to `max_retries` times; frames the socket takes none of (no connected peer) fail
after the whole retry budget; a frame submitted while its twin is on its way shares its outcome.
Here the clock is a `now` argument and the socket a `put` callable, so each rule can be tested
step by step without ZeroMQ or threads.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import structlog
import zmq

from refit_sidecar.transport.errors import (
    AttemptObsoleteError,
    DeliveryTimeoutError,
    PayloadRejectedError,
    TransportStoppedError,
)
from refit_sidecar.transport.relay.config import DealerConfig
from refit_sidecar.transport.relay.frames import DATA, END, AckStatus, FrameMeta

log = structlog.get_logger("kuberefit.transport.client")

Body = bytes | bytearray | memoryview | zmq.Frame
#: What identifies a frame and its answer: kind (DATA or END), attempt, producer, id, digest.
FrameKey = tuple[str, str, int, int, str]


@dataclass(eq=False)
class Outgoing:
    """One DATA or END frame a hop has to deliver, and where it stands."""

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
    def key(self) -> FrameKey:
        kind = "END" if self.kind == END else "DATA"
        m = self.meta
        return (kind, m.attempt, m.producer, m.payload_id, m.digest)


#: Hands a frame to the socket (`probe`: as a body-less PROBE); the token of the link that took
#: it, or None when none did (no connected peer, or every queue full).
Put = Callable[[Outgoing, bool], str | None]


class SendSchedule:
    """The frames one hop has to deliver; not thread-safe (the hop's I/O thread alone uses it).

    `name` and `endpoint` only name the hop in errors and logs."""

    def __init__(self, config: DealerConfig, put: Put, *, name: str, endpoint: str) -> None:
        self.config = config
        self.name = name
        self.endpoint = endpoint
        self._put = put
        self._items: dict[FrameKey, Outgoing] = {}
        self._queued: collections.deque[Outgoing] = collections.deque()
        # When the socket first refused a queued frame (no connected peer, e.g. a handshake the
        # relay keeps refusing): without it such frames would never time out.
        self._blocked_since: float | None = None
        self.resends = 0

    @property
    def pending(self) -> bool:
        """Whether some frame is not resolved yet."""
        return any(i.state != "done" for i in self._items.values())

    def add(self, item: Outgoing) -> None:
        """Queue a frame; one whose twin (same key) is on its way shares the twin's outcome."""
        old = self._items.get(item.key)
        if old is not None and old.state != "done":
            old.future.add_done_callback(functools.partial(_chain, dst=item.future))
            return
        self._items[item.key] = item
        self._queued.append(item)

    def abort(self, attempt: str, reason: str) -> None:
        """Fail every frame of `attempt` with TransportStoppedError; none is sent any more."""
        for it in [i for i in self._items.values() if i.meta.attempt == attempt]:
            self._finish(it, exc=TransportStoppedError(f"{attempt}: {reason}"))

    def link_closed(self, token: str, now: float) -> None:
        """The link of `token` is gone: what awaits an answer sent on it is resent now (a try)."""
        for item in self._items.values():
            if item.state == "awaiting" and item.via == token:
                item.deadline = now

    def _awaiting(self) -> int:
        return sum(1 for i in self._items.values() if i.state == "awaiting")

    def transmit(self, now: float) -> None:
        """Send what the window has room for: frames held back by WAIT whose time came, then
        queued ones in order (a queued frame the socket refuses stops the queue)."""
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

    def _send(self, item: Outgoing, *, probe: bool, now: float) -> bool:
        via = self._put(item, probe)
        if via is None:
            return False
        item.via = via
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

    def expire(self, now: float) -> None:
        """Fail what ran out of time (never taken by the socket, held back too long, no answer
        after the last retry) and resend what got no answer in time."""
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

    def poll_timeout_ms(self, now: float) -> int:
        """How long the I/O thread may wait for an answer before the schedule has work."""
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

    def answer(self, key: FrameKey, status: AckStatus, error: str, node: str, now: float) -> None:
        """The relay answered the frame `key` names (a late answer to a done frame: ignored)."""
        item = self._items.get(key)
        if item is None or item.state == "done":
            return  # a late answer to a resend
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
        self, item: Outgoing, *, result: AckStatus | None = None, exc: BaseException | None = None
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

    def fail_all(self, exc: BaseException) -> None:
        """Resolve every frame with `exc` (the socket or the I/O thread failed, or closed)."""
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


def _ids(item: Outgoing) -> str:
    m = item.meta
    kind = "END" if item.kind == END else "payload"
    return f"{kind} {m.attempt}/{m.producer}/{m.payload_id}"
