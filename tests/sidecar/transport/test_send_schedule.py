"""A DEALER hop's send schedule driven step by step: a fake socket, the clock as an argument, no
ZeroMQ and no threads. Window, WAIT/PROBE backoff, READY, deadlines and retries, the budgets of
each kind of waiting, twins, aborts and closed links."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from refit_sidecar.transport.errors import (
    AttemptObsoleteError,
    DeliveryTimeoutError,
    PayloadRejectedError,
    TransportError,
    TransportStoppedError,
)
from refit_sidecar.transport.relay.config import DealerConfig
from refit_sidecar.transport.relay.frames import DATA, END, PROBE, AckStatus, FrameMeta
from refit_sidecar.transport.relay.send_schedule import Outgoing, SendSchedule

CONFIG = DealerConfig(
    window=2,
    ack_timeout_s=1.0,
    min_bandwidth_bytes_s=1000.0,
    max_retries=1,
    wait_backoff_min_s=0.125,  # binary fractions: exact sums of times
    wait_backoff_max_s=0.375,
    max_wait_s=5.0,
    unknown_attempt_timeout_s=2.0,
)


class Wire:
    """The socket: records what it is handed, takes nothing while down, says which link took
    a frame."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, int]] = []
        self.up = True
        self.link = "k1"

    def __call__(self, item: Outgoing, probe: bool) -> str | None:
        if not self.up:
            return None
        self.sent.append((PROBE if probe else item.kind, item.meta.payload_id))
        return self.link


def _schedule(config: DealerConfig = CONFIG) -> tuple[SendSchedule, Wire]:
    wire = Wire()
    return SendSchedule(config, wire, name="hop", endpoint="tcp://relay:1"), wire


def _frame(pid: int, *, size: int = 0, kind: bytes = DATA, attempt: str = "a1") -> Outgoing:
    meta = FrameMeta(attempt=attempt, producer=0, payload_id=pid)
    future: Future[AckStatus] = Future()
    body = bytes(size) if kind == DATA else None
    item = Outgoing(kind, meta, meta.model_dump_json().encode(), body, size, future)
    item.backoff = CONFIG.wait_backoff_min_s  # as `RelayDealer` queues it
    return item


def _sent(s: SendSchedule, *frames: Outgoing, now: float = 0.0) -> None:
    """Queue `frames` and let the window send what it has room for."""
    for f in frames:
        s.add(f)
    s.transmit(now)


def _times_out(s: SendSchedule, f: Outgoing, *, pending_at: float, failed_at: float) -> str:
    """`f` is still pending after `expire(pending_at)` and timed out by `expire(failed_at)`;
    the error's message."""
    s.expire(pending_at)
    assert not f.future.done()
    s.expire(failed_at)
    exc = f.future.exception(0)
    assert isinstance(exc, DeliveryTimeoutError)
    return str(exc)


def _answer(s: SendSchedule, f: Outgoing, status: AckStatus, now: float, node: str = "") -> None:
    s.answer(f.key, status, "why" if status is AckStatus.REJECTED else "", node, now)


def test_the_window_bounds_the_frames_in_flight_and_an_answer_frees_room() -> None:
    s, wire = _schedule()
    frames = [_frame(i) for i in range(3)]
    _sent(s, *frames)
    assert wire.sent == [(DATA, 0), (DATA, 1)]  # in order, two at a time
    s.transmit(0.0)
    assert len(wire.sent) == 2
    _answer(s, frames[0], AckStatus.STAGED, 0.1)
    assert frames[0].future.result(0) is AckStatus.STAGED
    s.transmit(0.1)
    assert wire.sent[-1] == (DATA, 2)
    _answer(s, frames[1], AckStatus.DUPLICATE, 0.2)
    assert frames[1].future.result(0) is AckStatus.DUPLICATE
    _answer(s, frames[0], AckStatus.REJECTED, 0.2)  # a late answer to a done frame: ignored
    assert frames[0].future.result(0) is AckStatus.STAGED
    assert s.pending
    _answer(s, frames[2], AckStatus.STAGED, 0.3)
    assert not s.pending


def test_wait_holds_a_payload_back_and_probes_with_backoff_until_ready() -> None:
    s, wire = _schedule()
    f = _frame(7, size=100)
    _sent(s, f)
    _answer(s, f, AckStatus.WAIT, 0.0)  # the relay's queue is full: body dropped
    s.transmit(0.12)
    assert wire.sent == [(DATA, 7)]  # not before the backoff
    assert s.poll_timeout_ms(0.0) == 126  # wake up for the probe
    s.transmit(0.125)
    assert wire.sent[-1] == (PROBE, 7)  # no body
    _answer(s, f, AckStatus.WAIT, 0.125)
    s.transmit(0.37)
    assert len(wire.sent) == 2  # the backoff doubled: 0.25
    s.transmit(0.375)
    assert wire.sent[-1] == (PROBE, 7)
    _answer(s, f, AckStatus.WAIT, 0.375)
    s.transmit(0.74)
    assert len(wire.sent) == 3  # capped at wait_backoff_max_s: 0.375
    s.transmit(0.75)
    assert wire.sent[-1] == (PROBE, 7)
    assert len(wire.sent) == 4
    _answer(s, f, AckStatus.READY, 0.75)
    assert wire.sent[-1] == (DATA, 7)  # the body goes at once
    _answer(s, f, AckStatus.STAGED, 0.8)
    assert f.future.result(0) is AckStatus.STAGED


def test_frames_held_back_go_before_queued_ones() -> None:
    s, wire = _schedule(CONFIG.model_copy(update={"window": 1}))
    first, second = _frame(1), _frame(2)
    _sent(s, first, second)
    _answer(s, first, AckStatus.WAIT, 0.0)  # the window has room again, the queue waits
    s.transmit(0.05)
    assert wire.sent == [(DATA, 1), (DATA, 2)]  # nothing held back was due yet
    _answer(s, second, AckStatus.WAIT, 0.05)
    s.add(third := _frame(3))
    s.transmit(0.2)  # both held back are due: the older one first, then the window is full
    assert wire.sent[2:] == [(PROBE, 1)]
    _answer(s, first, AckStatus.STAGED, 0.2)
    s.transmit(0.2)
    assert wire.sent[3:] == [(PROBE, 2)]
    assert not third.future.done()


def test_an_unanswered_frame_is_resent_after_its_deadline_then_fails() -> None:
    s, wire = _schedule()
    f = _frame(1, size=500)
    _sent(s, f)
    # ack_timeout_s plus the transfer time of the bytes in flight: 1 + 500 / 1000.
    assert s.poll_timeout_ms(0.0) == 1001  # at most a second without a look
    s.expire(1.49)
    assert (len(wire.sent), s.resends) == (1, 0)
    s.expire(1.5)
    assert (len(wire.sent), s.resends) == (2, 1)
    assert "after 2 tries" in _times_out(s, f, pending_at=2.99, failed_at=3.0)
    assert not s.pending


def test_a_probe_deadline_has_no_transfer_time_and_a_refused_resend_waits_a_timeout() -> None:
    s, wire = _schedule()
    f, g = _frame(1, size=800), _frame(2, size=1000)
    _sent(s, f, g)  # g's answer: 1 s + 1.8 s for the 1800 bytes in flight
    _answer(s, f, AckStatus.WAIT, 0.0)
    s.transmit(0.125)  # the probe carries no body: awaited for ack_timeout_s alone
    assert wire.sent[-1] == (PROBE, 1)
    wire.up = False
    s.expire(1.12)
    assert s.resends == 0
    s.expire(1.125)  # resent, but the socket took nothing: try again a timeout later
    assert (s.resends, len(wire.sent)) == (1, 3)
    wire.up = True
    s.expire(2.12)
    assert s.resends == 1
    s.expire(2.125)
    with pytest.raises(DeliveryTimeoutError):
        f.future.result(0)
    assert not g.future.done()


def test_a_socket_that_takes_nothing_fails_the_queued_frames_after_the_retry_budget() -> None:
    s, wire = _schedule()
    wire.up = False
    f = _frame(1)
    _sent(s, f)
    assert s.poll_timeout_ms(0.0) == 11  # try again soon
    # ack_timeout_s x (max_retries + 1) = 2 s
    assert "was never sent" in _times_out(s, f, pending_at=1.99, failed_at=2.0)
    g = _frame(2)
    _sent(s, g, now=3.0)
    wire.up = True
    s.transmit(4.5)  # taken before the budget ran out: that clock stops
    assert wire.sent == [(DATA, 2)]
    assert s.poll_timeout_ms(4.5) == 1001  # the answer's deadline, not the budget's end


def test_the_budget_of_a_blocked_queue_starts_again_once_the_queue_emptied() -> None:
    s, wire = _schedule()
    wire.up = False
    stopped = _frame(1, attempt="a0")
    _sent(s, stopped)  # blocked from 0
    s.abort("a0", "attempt stopped")
    s.transmit(0.5)  # drops the stopped frame
    s.transmit(0.75)  # nothing queued: that clock stops
    late = _frame(2)
    _sent(s, late, now=1.5)  # blocked again, from 1.5
    # Pending 2 s after the first block (0.5 s after this one), failed 2 s after this one.
    _times_out(s, late, pending_at=2.0, failed_at=3.5)


def test_each_kind_of_waiting_has_its_own_budget() -> None:
    s, _ = _schedule()
    f = _frame(1)
    _sent(s, f)
    _answer(s, f, AckStatus.UNKNOWN_ATTEMPT, 0.0)  # the prepare has not reached the relay
    s.transmit(0.125)
    _answer(s, f, AckStatus.WAIT, 0.125)  # then it is known and full: the WAIT budget
    # Past the unknown-attempt budget (2 s) still held back; failed after the WAIT budget.
    error = _times_out(s, f, pending_at=2.5, failed_at=5.13)
    assert "held payload a1/0/1 back for too long" in error
    g = _frame(2)
    _sent(s, g, now=10.0)
    _answer(s, g, AckStatus.UNKNOWN_ATTEMPT, 10.0)
    _times_out(s, g, pending_at=12.0, failed_at=12.01)


def test_an_end_held_back_is_resent_whole_not_probed() -> None:
    s, wire = _schedule()
    end = _frame(0, kind=END)
    _sent(s, end)
    _answer(s, end, AckStatus.UNKNOWN_ATTEMPT, 0.0)
    s.transmit(0.125)
    assert wire.sent == [(END, 0), (END, 0)]


def test_a_twin_shares_the_outcome_and_abort_stops_one_attempt() -> None:
    s, wire = _schedule()
    first, twin, other = _frame(1), _frame(1), _frame(1, attempt="a2")
    _sent(s, first, twin, other)
    assert wire.sent == [(DATA, 1), (DATA, 1)]  # the twin is not sent again
    s.abort("a1", "attempt stopped")
    with pytest.raises(TransportStoppedError, match="a1: attempt stopped"):
        twin.future.result(0)
    assert isinstance(first.future.exception(0), TransportStoppedError)
    assert not other.future.done()
    _answer(s, other, AckStatus.STAGED, 0.1)
    assert other.future.result(0) is AckStatus.STAGED


def test_refusals_resolve_with_typed_errors_naming_the_node() -> None:
    s, _ = _schedule()
    rejected, obsolete = _frame(1), _frame(2)
    _sent(s, rejected, obsolete)
    _answer(s, rejected, AckStatus.REJECTED, 0.1, node="node-3")
    _answer(s, obsolete, AckStatus.OBSOLETE, 0.1)
    with pytest.raises(PayloadRejectedError, match="node-3: why"):
        rejected.future.result(0)
    with pytest.raises(AttemptObsoleteError, match="tcp://relay:1"):
        obsolete.future.result(0)


def test_frames_sent_on_a_closed_link_are_resent_at_once() -> None:
    s, wire = _schedule()
    lost, kept = _frame(1), _frame(2)
    _sent(s, lost)
    wire.link = "k2"
    _sent(s, kept)
    s.link_closed("k1", 0.2)
    s.expire(0.2)
    assert wire.sent[2:] == [(DATA, 1)]
    assert (lost.tries, kept.tries, s.resends) == (1, 0, 1)


def test_fail_all_resolves_every_frame() -> None:
    s, _ = _schedule()
    frames = [_frame(i) for i in range(3)]
    _sent(s, *frames)
    s.fail_all(TransportError("hop: client closed"))
    assert not s.pending
    for f in frames:
        with pytest.raises(TransportError, match="client closed"):
            f.future.result(0)
    s.transmit(0.1)
    assert s.poll_timeout_ms(0.1) == 1001  # nothing left to do
