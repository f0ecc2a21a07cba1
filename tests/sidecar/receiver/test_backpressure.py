"""A slow applier must slow the producer down, not grow the receiver: while one producer streams
six times the queue capacity, the receiver process's RSS stays within what the queue admits.

The applier stalls at its first payload until the test has seen the receiver refuse a payload
with WAIT (queue full): backpressure then happens on every run, however the machine's load
shares the CPU between the producer, the receiver's staging and its applier."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil
import torch
from pydantic import SecretStr

from refit_protocol.receiver_api import PrepareRequest
from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.transport.relay.config import RootDealerConfig
from refit_sidecar.transport.relay.transport import RelayTransport, RelayTransportConfig
from tests.harness.operator_env import wait_for
from tests.harness.receivers import NodeProc, metric_sum, start_cluster
from tests.sidecar.receiver.models import canonical, metas, overwrite_payload, read_applied

MIB = 1 << 20
WAITS = 'kuberefit_receiver_payloads_total{result="wait"}'  # payloads refused: queue full
NUMEL = 4 * MIB  # one float32 tensor of 16 MiB; every payload overwrites all of it
PAYLOADS = 24
GROUPS, GROUP_SIZE = 1, 2  # queue capacity (1 + 1) * 2 = 4 payloads
WINDOW = 2


def test_slow_applier_keeps_receiver_rss_bounded(tmp_path: Path) -> None:
    capacity = (GROUPS + 1) * GROUP_SIZE
    assert 6 * capacity <= PAYLOADS
    release = tmp_path / "release-the-applier"

    def slow(i: int, log: Path) -> dict[str, object]:
        return {
            "kind": "factory",
            "factory": "tests.sidecar.receiver.models:slow_applier",
            "options": {
                "log_path": str(log),
                "delay_s": 0.08,
                "tensors": 1,
                "numel": NUMEL,
                "hold_path": str(release),
            },
        }

    # A fixed mmap threshold makes glibc return freed payload buffers to the OS at once, so RSS
    # tracks live memory (the dynamic threshold would keep 16 MiB blocks in per-thread arenas).
    malloc = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_ARENA_MAX": "2"}
    cluster = start_cluster(
        tmp_path,
        1,
        applier=slow,
        queue_groups=GROUPS,
        group_size=GROUP_SIZE,
        staging_workers=1,
        env=malloc,
    )
    node = cluster.nodes[0]
    try:
        node.ctl.prewarm(metas(canonical(0, tensors=1, numel=NUMEL)))
        meta = TensorMeta("t0.weight", (NUMEL,), torch.float32)
        g = torch.Generator().manual_seed(5)
        values = [
            torch.randint(-(2**31), 2**31 - 1, (NUMEL,), generator=g, dtype=torch.int32)
            for _ in range(PAYLOADS)
        ]
        ps = [overwrite_payload("bp", 0, i, i, meta, v) for i, v in enumerate(values)]
        assert min(p.size for p in ps) > 15 * MIB  # incompressible: compressed ~ decoded
        node.ctl.prepare(
            PrepareRequest(
                attempt="bp", from_version=0, target_version=1, mode="overwrite", producers=[0]
            )
        )
        node.ctl.gate("bp", True)
        node.ctl.open_apply("bp")
        proc = psutil.Process(node.proc.pid)
        time.sleep(0.5)
        baseline = proc.memory_info().rss
        peak = [baseline]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.01):
                peak[0] = max(peak[0], proc.memory_info().rss)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        refused: list[BaseException | float] = []

        def release_once_refused() -> None:
            try:
                refused.append(wait_for("a payload refused with WAIT", lambda: _waits(node)))
            except BaseException as exc:
                refused.append(exc)
            finally:
                release.touch()

        releaser = threading.Thread(target=release_once_refused, daemon=True)
        releaser.start()
        t = RelayTransport(
            RelayTransportConfig(
                root=node.relay,
                token=SecretStr(cluster.token),
                max_in_flight=WINDOW,
                client=RootDealerConfig(ack_timeout_s=10, max_retries=2, max_wait_s=60),
            )
        )
        t0 = time.monotonic()
        try:
            for p in ps:
                t.send("bp", p)
            summary = t.stop_and_wait("bp")
        finally:
            t.close()
        stream_s = time.monotonic() - t0
        ack = node.ctl.flush("bp", {0: PAYLOADS}, timeout_s=60)
        done.set()
        sampler.join()
        releaser.join()
        if isinstance(refused[0], BaseException):
            raise refused[0]
        assert summary.payloads_acknowledged == PAYLOADS, summary
        assert ack.ok, ack.errors
        rows = read_applied(node.applied_log)
        assert [r["order"] for r in rows] == list(range(PAYLOADS))
        # The producer was held back: streaming took about as long as applying.
        assert stream_s > 0.08 * (PAYLOADS - capacity - WINDOW - 1)
        assert _waits(node) >= refused[0] > 0  # backpressure made the series count
        growth = (peak[0] - baseline) / MIB
        # Live memory the design allows, in payloads of 16 MiB: the queue plus the reserved next
        # slot, the producer's window on the wire, one decode (compressed + raw + unshuffled
        # copies), and the overwrite apply's temporaries (~3 payloads: masks, int64 indices,
        # gathered values) + 32 MiB for allocator slack.
        held = capacity + 1
        bound = (held + WINDOW + 2 + 3) * 16 + 32
        unbounded = PAYLOADS * 16
        print(f"rss growth {growth:.0f} MiB, bound {bound} MiB, unbounded >= {unbounded} MiB")
        assert growth < bound < unbounded
    finally:
        cluster.stop_all()


def _waits(node: NodeProc) -> float:
    return metric_sum(node, WAITS + " ")
