"""The barriers that end an attempt's delivery on a node (paper Appendix B.1).

`relay_flush`: the arrival barrier, every expected payload staged here and every inbound's
work drained (the relay tree's forwards to the children). `flush`: the completion ACK of
Figure 4, every expected payload applied in declared order and the device synchronized.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import structlog

from refit_protocol.receiver_api import (
    FlushRequest,
    FlushResponse,
    RelayFlushRequest,
    RelayFlushResponse,
)
from refit_sidecar.receiver.metrics import STAGES
from refit_sidecar.receiver.node_state import NodeState
from refit_sidecar.receiver.state import AttemptState, Phase
from refit_sidecar.transport.inbound import Inbound

log = structlog.get_logger("kuberefit.receiver")


def relay_flush(
    s: NodeState, inbounds: Sequence[Inbound], req: RelayFlushRequest, default_timeout_s: float
) -> RelayFlushResponse:
    """Arrival barrier: every expected payload staged, every inbound's work drained (the
    relay's forwards to the children)."""
    timeout = req.timeout_s or default_timeout_s
    deadline = time.monotonic() + timeout
    with s.cond:
        st = s.require(req.attempt)
        errors = st.set_totals(req.expected)
        while not errors and not st.failed and not st.stopping:
            if not st.count_errors() or time.monotonic() >= deadline:
                break
            s.cond.wait(min(0.2, max(deadline - time.monotonic(), 0.0)))
    for inbound in inbounds:
        errors += inbound.drain(req.attempt, max(deadline - time.monotonic(), 0.0))
    with s.cond:
        errors += st.count_errors()
        if st.failed or st.stopping:
            errors = list(st.errors) + errors or [f"attempt {st.phase.value}"]
        ok = not errors
        if not ok:
            s.fail(st, "relay flush: " + "; ".join(errors[:4]))
        return RelayFlushResponse(
            node=s.node, attempt=req.attempt, ok=ok, staged=st.staged_total, errors=errors
        )


def flush(s: NodeState, req: FlushRequest, default_timeout_s: float) -> FlushResponse:
    """Close the attempt: every expected payload applied in order, device synced."""
    timeout = req.timeout_s or default_timeout_s
    t0 = time.monotonic()
    deadline = t0 + timeout
    with s.cond:
        st = s.require(req.attempt)
        if st.flushed_ok:
            return _response(s, st, True, [], {})
        if not st.opened:
            return _response(s, st, False, ["flush before open_apply"], {})
        if req.check_samples and not st.check_samples:
            st.check_samples = req.check_samples  # payloads applied from now on
        errors = st.set_totals(req.expected)
        if errors:
            s.fail(st, "flush: " + "; ".join(errors))
        while not (st.failed or st.stopping or s.current is not st or st.all_applied()):
            if time.monotonic() >= deadline:
                break
            s.cond.wait(min(0.5, max(deadline - time.monotonic(), 0.0)))
        if not (st.all_applied() and s.is_live(st)):
            if not st.failed and not st.stopping:
                s.fail(
                    st,
                    f"flush timed out after {timeout:.1f}s: applied {st.applied} of "
                    f"{sum(st.totals.values())}; next missing {st.missing()}",
                )
            return _response(s, st, False, list(st.errors), {})
        errors = st.count_errors()
    t1 = time.monotonic()
    if not errors:
        try:
            s.applier.sync()
        except Exception as exc:
            errors = [f"device sync failed: {exc!r}"]
    with s.cond:
        if errors:
            s.fail(st, "flush: " + "; ".join(errors))
            return _response(s, st, False, errors, {})
        st.phase = Phase.FLUSHED
        st.flushed_ok = True
        s.metrics.attempts.labels("flushed").inc()
        timings = {"wait_s": t1 - t0, "sync_s": time.monotonic() - t1, **st.timings}
        for stage in STAGES:
            s.metrics.stage_seconds.labels(stage).observe(timings.get(f"{stage}_s", 0.0))
        log.info(
            "receiver.flushed",
            node=s.node,
            attempt=st.attempt,
            applied=st.applied,
            checks=st.checks,
        )
        return _response(s, st, True, [], timings)


def _response(
    s: NodeState, st: AttemptState, ok: bool, errors: list[str], timings: dict[str, float]
) -> FlushResponse:
    return FlushResponse(
        node=s.node,
        attempt=st.attempt,
        ok=ok,
        applied=st.applied,
        staged=st.staged_total,
        checks=st.checks,
        errors=errors,
        timings=dict(timings),
    )
