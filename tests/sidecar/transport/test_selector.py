"""The registry's sender factory (`transport.make`) and a producer's per-attempt
`TransportSelector`: the plan names the destination, one real transport is made per
destination and reused, and nothing is guessed when a plan names none."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import SecretStr

from refit_protocol.producer_api import AttemptPlan
from refit_sidecar import transport
from refit_sidecar.transport.relay.transport import RelayTransport, RelayTransportConfig
from refit_sidecar.transport.s3 import S3Config, S3Transport, S3TransportConfig
from refit_sidecar.transport.selector import TransportSelector

S3 = S3Config(bucket="payloads", endpoint_url="http://127.0.0.1:9", addressing_style="path")


def plan(
    attempt: str, *, tree: tuple[str, ...] = (), receivers: tuple[str, ...] = ()
) -> AttemptPlan:
    return AttemptPlan(
        attempt=attempt,
        from_version=0,
        target_version=1,
        baseline_id="g1",
        mode="mixed",
        receivers=receivers,
        relay_tree=tree,
    )


@pytest.fixture
def relay_selector() -> Iterator[TransportSelector]:
    template = RelayTransportConfig(root="", token=SecretStr("t"), producer=3, stop_timeout_s=7)
    selector = TransportSelector(template)
    yield selector
    selector.close()


def test_make_builds_each_kind_from_its_config() -> None:
    relay = transport.make("zmq", RelayTransportConfig(root="tcp://127.0.0.1:9"))
    s3 = transport.make("s3", S3TransportConfig(s3=S3, receivers=["http://127.0.0.1:9"]))
    try:
        assert isinstance(relay, RelayTransport)
        assert isinstance(s3, S3Transport)
        assert isinstance(relay, transport.Transport)
    finally:
        relay.close()  # type: ignore[attr-defined]
        s3.close()  # type: ignore[attr-defined]


def test_make_refuses_a_config_of_another_kind_or_an_unknown_kind() -> None:
    with pytest.raises(TypeError, match="'zmq' needs a RelayTransportConfig, got S3Transport"):
        transport.make("zmq", S3TransportConfig(s3=S3, receivers=["http://x"]))
    with pytest.raises(TypeError, match="S3TransportConfig"):
        transport.make("s3", RelayTransportConfig(root="tcp://x:1"))
    with pytest.raises(ValueError, match="unknown transport kind 'carrier-pigeon'"):
        transport.make("carrier-pigeon", RelayTransportConfig(root="x"))  # type: ignore[arg-type]


def test_relay_root_comes_from_the_plan_and_is_reused(relay_selector: TransportSelector) -> None:
    a = relay_selector(plan("a1", tree=("tcp://10.0.0.1:5701", "tcp://10.0.0.2:5701")))
    again = relay_selector(plan("a2", tree=("tcp://10.0.0.1:5701",)))
    other = relay_selector(plan("a3", tree=("tcp://10.0.0.2:5701", "tcp://10.0.0.1:5701")))
    assert a is again
    assert other is not a
    assert isinstance(a, RelayTransport)
    # Every setting but the destination comes from the template.
    assert (a.config.root, other.config.root) == ("tcp://10.0.0.1:5701", "tcp://10.0.0.2:5701")
    assert a.config.producer == 3
    assert a.config.stop_timeout_s == 7
    assert a.config.token is not None
    assert a.config.token.get_secret_value() == "t"


def test_a_plan_without_a_tree_needs_a_configured_root(relay_selector: TransportSelector) -> None:
    with pytest.raises(ValueError, match="attempt a1 names no relay tree"):
        relay_selector(plan("a1"))
    fallback = TransportSelector(RelayTransportConfig(root="tcp://10.0.0.9:5701"))
    try:
        t = fallback(plan("a1"))
        assert isinstance(t, RelayTransport)
        assert t.config.root == "tcp://10.0.0.9:5701"
    finally:
        fallback.close()


def test_s3_announces_to_the_plans_receivers() -> None:
    urls = {"n0": "http://10.0.0.1:8470", "n1": "http://10.0.0.2:8470"}
    template = S3TransportConfig(s3=S3, receivers=list(urls.values()), producer=0)
    selector = TransportSelector(template, receiver_urls=lambda names: [urls[n] for n in names])
    try:
        both = selector(plan("a1", receivers=("n0", "n1")))
        one = selector(plan("a2", receivers=("n1",)))
        assert isinstance(both, S3Transport)
        assert isinstance(one, S3Transport)
        assert both.config.receivers == list(urls.values())
        assert one.config.receivers == ["http://10.0.0.2:8470"]
        assert selector(plan("a3", receivers=("n0", "n1"))) is both
    finally:
        selector.close()
