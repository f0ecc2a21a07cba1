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
    DecodedPayload,
    EncodedPayload,
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
from refit_sidecar.receiver.config import ReceiverConfig
from refit_sidecar.receiver.node import ReceiverNode
from refit_sidecar.receiver.state import PayloadIdent
from refit_sidecar.receiver.validate import decode_and_stage
from refit_sidecar.transport import TransportSummary
from tests.sidecar.codec.craft import HEADER, KEY, OTHER_KEY

TOKEN = "policy-token"
META = TensorMeta("w", (64,), torch.float32)


class _Sink:
    """An in-memory transport: keeps what is sent."""

    def __init__(self) -> None:
        self.sent: list[EncodedPayload] = []

    def send(self, attempt: str, payload: EncodedPayload) -> None:
        self.sent.append(payload)

    def stop_and_wait(self, attempt: str) -> TransportSummary:
        return TransportSummary(attempt, len(self.sent), sum(p.size for p in self.sent), 0)

    def cleanup(self, attempt: str) -> None:
        self.sent.clear()


class _Applier:
    """Stages what it is given; nothing else is called here."""

    def stage(self, decoded: DecodedPayload) -> StagedPayload:
        return StagedPayload(decoded.header, 0, decoded.items)

    def close(self) -> None:
        pass


def test_a_keyed_pipeline_seals_every_payload() -> None:
    v0 = [(f"t{i}", torch.randn(16, 16)) for i in range(6)]
    v1 = [(n, t + 1) for n, t in v0]
    baseline = SourceBaseline(
        producer=0, producers=1, config=BaselineConfig(export_chunk_bytes=2048, in_memory=True)
    )
    baseline.load_initial(chunk_export(v0, 2048))
    sink = _Sink()
    ProducerPipeline(baseline, sink, mac_key=KEY).run("a1", chunk_export(v1, 2048))
    assert sink.sent
    for p in sink.sent:
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
    keyed = ReceiverNode(ReceiverConfig(node="n", token=SecretStr(TOKEN)), _Applier())  # type: ignore[arg-type]
    plain = ReceiverNode(ReceiverConfig(node="n"), _Applier())  # type: ignore[arg-type]
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
        applier=_Applier(),  # type: ignore[arg-type]
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
