"""Real trainer sidecars for tests: producer services on real sockets, each with a shared-memory
inbox, sending over the real S3 transport to a real receiver node (`tests.harness.s3_payloads`),
and a stand-in coordinator that drives a transition once every producer staged it."""

from __future__ import annotations

import asyncio
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from aiohttp import web

from refit_protocol.commit import CommitRecord
from refit_protocol.producer_api import AttemptPlan, SentReport
from refit_sidecar.baseline.chunks import ExportChunk, owner_of, plan_chunks
from refit_sidecar.baseline.config import BaselineConfig
from refit_sidecar.baseline.source import SourceBaseline
from refit_sidecar.bits import int_view
from refit_sidecar.codec import EncodedPayload
from refit_sidecar.producer.http import create_producer_app
from refit_sidecar.producer.service import ProducerService
from refit_sidecar.producer.staging import StagingConfig
from refit_sidecar.trainer.export import Change, PlannedChunk, StageIntent, plan_owned
from refit_sidecar.trainer.publisher import PublisherConfig
from refit_sidecar.trainer.state_dict import StateDictSource
from tests.harness.s3 import S3Server
from tests.harness.s3_payloads import S3Delivery
from tests.harness.web import serve_app

TOKEN = "trainer-test-token"


@dataclass
class Sidecar:
    url: str
    service: ProducerService
    delivery: S3Delivery
    inbox: Path

    def publisher_config(self, **overrides: object) -> PublisherConfig:
        fields: dict[str, object] = {
            "url": self.url,
            "inbox": self.inbox,
            "token": TOKEN,
            "request_timeout_s": 60,
            "commit_timeout_s": 120,
        }
        fields.update(overrides)
        return PublisherConfig.model_validate(fields)

    def payloads(self, attempt: str) -> list[EncodedPayload]:
        """What this producer delivered for `attempt`, read back from the bucket."""
        return self.delivery.payloads(attempt, self.service.producer)


def shm_root() -> Path:
    """A private directory on the shared-memory volume (/dev/shm), as a pod would mount it."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        raise RuntimeError("/dev/shm is missing: the trainer handoff needs a shared-memory volume")
    return shm / f"kuberefit-test-{uuid.uuid4().hex[:12]}"


@asynccontextmanager
async def serve_sidecars(
    tmp: Path,
    producers: int,
    s3: S3Server,
    *,
    chunk_bytes: int,
    committed: CommitRecord | None = None,
    reference: Path | None = None,
) -> AsyncIterator[list[Sidecar]]:
    """`producers` producer services with uninitialized baselines, served over HTTP, sending
    to `s3` (which holds the payload bucket: the `payload_s3` fixture)."""
    root = shm_root()
    runners: list[web.AppRunner] = []
    sidecars: list[Sidecar] = []
    delivery = S3Delivery(s3)
    try:
        for p in range(producers):
            baseline = SourceBaseline(
                producer=p,
                producers=producers,
                config=BaselineConfig(
                    directory=tmp / f"baseline{p}", export_chunk_bytes=chunk_bytes
                ),
            )
            staging = StagingConfig(
                inbox=root / f"p{p}",
                candidate_dir=tmp / f"candidate{p}",
                reference_checkpoint=reference,
            )
            service = ProducerService(
                baseline,
                delivery.factory(baseline),
                committed=committed or CommitRecord(0, "g0"),
                staging=staging,
            )
            runner, url = await serve_app(create_producer_app(service, token=TOKEN))
            runners.append(runner)
            sidecars.append(Sidecar(url, service, delivery, root / f"p{p}"))
        yield sidecars
    finally:
        for runner in runners:
            await runner.cleanup()
        for s in sidecars:
            s.service.baseline.close()
            s.service.close_staging()
        delivery.close()
        shutil.rmtree(root, ignore_errors=True)


async def run_transition(
    sidecars: list[Sidecar],
    version: int,
    *,
    xor_incompatible: frozenset[str] = frozenset(),
    timeout: float = 120,
) -> tuple[str, list[SentReport]]:
    """What the coordinator does once every producer staged `version`: one mixed attempt,
    then the commit and the baseline update."""
    deadline = asyncio.get_running_loop().time() + timeout
    while any(s.service.candidate_version != version for s in sidecars):
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"v{version} was not staged by every producer in {timeout}s")
        await asyncio.sleep(0.02)
    attempt = f"a-v{version}"
    plan = AttemptPlan(
        attempt=attempt,
        from_version=version - 1,
        target_version=version,
        baseline_id=f"g{version}",
        mode="mixed",
        xor_incompatible=xor_incompatible,
        receivers=("r0",),
    )
    for s in sidecars:
        await s.service.start(plan)
    reports = [await s.service.wait_sent(attempt) for s in sidecars]
    for s in sidecars:
        await s.service.update_baseline(attempt, CommitRecord(version, f"g{version}"))
    return attempt, reports


class ChangesOf:
    """The simplest real `PlanningSource`: `old` whole for the first export, then every tensor of
    `new` except the 1-D ones as its changes against `old` (the 1-D ones whole, so chunks mix
    both kinds), cut into the baseline's chunks as the sidecar's layout says."""

    def __init__(self, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
        self.old, self.new = old, new

    def plan(self, intent: StageIntent | None) -> Iterator[PlannedChunk]:
        assert intent is not None, "every rank of these tests publishes"
        if intent.purpose == "initial":
            source = StateDictSource(self.old)
            yield from plan_owned(
                source.entries(), intent.limit_bytes, intent.producer, intent.producers
            )
            return
        assert intent.layout is not None
        for i, metas in enumerate(plan_chunks(intent.layout, intent.limit_bytes)):
            if owner_of(i, intent.producers) != intent.producer:
                yield PlannedChunk(i, metas, None)
                continue
            whole = tuple((m.name, self.new[m.name]) for m in metas if len(m.shape) == 1)
            changes = []
            for m in metas:
                if len(m.shape) == 1:
                    continue
                new = self.new[m.name].reshape(-1)
                where = torch.nonzero(int_view(self.old[m.name]) != int_view(new)).reshape(-1)
                changes.append(Change(m.name, where, new[where]))
            yield PlannedChunk(i, metas, ExportChunk(i, whole), tuple(changes))
