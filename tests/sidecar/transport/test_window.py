"""The send window: payloads by count, bytes past the first two, and what frees room."""

from __future__ import annotations

import threading

import pytest

from refit_sidecar.transport.errors import TransportError, TransportStoppedError
from refit_sidecar.transport.window import SendWindow


def _admits_now(window: SendWindow, size: int, attempt: str = "a") -> bool:
    """Whether `admit` returns within a short wait (it blocks while the window is full); a
    blocked admit is released by stopping the attempt afterwards."""
    done = threading.Event()

    def admit() -> None:
        try:
            window.admit(attempt, 0, size)
            done.set()
        except TransportStoppedError:
            pass

    t = threading.Thread(target=admit, daemon=True)
    t.start()
    admitted = done.wait(0.3)
    if not admitted:
        window.stop(attempt)
        t.join(2)
        assert not t.is_alive()
    return admitted


def test_small_payloads_fill_the_count_and_large_ones_the_bytes() -> None:
    w = SendWindow(max_in_flight=4, window_bytes=100)
    for _ in range(4):
        assert _admits_now(w, 10)
    assert w.state("a").in_flight_bytes == 40
    assert not _admits_now(w, 10)  # the count is full, though bytes are left

    w = SendWindow(max_in_flight=16, window_bytes=100)
    assert _admits_now(w, 80)
    assert _admits_now(w, 80)  # two are always admitted, however large
    w.settle("a", None, 80)
    assert _admits_now(w, 20)  # 80 + 20 fit
    assert not _admits_now(w, 1)  # 101 would not


def test_an_acknowledgment_frees_its_bytes_and_a_failure_fails_the_next_send() -> None:
    w = SendWindow(max_in_flight=16, window_bytes=100)
    for size in (60, 30, 10):
        w.admit("a", 0, size)
    w.settle("a", None, 60)
    st = w.state("a")
    assert (st.in_flight, st.in_flight_bytes, st.acked) == (2, 40, 1)
    w.settle("a", TransportError("lost"), 30)
    with pytest.raises(TransportError, match="lost"):
        w.admit("a", 0, 1)
    assert w.summary("a", st).errors == ("lost",)


def test_without_a_byte_bound_only_the_count_holds() -> None:
    w = SendWindow(max_in_flight=2)
    assert _admits_now(w, 1 << 40)
    assert _admits_now(w, 1 << 40)
    assert not _admits_now(w, 1)
