"""The transport registry: one plug-in per kind the protocol spells, each with both sides, and
the small pure parts of each inbound (the relay's prepare refusal, the S3 manifest identity)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from refit_protocol.kit.tokens import TokenRing
from refit_protocol.receiver_api import ManifestEntry, PrepareRequest
from refit_protocol.transports import TRANSPORT_KINDS
from refit_sidecar import transport
from refit_sidecar.receiver.config import ReceiverConfig
from refit_sidecar.transport.inbound import Inbound, PayloadIdent
from refit_sidecar.transport.plugin import InboundContext, TransportPlugin
from refit_sidecar.transport.relay.config import RelayConfig
from refit_sidecar.transport.relay.inbound import RelayInbound
from refit_sidecar.transport.relay.transport import RelayTransportConfig
from refit_sidecar.transport.s3 import S3Config, S3TransportConfig
from refit_sidecar.transport.s3.inbound import S3Inbound, ident_of

S3 = S3Config(bucket="payloads", endpoint_url="http://127.0.0.1:9", addressing_style="path")
CONTEXT = InboundContext(node="n0", tokens=TokenRing(None))


class _NoSink:
    """Inbounds built here are never started, so nothing reaches their sink."""

    node = "n0"


def test_the_registry_implements_exactly_the_kinds_the_protocol_spells() -> None:
    assert tuple(transport.PLUGINS) == TRANSPORT_KINDS
    for kind in TRANSPORT_KINDS:
        p = transport.by_kind(kind)
        assert isinstance(p, TransportPlugin)
        assert p.kind == kind
        assert issubclass(p.sender_config, BaseModel)
        # The receiver's settings have the field that turns the kind's inbound on.
        assert p.receiver_field in ReceiverConfig.model_fields, p.receiver_field
    assert [p.kind for p in transport.plugins()] == list(TRANSPORT_KINDS)
    with pytest.raises(ValueError, match=r"unknown transport kind 'pigeon'; known: zmq, s3"):
        transport.by_kind("pigeon")


def test_a_sender_config_names_its_plugin() -> None:
    assert transport.for_sender(RelayTransportConfig(root="tcp://x:1")).kind == "zmq"
    s3 = S3TransportConfig(s3=S3, receivers=["http://127.0.0.1:9"])
    assert transport.for_sender(s3).kind == "s3"
    with pytest.raises(TypeError, match="no transport is configured by S3Config"):
        transport.for_sender(S3)


def test_each_plugin_makes_an_inbound_that_is_not_ready_before_it_starts() -> None:
    relay = transport.by_kind("zmq").inbound(
        RelayConfig(bind="tcp://127.0.0.1:0"), _NoSink(), CONTEXT
    )
    s3 = transport.by_kind("s3").inbound(S3, _NoSink(), CONTEXT)
    assert isinstance(relay, RelayInbound)
    assert isinstance(s3, S3Inbound)
    for inbound in (relay, s3):
        assert isinstance(inbound, Inbound)
        name, ok, detail = inbound.readiness()
        assert not ok, (name, detail)
        assert "not started" in detail
    assert relay.routes() == []
    paths = sorted(r.path for r in s3.routes())  # type: ignore[attr-defined]
    assert paths == ["/v1/manifest", "/v1/stream-end"]


def _prepare(**kw: object) -> PrepareRequest:
    return PrepareRequest(
        attempt="a1", from_version=0, target_version=1, mode="mixed", producers=[0], **kw
    )  # type: ignore[arg-type]


def test_a_relay_refuses_a_tree_that_does_not_name_it() -> None:
    me = RelayInbound(
        RelayConfig(bind="tcp://0.0.0.0:5701", advertise="tcp://me:1"), _NoSink(), CONTEXT
    )
    assert me.refusal(_prepare(relay_tree=["tcp://x:1"])) == (
        "this node's relay tcp://me:1 is not in relay_tree"
    )
    assert me.refusal(_prepare()) == ""  # no tree given: the configured nodes
    assert me.refusal(_prepare(relay_tree=["tcp://x:1", "tcp://me:1"])) == ""
    s3 = S3Inbound(S3, _NoSink(), CONTEXT)  # type: ignore[arg-type]
    assert s3.refusal(_prepare(relay_tree=["tcp://x:1"])) == ""  # a tree means nothing to S3


def _manifest(digest: str) -> ManifestEntry:
    return ManifestEntry(
        attempt="a", producer=2, payload_id=7, order=5, bucket="b", key="k", digest=digest, size=123
    )


def test_a_manifest_entry_names_a_payload_by_its_16_byte_digest() -> None:
    digest = bytes(range(16))
    assert ident_of(_manifest(digest.hex())) == PayloadIdent("a", 2, 7, 5, digest, 123)
    with pytest.raises(ValueError, match=r"^digest 'zz' is not hex$"):
        ident_of(_manifest("zz"))
    with pytest.raises(ValueError, match=r"^digest '(0{40})' is not hex$"):
        ident_of(_manifest("0" * 41))  # odd length; quoted up to 40 chars
    for n in (15, 17):
        with pytest.raises(ValueError, match=r"^digest must be 16 bytes \(BLAKE2b-128\)$"):
            ident_of(_manifest("ab" * n))


def test_a_relay_names_the_hosts_it_listens_on_for_the_token_rule() -> None:
    relay = transport.by_kind("zmq")
    assert relay.listen_hosts(RelayConfig(bind="tcp://127.0.0.1:5701")) == ["127.0.0.1"]
    both = RelayConfig(bind="tcp://127.0.0.1:5701", mac_bind="tcp://0.0.0.0:5702")
    assert relay.listen_hosts(both) == ["127.0.0.1", "0.0.0.0"]
    assert transport.by_kind("s3").listen_hosts(S3) == []  # it only connects out


class _Settings(BaseModel):
    transport: transport.SenderSettings


def test_a_settings_file_names_its_transport_by_kind() -> None:
    relay = _Settings.model_validate({"transport": {"root": "tcp://r:1"}})  # no kind: zmq
    assert isinstance(relay.transport, RelayTransportConfig)
    s3 = _Settings.model_validate(
        {"transport": {"kind": "s3", "s3": S3.model_dump(mode="json"), "producer": 2}}
    )
    assert isinstance(s3.transport, S3TransportConfig)
    assert s3.transport.receivers == []  # each attempt plan names them
    dumped = s3.model_dump(mode="json")
    assert dumped["transport"]["kind"] == "s3"
    assert dumped["transport"]["producer"] == 2
    assert _Settings.model_validate(dumped) == s3  # written back, read again
    with pytest.raises(ValueError, match="unknown transport kind 'pigeon'; known: zmq, s3"):
        _Settings.model_validate({"transport": {"kind": "pigeon"}})
    with pytest.raises(ValueError, match=r"transport\.s3\n  Field required"):
        _Settings.model_validate({"transport": {"kind": "s3"}})
    with pytest.raises(ValueError, match="no transport is configured by S3Config"):
        _Settings(transport=S3)
