"""The relay's forward ledger without sockets: counting, a failed child skipped for the rest of
its attempt, forgotten attempts, and the flush barrier."""

from __future__ import annotations

import threading
import time

from refit_sidecar.transport.relay.forwards import ForwardLedger


def test_drain_reports_the_forwards_still_pending_and_returns_once_none_is() -> None:
    ledger = ForwardLedger()
    assert ledger.drain("a1", 0) == []  # nothing ever forwarded
    assert ledger.start("a1", "left")
    assert ledger.start("a1", "right")
    assert ledger.drain("a1", 0) == ["2 forwards still pending after 0.0s"]
    assert ledger.finish("a1", "left", None) == (None, False)
    assert ledger.drain("a1", 0) == ["1 forwards still pending after 0.0s"]
    assert ledger.drain("a2", 0) == []  # attempts are counted apart
    assert ledger.finish("a1", "right", None) == (None, False)
    assert ledger.drain("a1", 0) == []


def test_drain_waits_for_a_forward_that_finishes_on_another_thread() -> None:
    ledger = ForwardLedger()
    assert ledger.start("a1", "child")
    finisher = threading.Timer(0.05, ledger.finish, args=("a1", "child", None))
    started = time.monotonic()
    finisher.start()
    try:
        assert ledger.drain("a1", 10) == []
    finally:
        finisher.join()
    assert time.monotonic() - started < 5  # woken by the finish, not by the timeout


def test_a_failed_child_is_skipped_for_the_rest_of_its_attempt_and_reported_once() -> None:
    ledger = ForwardLedger()
    assert ledger.start("a1", "dead")
    assert ledger.start("a1", "dead")  # a second payload already on its way
    assert ledger.start("a1", "alive")
    assert ledger.finish("a1", "dead", "forward to dead: timeout") == (
        "forward to dead: timeout",
        True,  # the first failure: stop the child's other forwards
    )
    assert not ledger.start("a1", "dead")  # skipped, not counted
    assert ledger.start("a2", "dead")  # another attempt tries it again
    assert ledger.finish("a1", "dead", "forward to dead: stopped") == (
        "forward to dead: stopped",
        False,
    )
    assert ledger.finish("a1", "alive", None) == (None, False)
    assert ledger.drain("a1", 0) == ["forward to dead: timeout"]
    assert ledger.drain("a2", 0) == ["1 forwards still pending after 0.0s"]


def test_a_forgotten_attempt_leaves_no_trace() -> None:
    ledger = ForwardLedger()
    assert ledger.start("a1", "child")
    assert ledger.start("a1", "other")
    assert ledger.finish("a1", "other", "forward to other: refused")[1]
    ledger.forget("a1")  # replaced by a later prepare
    assert ledger.drain("a1", 0) == []
    assert ledger.finish("a1", "child", "forward to child: stopped") == (None, False)
    assert ledger.drain("a1", 0) == []
    assert ledger.start("a1", "other")  # its failed children are forgotten too
