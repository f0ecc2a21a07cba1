"""Hostile token sources against real in-process relay nodes and real ZeroMQ sockets (issue 34).

- A token file that turns undecodable (or otherwise invalid) is "no valid token": the relay
  keeps the ring it had, keeps answering CURVE handshakes, and takes the file again once it is
  fixed, within one poll interval. No error raised while following the ring ends the relay.
- A Secret listing 1000 tokens (an explicit overlap list) does not make a forwarder open one
  socket per token: a payload is forwarded to two children, one of which serves with a token
  deep in the list.
- A forwarder that cannot open its sockets resolves every send with a typed error.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
from prometheus_client import CollectorRegistry

from refit_protocol.keys import payload_mac_key
from refit_protocol.kit.metrics import registry_problems
from refit_protocol.kit.tokens import FileTokenRing, TokenRing
from refit_sidecar.codec.encode import encode_payload
from refit_sidecar.codec.records import Item, Op, TensorMeta
from refit_sidecar.codec.wire import CODEC_VERSION, EncodedPayload, PayloadHeader
from refit_sidecar.transport.errors import TransportError
from refit_sidecar.transport.relay import key_hunt
from refit_sidecar.transport.relay.config import DealerConfig, RelayConfig
from refit_sidecar.transport.relay.dealer import RelayDealer
from refit_sidecar.transport.relay.frames import AckStatus, FrameMeta, Verdict
from refit_sidecar.transport.relay.node import RelayNode
from tests.harness.operator_env import wait_for
from tests.harness.procs import free_ports

A, B = "hostile-token-a-0c1f", "hostile-token-b-77d2"
POLL_S = 0.25  # the token file's check interval in these tests
QUICK = DealerConfig(ack_timeout_s=1.0, max_retries=1, connect_timeout_s=2.0)


class Sink:
    """The part of a receiver a relay talks to: every attempt is known and admissible."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.tree: list[str] = []
        self.staged: list[tuple[FrameMeta, bytes]] = []
        self.ended: list[FrameMeta] = []
        self.failures: list[str] = []

    def relay_tree(self, attempt: str) -> list[str]:
        return self.tree

    def relay_mac_tree(self, attempt: str) -> list[str]:
        return []  # these relays link over CurveZMQ: the tokens' keys are what is tested

    def relay_check(self, meta: FrameMeta, *, probe: bool) -> Verdict | None:
        return None

    def relay_stage(
        self, meta: FrameMeta, body: memoryview, keep: object, children: int
    ) -> Verdict:
        self.staged.append((meta, bytes(body)))
        return (AckStatus.STAGED, "")

    def relay_release(self, meta: FrameMeta, error: str | None) -> None:
        if error is not None:
            self.failures.append(error)

    def relay_end(self, meta: FrameMeta) -> Verdict:
        self.ended.append(meta)
        return (AckStatus.STAGED, "")

    def relay_fail(self, attempt: str, reason: str) -> None:
        self.failures.append(reason)


def start_relays(
    rings: list[TokenRing], registries: list[CollectorRegistry], forward: DealerConfig = QUICK
) -> list[RelayNode]:
    """Relays over `rings`, one tree (the first is the root), each on its own free port."""
    endpoints = [f"tcp://127.0.0.1:{p}" for p in free_ports(len(rings))]
    nodes = []
    for i, (ring, endpoint) in enumerate(zip(rings, endpoints, strict=True)):
        sink = Sink(f"node-{i}")
        sink.tree = endpoints
        config = RelayConfig(bind=endpoint, nodes=endpoints, forward=forward)
        nodes.append(RelayNode(config, sink, token=ring, registry=registries[i]).start())
    return nodes


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def end_frame(attempt: str) -> FrameMeta:
    return FrameMeta(attempt=attempt, producer=0, total=0)


def answered(fut: Future[AckStatus], within: float) -> AckStatus:
    return fut.result(timeout=within)


def payload(attempt: str, token: str) -> EncodedPayload:
    meta = TensorMeta("w", (64,), torch.float32)
    values = torch.arange(64, dtype=torch.int32)
    header = PayloadHeader(CODEC_VERSION, attempt, 0, 0, 0)
    item = Item(meta, Op.OVERWRITE, 0, None, values)
    return encode_payload(header, [item], mac_key=payload_mac_key(token))


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    """Relays and clients a test opened, closed at its end whatever happened."""
    opened: list[Any] = []
    yield opened
    for thing in reversed(opened):
        thing.close()


def test_an_undecodable_token_file_keeps_the_ring_and_never_stops_the_relay(
    tmp_path: Path, closing: list[Any]
) -> None:
    path = tmp_path / "token"
    path.write_text(A + "\n")
    ring = FileTokenRing(path, grace_s=0.0, check_every_s=POLL_S)
    registry = CollectorRegistry()
    (relay,) = start_relays([ring], [registry])
    closing.append(relay)
    client_a = RelayDealer(relay.bound, token=A, config=QUICK, name="client-a")
    closing.append(client_a)
    assert answered(client_a.submit_end(end_frame("before")), 5) is AckStatus.STAGED

    # Not UTF-8 (and a NUL): the kubelet wrote garbage, or someone did. Wait well past a poll.
    path.write_bytes(b"\xff\xfe\x00" + b"\x80" * 61)
    time.sleep(4 * POLL_S)
    # The ring it had is kept: the relay still completes handshakes and answers with A.
    assert answered(client_a.submit_end(end_frame("during")), 5) is AckStatus.STAGED
    assert ring.accepted() == (A,)
    assert sample(registry, "kuberefit_token_file_rejected_total", reason="not_utf8") == 1

    # Fixed: a new token (no grace here, so the relay serves B's keys at once).
    fixed = tmp_path / "token.new"
    fixed.write_text(B + "\n")
    fixed.replace(path)
    seen = time.monotonic()
    client_b = RelayDealer(relay.bound, token=B, config=QUICK, name="client-b")
    closing.append(client_b)
    assert answered(client_b.submit_end(end_frame("after")), 5) is AckStatus.STAGED
    # Within one poll interval (plus the time to bind again and connect, on a loaded machine).
    assert time.monotonic() - seen < POLL_S + 1.5
    assert relay._thread is not None
    assert relay._thread.is_alive()
    assert sample(registry, "kuberefit_token_file_rejected_total", reason="not_utf8") == 1
    problems = registry_problems(registry)  # the families follow the project's conventions
    assert [p for p in problems if not p.startswith("kuberefit_build_info")] == []


class FlakyRing(TokenRing):
    """A ring whose reload fails for a while, as a bug in a source or a callback would."""

    def __init__(self, text: str, limit: int = 3) -> None:
        super().__init__(text)
        self.armed = False
        self.limit = limit
        self.failures = 0

    def current_generation(self) -> int:
        if self.armed and self.failures < self.limit:
            self.failures += 1
            raise RuntimeError("reload failed")
        return super().current_generation()


def test_no_error_while_following_the_ring_ends_the_relay_loop(closing: list[Any]) -> None:
    registry = CollectorRegistry()
    ring = FlakyRing(A)
    (relay,) = start_relays([ring], [registry])
    closing.append(relay)
    client = RelayDealer(relay.bound, token=A, config=QUICK, name="client")
    closing.append(client)
    assert answered(client.submit_end(end_frame("steady")), 5) is AckStatus.STAGED
    ring.armed = True
    wait_for("the reload failed three times", lambda: ring.failures == 3, timeout=5, every=0.01)
    assert answered(client.submit_end(end_frame("flaky")), 5) is AckStatus.STAGED
    assert sample(registry, "kuberefit_relay_loop_errors_total", where="rotation") >= 1


OVERLAP = [f"overlap-token-{i:04d}" for i in range(1000)]


def test_a_thousand_token_ring_forwards_a_payload(closing: list[Any]) -> None:
    # Every process lists the same 1000 tokens; child 2 serves with one deep in the list (a pod
    # whose copy of the Secret named it first), so its forwarder must find that key.
    text = "\n".join(OVERLAP) + "\n"
    deep = OVERLAP[777]
    rings = [
        TokenRing(text, grace_s=0.0),
        TokenRing(text, grace_s=0.0),
        TokenRing("\n".join([deep, *OVERLAP]) + "\n", grace_s=0.0),
    ]
    registries = [CollectorRegistry() for _ in rings]
    patient = DealerConfig(ack_timeout_s=5.0, max_retries=1)  # finding the key takes ~1 s here
    relays = start_relays(rings, registries, patient)
    closing.extend(relays)
    producer = RelayDealer(
        relays[0].bound, token=TokenRing(text, grace_s=0.0), config=patient, name="producer"
    )
    closing.append(producer)
    p = payload("many", OVERLAP[0])
    status = answered(producer.submit_data(FrameMeta.of(p), p.body), 15)
    assert status is AckStatus.STAGED
    assert relays[0].drain("many", timeout=15) == []
    for relay in relays:
        sink = relay.sink
        assert isinstance(sink, Sink)
        assert [bytes(b) for _, b in sink.staged] == [bytes(p.body)], sink.node
        assert sink.failures == [], sink.node
    assert sample(registries[0], "kuberefit_relay_forwards_total", result="ok") == 2
    # However many tokens the ring lists, each forwarder holds a handful of sockets: the likely
    # keys (at most 4), the one found, and the fallback keys being tried (HUNT_WIDTH).
    assert key_hunt.MAX_LINKS == 9
    for client in [producer, *relays[0]._clients.values()]:
        assert len(client._links) <= key_hunt.MAX_LINKS


def test_a_forwarder_that_cannot_open_sockets_fails_each_send_with_a_typed_error() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 1)  # libzmq refuses the second socket ("Too many open files")
    client = RelayDealer(
        "tcp://127.0.0.1:9", token=TokenRing(f"{A}\n{B}\n"), config=QUICK, context=ctx
    )
    try:
        fut = client.submit_end(end_frame("no-sockets"))
        with pytest.raises(TransportError):
            fut.result(timeout=5)
        again = client.submit_end(end_frame("still-no-sockets"))
        with pytest.raises(TransportError):
            again.result(timeout=5)
    finally:
        client.close()
        ctx.destroy(linger=0)


def test_a_forwarder_whose_ring_fails_resolves_each_send_and_recovers(closing: list[Any]) -> None:
    (relay,) = start_relays([TokenRing(A)], [CollectorRegistry()])
    closing.append(relay)
    ring = FlakyRing(A, limit=1 << 30)
    ring.armed = True
    client = RelayDealer(relay.bound, token=ring, config=QUICK, name="flaky-client")
    closing.append(client)
    with pytest.raises(TransportError):
        client.submit_end(end_frame("failing")).result(timeout=5)
    assert client.errors >= 1
    assert not client.dead
    ring.armed = False
    assert answered(client.submit_end(end_frame("recovered")), 5) is AckStatus.STAGED
