"""Issue 15, part A plumbing: who seals with the policy key and who insists on it.

A producer process with a token seals every payload with `payload_mac_key(token)`; a receiver
node with a token verifies with the same key and refuses unauthenticated payloads; without a
token (loopback tests, benches) both forms are accepted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import SecretStr

from refit_protocol.keys import payload_mac_key
from refit_sidecar.baseline import BaselineConfig, SourceBaseline, chunk_export
from refit_sidecar.codec import (
    AuthenticationError,
    Item,
    Op,
    TensorMeta,
    decode_payload,
    encode_payload,
    verify_mac,
)
from refit_sidecar.pipeline import ProducerPipeline
from refit_sidecar.producer.main import ProducerProcessConfig, build
from refit_sidecar.receiver.appliers.base import StagedPayload
from refit_sidecar.receiver.appliers.inprocess import InProcessApplier
from refit_sidecar.receiver.config import ReceiverConfig
from refit_sidecar.receiver.node import ReceiverNode
from refit_sidecar.receiver.validate import decode_and_stage
from refit_sidecar.transport.inbound import PayloadIdent
from tests.harness.s3_payloads import S3Delivery
from tests.sidecar.codec.craft import HEADER, KEY, OTHER_KEY
from tests.sidecar.receiver.models import TinyModel

TOKEN = "policy-token"
META = TensorMeta("w", (64,), torch.float32)


def _applier() -> InProcessApplier:
    """The real in-process applier over a one-tensor model holding `META`."""
    return InProcessApplier(TinyModel({META.name: torch.zeros(META.shape, dtype=META.dtype)}))


def test_a_keyed_pipeline_seals_every_payload(delivery: S3Delivery) -> None:
    v0 = [(f"t{i}", torch.randn(16, 16)) for i in range(6)]
    v1 = [(n, t + 1) for n, t in v0]
    baseline = SourceBaseline(
        producer=0, producers=1, config=BaselineConfig(export_chunk_bytes=2048, in_memory=True)
    )
    baseline.load_initial(chunk_export(v0, 2048))
    transport = delivery.transport("a1", baseline)  # the real S3 transport
    ProducerPipeline(baseline, transport, mac_key=KEY).run("a1", chunk_export(v1, 2048))
    summary = transport.stop_and_wait("a1")
    assert summary.errors == ()
    sent = delivery.payloads("a1")  # read back from the bucket
    assert sent
    assert len(sent) == summary.payloads_sent
    for p in sent:
        verify_mac(p.body, KEY)
        assert decode_payload(p.body, mac_key=KEY, known=baseline.metadata).items
        with pytest.raises(AuthenticationError):
            verify_mac(p.body, OTHER_KEY)


def test_a_producer_process_with_a_token_seals_with_its_key(tmp_path: Path) -> None:
    for token, key in ((TOKEN, payload_mac_key(TOKEN)), (None, None)):
        cfg = ProducerProcessConfig(
            token=SecretStr(token) if token else None,
            staging=None,
            baseline=BaselineConfig(directory=tmp_path),
        )
        process = build(cfg)
        try:
            mac = process.service.mac_key  # the sending token's key, taken per attempt
            assert (mac() if callable(mac) else mac) == key
        finally:
            process.close()


def test_a_receiver_node_with_a_token_requires_its_key() -> None:
    keyed = ReceiverNode(ReceiverConfig(node="n", token=SecretStr(TOKEN)), _applier())
    plain = ReceiverNode(ReceiverConfig(node="n"), _applier())
    try:
        assert keyed.core.intake.mac_keys() == [payload_mac_key(TOKEN)]
        assert plain.core.intake.mac_keys() == []
    finally:
        keyed.core.close()
        plain.core.close()


def _stage(body: bytes, digest: bytes, key: bytes | None) -> StagedPayload:
    ident = PayloadIdent(
        HEADER.attempt, HEADER.producer, HEADER.payload_id, HEADER.order, digest, len(body)
    )
    return decode_and_stage(
        body,
        ident,
        metas={"w": META},
        xor_incompatible=frozenset(),
        unsupported={},
        applier=_applier(),
        mac_key=key,
    )


def test_receiver_validation_refuses_unauthenticated_payloads_only_when_keyed() -> None:
    items = [Item(META, Op.XOR, 3, None, torch.ones(5, dtype=torch.int32))]
    plain = encode_payload(HEADER, items)
    sealed = encode_payload(HEADER, items, mac_key=KEY)
    assert _stage(sealed.body, sealed.digest, KEY).items
    for body, digest in ((plain.body, plain.digest), (sealed.body, sealed.digest)):
        assert _stage(body, digest, None).items  # a node without a token takes both
    with pytest.raises(AuthenticationError):
        _stage(plain.body, plain.digest, KEY)
    with pytest.raises(AuthenticationError):
        _stage(sealed.body, sealed.digest, OTHER_KEY)
