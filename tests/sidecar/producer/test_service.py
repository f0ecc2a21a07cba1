"""The producer service end to end on the real pipeline, baseline and S3 transport (payloads
reach a real receiver node and are read back from the bucket): a mixed attempt, a retry rebuilt
from the pending delta without a new export, and the baseline update. A link that goes down is
the one fault injected (`LinkDownTransportFake`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from refit_protocol.commit import CommitRecord
from refit_protocol.errors import EndpointError
from refit_protocol.producer_api import AttemptPlan, SentReport, StreamSettings
from refit_sidecar.baseline.chunks import ExportChunk, chunk_export
from refit_sidecar.baseline.config import BaselineConfig
from refit_sidecar.baseline.source import SourceBaseline
from refit_sidecar.bits import int_view
from refit_sidecar.codec import EncodedPayload, Op, decode_payload
from refit_sidecar.producer.service import ProducerService
from refit_sidecar.transport.base import Transport, TransportSummary
from tests.harness.s3_payloads import S3Delivery
from tests.sidecar.producer.states import bump, replay, same, state


class LinkDownTransportFake:
    """Fault injection: every send fails, as over a link that went down."""

    def send(self, attempt: str, payload: EncodedPayload) -> None:
        raise ConnectionError("link down")

    def stop_and_wait(self, attempt: str) -> TransportSummary:
        return TransportSummary(attempt, 0, 0, 0)

    def cleanup(self, attempt: str) -> None:
        pass


@dataclass
class Links:
    """The service's transport factory: the real S3 delivery, except for the attempts whose
    link is `down` (a fault injected per attempt)."""

    delivery: S3Delivery
    baseline: SourceBaseline
    down: set[str] = field(default_factory=set)

    def __call__(self, plan: AttemptPlan) -> Transport:
        if plan.attempt in self.down:
            return LinkDownTransportFake()
        return self.delivery.factory(self.baseline)(plan)


def plan(attempt: str, mode: str) -> AttemptPlan:
    return AttemptPlan(
        attempt=attempt,
        from_version=0,
        target_version=1,
        baseline_id="g1",
        mode=mode,  # type: ignore[arg-type]
        receivers=("r0",),
    )


@pytest.fixture
def service(tmp_path: Path, delivery: S3Delivery) -> Iterator[tuple[ProducerService, Links]]:
    baseline = SourceBaseline(
        producer=0, producers=1, config=BaselineConfig(directory=tmp_path, export_chunk_bytes=20000)
    )
    baseline.load_initial(chunk_export(state(0).items(), 20000))
    links = Links(delivery, baseline)
    yield ProducerService(baseline, links), links
    baseline.close()


async def test_mixed_attempt_then_baseline_update(service) -> None:  # type: ignore[no-untyped-def]
    svc, links = service
    v0, v1 = state(0), bump(state(0), 1)
    exports = []

    def export() -> list[ExportChunk]:
        exports.append(1)
        return list(chunk_export(v1.items(), 20000))

    svc.stage_candidate(1, export)
    await svc.start(plan("a1", "mixed"))
    sent = await svc.wait_sent("a1")
    payloads = links.delivery.payloads("a1")
    assert sent.payloads == len(payloads) > 0
    assert sent.wire_bytes == sum(p.size for p in payloads)
    assert 0 < sent.changed_elements < sent.total_elements == 8 * 64 * 64
    assert same(replay(v0, payloads), v1)
    await svc.update_baseline("a1", CommitRecord(1, "g1"))
    await svc.update_baseline("a1", CommitRecord(1, "g1"))  # idempotent
    assert all(
        torch.equal(
            torch.from_numpy(svc.baseline.stored_bits(n).copy()).reshape(-1), int_view(v1[n])
        )
        for n in v1
    )
    assert exports == [1]
    with pytest.raises(ValueError, match="not the next"):
        svc.stage_candidate(1, export)


async def test_each_attempt_streams_with_the_settings_its_plan_carries(service) -> None:  # type: ignore[no-untyped-def]
    """The policy's stream settings travel with every plan: a sidecar configured with others
    (injected before its policy existed, or before a change) streams with the plan's, and its
    status says which are in effect."""
    svc, links = service
    assert svc.settings == StreamSettings(zstd_level=1, shuffle=True, bucket_bytes="auto")
    v0, v1 = state(0), bump(state(0), 3)
    chunks = list(chunk_export(v1.items(), 20000))
    assert len(chunks) == 4  # `auto` buckets: one payload per changed chunk
    svc.stage_candidate(1, lambda: chunks)
    chosen = StreamSettings(zstd_level=9, shuffle=False, bucket_bytes=10**9)
    await svc.start(plan("a1", "mixed").model_copy(update={"settings": chosen}))
    sent = await svc.wait_sent("a1")
    payloads = links.delivery.payloads("a1")
    assert sent.payloads == len(payloads) == 1  # one bucket holds every chunk
    assert same(replay(v0, payloads), v1)
    assert svc.settings == chosen


async def test_retry_is_overwrite_from_pending_delta(service) -> None:  # type: ignore[no-untyped-def]
    svc, links = service
    v0, v1 = state(0), bump(state(0), 2)
    exports = []

    def export() -> list[ExportChunk]:
        exports.append(1)
        return list(chunk_export(v1.items(), 20000))

    svc.stage_candidate(1, export)
    await svc.start(plan("a1", "mixed"))
    await svc.wait_sent("a1")
    await svc.stop_and_wait("a1")
    await svc.cleanup("a1")
    assert links.delivery.payloads("a1") == []  # the transport's cleanup emptied the prefix
    await svc.start(plan("a2", "overwrite"))
    await svc.wait_sent("a2")
    payloads = links.delivery.payloads("a2")
    items = [i for p in payloads for i in decode_payload(p.body).items]
    assert items
    assert all(i.op is Op.OVERWRITE for i in items)
    assert exports == [1]  # no second export for the retry
    # Overwrites repair a receiver that holds any mixture of v0 and v1 bits.
    assert same(replay(v0, payloads), v1)
    await svc.update_baseline("a2", CommitRecord(1, "g2"))


async def test_transport_failure_surfaces(service) -> None:  # type: ignore[no-untyped-def]
    svc, links = service
    svc.stage_candidate(1, lambda: list(chunk_export(bump(state(0), 3).items(), 20000)))
    links.down.add("a1")
    await svc.start(plan("a1", "mixed"))
    with pytest.raises(EndpointError, match="link down"):
        await svc.wait_sent("a1")
    with pytest.raises(EndpointError, match="no candidate"):
        await svc.start(
            AttemptPlan(
                attempt="a9", from_version=1, target_version=2, baseline_id="g", mode="mixed"
            )
        )


async def test_a_retry_whose_send_fails_reports_the_send_failure_and_can_retry_again(
    service,  # type: ignore[no-untyped-def]
) -> None:
    """The link fails during an overwrite retry rebuilt from a complete pending delta: the
    attempt fails with the link's error (not a compare error of a needless re-export), and the
    next retry still sends every overwrite from the same delta."""
    svc, links = service
    v0, v1 = state(0), bump(state(0), 4)
    exports = []

    def export() -> list[ExportChunk]:
        exports.append(1)
        return list(chunk_export(v1.items(), 20000))

    svc.stage_candidate(1, export)
    await svc.start(plan("a1", "mixed"))
    await svc.wait_sent("a1")
    links.down.add("a2")
    await svc.start(plan("a2", "overwrite"))
    with pytest.raises(EndpointError, match="link down"):
        await svc.wait_sent("a2")
    await svc.start(plan("a3", "overwrite"))
    await svc.wait_sent("a3")
    assert exports == [1]  # both retries rebuilt from the pending delta
    assert same(replay(v0, links.delivery.payloads("a3")), v1)
    await svc.update_baseline("a3", CommitRecord(1, "g3"))


class RecordingObserver:
    """A `ProducerObserver` that records what it is told, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, object]] = []

    def started(self, plan: AttemptPlan) -> None:
        self.calls.append(("started", plan.attempt, plan.target_version))

    def sent(self, attempt: str, report: SentReport) -> None:
        self.calls.append(("sent", attempt, report.payloads))

    def baseline_updated(self, attempt: str, record: CommitRecord) -> None:
        self.calls.append(("baseline_updated", attempt, record))


async def test_observer_sees_the_calls_that_bound_a_transition(
    tmp_path: Path, delivery: S3Delivery
) -> None:
    """The hook the refit bench times the paper's window with: start, sent, baseline update,
    each once (a repeated baseline update is not reported again)."""
    observer = RecordingObserver()
    baseline = SourceBaseline(
        producer=0, producers=1, config=BaselineConfig(directory=tmp_path, export_chunk_bytes=20000)
    )
    baseline.load_initial(chunk_export(state(0).items(), 20000))
    try:
        svc = ProducerService(baseline, delivery.factory(baseline), observer=observer)
        svc.stage_candidate(1, lambda: list(chunk_export(bump(state(0), 4).items(), 20000)))
        await svc.start(plan("a1", "mixed"))
        report = await svc.wait_sent("a1")
        await svc.update_baseline("a1", CommitRecord(1, "g1"))
        await svc.update_baseline("a1", CommitRecord(1, "g1"))
    finally:
        baseline.close()
    assert report.payloads == len(delivery.payloads("a1")) > 0
    assert observer.calls == [
        ("started", "a1", 1),
        ("sent", "a1", report.payloads),
        ("baseline_updated", "a1", CommitRecord(1, "g1")),
    ]
