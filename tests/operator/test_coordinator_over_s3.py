"""The coordinator driving a real producer service over the S3 transport (issue 33): receiver
processes with S3 downloads and no relay tree, a bucket on the session's SeaweedFS, the
SQLite commit store. The producer's transport is configured without receivers: each attempt
plan names them (`receiver_urls`, filled in by the coordinator from its membership), as the
trainer sidecar of an injected pod is. Bits are checked against the test's own dense load of
each target; every object an attempt uploaded is gone once it committed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from pydantic import SecretStr

from refit_operator.commit_store.sqlite import SqliteCommitStore
from refit_operator.coordinator import Coordinator
from refit_operator.http_membership import HttpMembership, NodeEndpoint
from refit_operator.transition_types import CoordinatorConfig
from refit_protocol.commit import CommitRecord
from refit_protocol.keys import payload_mac_key
from refit_sidecar.baseline.chunks import chunk_export
from refit_sidecar.baseline.config import BaselineConfig
from refit_sidecar.baseline.source import SourceBaseline
from refit_sidecar.pipeline.config import PipelineConfig
from refit_sidecar.producer.service import ProducerService
from refit_sidecar.transport.s3 import S3Config, S3TransportConfig
from refit_sidecar.transport.selector import TransportSelector
from tests.harness.receivers import Cluster, start_cluster
from tests.harness.s3 import S3Server, node_settings, store_config
from tests.operator.fakes import RecordingSink
from tests.sidecar.receiver.models import canonical, fingerprint, metas, perturb, read_applied

SEED, TENSORS, NUMEL = 0, 6, 4096
PREFIX = "refits"


def _s3(s3: S3Server, bucket: str) -> S3Config:
    return store_config(s3, bucket, prefix=PREFIX, max_attempts=1)


@pytest.fixture
def cluster(s3: S3Server, bucket: str, tmp_path: Path) -> Iterator[Cluster]:
    def applier(i: int, log: Path) -> dict[str, Any]:
        return {
            "kind": "factory",
            "factory": "tests.sidecar.receiver.models:recording_applier",
            "options": {"log_path": str(log), "seed": SEED, "tensors": TENSORS, "numel": NUMEL},
        }

    cfg = node_settings(_s3(s3, bucket))
    (tmp_path / "nodes").mkdir()
    c = start_cluster(tmp_path / "nodes", 2, applier=applier, relay=False, s3=cfg)
    try:
        c.each(lambda n: n.ctl.prewarm(metas(canonical(SEED, TENSORS, NUMEL))))
        yield c
    finally:
        c.stop_all()


def _producer(
    tmp_path: Path, token: str, config: S3Config, v0: dict[str, torch.Tensor]
) -> tuple[ProducerService, TransportSelector]:
    baseline = SourceBaseline(
        producer=0,
        producers=1,
        config=BaselineConfig(directory=tmp_path / "baseline", export_chunk_bytes=8 * NUMEL),
    )
    baseline.load_initial(chunk_export(v0.items(), 8 * NUMEL))
    # No receivers here: every plan names them.
    template = S3TransportConfig(s3=config, token=SecretStr(token), producer=0)
    selector = TransportSelector(template)
    service = ProducerService(
        baseline,
        selector,
        PipelineConfig(bucket_bytes=3 * 4 * NUMEL),  # several payloads per attempt
        committed=CommitRecord(0, "g-initial"),
        mac_key=payload_mac_key(token),
    )
    return service, selector


async def test_transitions_over_s3_follow_the_plans_receivers(
    s3: S3Server, bucket: str, cluster: Cluster, tmp_path: Path
) -> None:
    states = [canonical(SEED, TENSORS, NUMEL)]
    for v in range(1, 3):
        states.append(perturb(states[-1], 200 + v))
    producer, selector = _producer(tmp_path, cluster.token, _s3(s3, bucket), states[0])
    store = SqliteCommitStore(tmp_path / "store.sqlite", "s3")
    await store.initialize(CommitRecord(0, "g-initial"))
    try:
        async with aiohttp.ClientSession() as session:
            membership = HttpMembership(
                [NodeEndpoint(n.name, n.http) for n in cluster.nodes],  # no relay endpoints
                session,
                token=cluster.token,
                checkpoint_of=lambda v: str(tmp_path / f"never-read-v{v}"),
            )
            coordinator = Coordinator(
                "s3",
                store,
                [producer],
                membership,
                RecordingSink(),
                CoordinatorConfig(control_timeout_s=30.0, flush_timeout_s=60.0),
            )
            await coordinator.start()
            for v in range(1, 3):
                state = states[v]
                producer.stage_candidate(v, lambda s=state: chunk_export(s.items(), 8 * NUMEL))
                result = await coordinator.run_transition()
                assert (result.outcome, result.version, result.modes) == ("committed", v, ["mixed"])
                dense = fingerprint(state)  # the test's own dense load of the target
                for node in cluster.nodes:
                    rows = [r for r in read_applied(node.applied_log) if f"-v{v}-" in r["attempt"]]
                    assert len(rows) >= 2, f"{node.name} at v{v}: {len(rows)} payloads"
                    assert rows[-1]["fingerprint"] == dense, f"{node.name} at v{v}"
                    status = node.ctl.status()
                    assert (status.held_version, status.gate_closed) == (v, False), status
                # The coordinator's cleanup removed every object the attempt uploaded.
                listed = s3.client().list_objects_v2(Bucket=bucket, Prefix=f"{PREFIX}/")
                assert listed.get("KeyCount", 0) == 0, listed.get("Contents")
        # One transport, to the receivers the plans named (their control-plane URLs).
        assert list(selector._made) == [" ".join(n.http for n in cluster.nodes)]
        assert producer.committed == (await store.read()).record
        assert producer.committed.version == 2
    finally:
        selector.close()
        producer.baseline.close()
