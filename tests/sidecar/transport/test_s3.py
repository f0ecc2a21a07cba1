"""Object-storage delivery against a real SeaweedFS (signature-checking S3) with receiver nodes as
processes: multipart upload, manifests to every node, download + digest check, declared-order
apply, stream-end sweep of leftovers, and cleanup that leaves the bucket empty."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from refit_protocol.receiver_api import ManifestEntry, PrepareRequest
from refit_sidecar.transport.s3 import (
    MIB,
    S3Config,
    S3Transport,
    S3TransportConfig,
    attempt_prefix,
    object_key,
)
from tests.harness.operator_env import wait_for
from tests.harness.receivers import Cluster, start_cluster
from tests.harness.s3 import S3Server, node_settings, store_config
from tests.sidecar.receiver.models import (
    canonical,
    fingerprint,
    metas,
    payloads,
    perturb,
    read_applied,
)

NUMEL = 3 * MIB  # two float32 tensors of 12 MiB: one payload goes multipart (5 MiB parts)


# A bucket and two receiver nodes per test (a few seconds): no test depends on what another
# left in the bucket or on the version the nodes reached.
def s3_config(s3: S3Server, bucket: str) -> S3Config:
    return store_config(
        s3,
        bucket,
        prefix="payloads",
        multipart_threshold=5 * MIB,
        part_size=5 * MIB,
        max_attempts=1,
    )


@pytest.fixture
def cluster(s3: S3Server, bucket: str, tmp_path: Path) -> Iterator[Cluster]:
    def applier(i: int, log: Path) -> dict[str, Any]:
        return {
            "kind": "factory",
            "factory": "tests.sidecar.receiver.models:recording_applier",
            "options": {"log_path": str(log), "tensors": 2, "numel": NUMEL},
        }

    cfg = node_settings(s3_config(s3, bucket))
    c = start_cluster(tmp_path, 2, applier=applier, relay=False, s3=cfg)
    try:
        c.each(lambda n: n.ctl.prewarm(metas(canonical(0, tensors=2, numel=NUMEL))))
        yield c
    finally:
        c.stop_all()


def keys(s3: S3Server, bucket: str, prefix: str) -> list[str]:
    resp = s3.client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in resp.get("Contents", []))


def test_payloads_reach_every_node_and_cleanup_empties_the_bucket(
    s3: S3Server, bucket: str, cluster: Cluster
) -> None:
    old = canonical(0, tensors=2, numel=NUMEL)
    new = dict(old)
    new["t0.weight"] = perturb({"t": old["t0.weight"]}, 1, fraction=0.5)["t"]
    new["t1.weight"] = perturb({"t": old["t1.weight"]}, 2, fraction=0.01)["t"]
    ps = payloads("s1", 0, old, new)
    assert ps[0].size > 5 * MIB > ps[1].size
    req = PrepareRequest(
        attempt="s1", from_version=0, target_version=1, mode="mixed", producers=[0]
    )
    assert all(a.accepted for a in cluster.each(lambda n: n.ctl.prepare(req)))
    cluster.each(lambda n: n.ctl.gate("s1", True))
    cluster.each(lambda n: n.ctl.open_apply("s1"))
    cfg = s3_config(s3, bucket)
    t = S3Transport(
        S3TransportConfig(
            s3=cfg, receivers=[n.http for n in cluster.nodes], token=SecretStr(cluster.token)
        )
    )
    try:
        for p in reversed(ps):  # arrival order differs from declared order
            t.send("s1", p)
        summary = t.stop_and_wait("s1")
        assert summary.errors == ()
        assert summary.payloads_acknowledged == 2
        stored = keys(s3, bucket, attempt_prefix(cfg, "s1"))
        assert stored == sorted(
            object_key(cfg, "s1", 0, p.header.payload_id, p.digest.hex()) for p in ps
        )
        big = s3.client().head_object(Bucket=bucket, Key=stored[0])
        assert big["ETag"].strip('"').endswith("-2")  # a two-part multipart object
        acks = cluster.each(lambda n: n.ctl.flush("s1", {0: 2}, timeout_s=30))
        assert all(a.ok and a.applied == 2 for a in acks), [a.errors for a in acks]
        for node in cluster.nodes:
            rows = read_applied(node.applied_log)
            assert [r["order"] for r in rows] == [0, 1]
            assert rows[-1]["fingerprint"] == fingerprint(new)
        cluster.each(lambda n: n.ctl.commit("s1", 1))
        t.cleanup("s1")
        assert keys(s3, bucket, cfg.prefix) == []
    finally:
        t.close()


def test_corrupted_object_is_rejected_and_leftovers_are_swept(
    s3: S3Server, bucket: str, cluster: Cluster
) -> None:
    old = canonical(0, tensors=2, numel=NUMEL)
    p = payloads("s2", 0, old, perturb(old, 3, fraction=0.001))[0]
    req = PrepareRequest(
        attempt="s2", from_version=0, target_version=1, mode="overwrite", producers=[0]
    )
    assert all(a.accepted for a in cluster.each(lambda n: n.ctl.prepare(req)))
    cfg = s3_config(s3, bucket)
    client = s3.client()
    key = object_key(cfg, "s2", 0, 0, p.digest.hex())
    bad = bytearray(p.body)
    bad[-3] ^= 0x40
    client.put_object(Bucket=bucket, Key=key, Body=bytes(bad))
    # A crashed producer's incomplete multipart upload below its prefix:
    client.create_multipart_upload(Bucket=bucket, Key=f"{attempt_prefix(cfg, 's2')}p0/dangling.krp")
    entry = ManifestEntry(
        attempt="s2",
        producer=0,
        payload_id=0,
        order=0,
        bucket=bucket,
        key=key,
        digest=p.digest.hex(),
        size=p.size,
    )
    node = cluster.nodes[0]
    code, body = node.ctl.raw("POST", "/v1/manifest", entry.model_dump_json().encode())
    assert code == 202
    assert body["status"] == "staged"
    wait_for("node 0 failed the attempt", lambda: node.ctl.status().phase == "failed", timeout=10)
    status = node.ctl.status()
    assert status.phase == "failed"
    assert "AuthenticationError" in status.errors[0]  # the keyed MAC, checked before the digest
    wrong_bucket = entry.model_copy(update={"bucket": "elsewhere", "payload_id": 1, "order": 1})
    code, body = cluster.nodes[1].ctl.raw(
        "POST", "/v1/manifest", wrong_bucket.model_dump_json().encode()
    )
    assert code == 422  # a foreign bucket is refused before any download, failing the attempt
    assert "not the configured payload bucket 'k" in body["error"]
    wait_for(
        "node 1 failed the attempt",
        lambda: cluster.nodes[1].ctl.status().phase == "failed",
        timeout=10,
    )
    assert "not the configured payload bucket" in cluster.nodes[1].ctl.status().errors[0]

    t = S3Transport(
        S3TransportConfig(
            s3=cfg,
            receivers=[n.http for n in cluster.nodes],
            token=SecretStr(cluster.token),
            producer=0,
        )
    )
    try:
        t.stop_and_wait("s2")  # stream end: incomplete uploads of this producer are aborted
        uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=attempt_prefix(cfg, "s2"))
        assert not uploads.get("Uploads")
        cluster.each(lambda n: n.ctl.stop("s2"))
        t.cleanup("s2")
        assert keys(s3, bucket, cfg.prefix) == []
    finally:
        t.close()
