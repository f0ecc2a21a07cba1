"""❻ as the receiver drives it: one thread per attempt drains the queue in declared order.

The attempt's single application order is (order, producer) ascending, the same on every node
whatever the arrival order (`AttemptState.next_key`). The loop takes up to `group_size` ready
payloads that are next in that order, calls the applier outside the lock, and stops when every
stream is complete and applied, or the attempt failed, stopped or was replaced.
"""

from __future__ import annotations

import time

from refit_sidecar.receiver.node_state import NodeState
from refit_sidecar.receiver.state import AttemptState, Entry, EntryState, Phase


def run_apply_loop(node: NodeState, st: AttemptState, group_size: int) -> None:
    """Body of the attempt's apply thread."""
    while True:
        taken = _next_batch(node, st, group_size)
        if taken is None:
            return
        batch, check_samples = taken
        t0 = time.perf_counter()
        try:
            staged = [e.staged for e in batch if e.staged is not None]
            report = node.applier.apply(staged, check_samples)
        except Exception as exc:
            with node.cond:
                st.applying = 0
                labels = ", ".join(e.ident.label() for e in batch)
                node.fail(st, f"apply of payloads {labels} failed: {type(exc).__name__}: {exc}")
            return
        elapsed = time.perf_counter() - t0
        node.metrics.apply_seconds.observe(elapsed)
        node.metrics.applied.inc(len(batch))
        with node.cond:
            st.applying = 0
            st.applied += len(batch)
            st.checks += report.checks
            st.timings["apply_s"] += elapsed
            for entry in batch:
                entry.state, entry.staged = EntryState.APPLIED, None
                st.release_local(entry)
            node.gauges(st)
            node.cond.notify_all()


def _next_batch(
    node: NodeState, st: AttemptState, group_size: int
) -> tuple[list[Entry], int] | None:
    """Wait for the next payload in declared order and take the group that follows it, with
    the post-apply check budget for it; None when the loop is done. Marks the node dirty:
    partial writes start now."""
    with node.cond:
        while True:
            if st.stopping or st.failed or node.current is not st:
                return None
            key = st.next_key(st.apply_cursor) if st.opened else None
            if st.opened and key is None:
                return None  # every stream complete and applied
            if key is not None and key in st.ready:
                break
            node.cond.wait(1.0)
        batch: list[Entry] = []
        while key is not None and key in st.ready and len(batch) < group_size:
            entry = st.ready.pop(key)
            entry.state = EntryState.APPLYING
            batch.append(entry)
            st.apply_cursor[key[1]] = key[0] + 1
            key = st.next_key(st.apply_cursor)
        st.applying = len(batch)
        st.wrote = True
        node.dirty = True
        st.phase = Phase.APPLYING
        node.gauges(st)
        return batch, st.check_samples
