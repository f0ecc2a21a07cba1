"""The ZeroMQ relay tree with every node a real process: exactly-once delivery to all nodes in
declared order, dedup, id reuse, corruption, obsolete attempts, authentication on both kinds of
link (CurveZMQ, MAC-only), and a relay SIGKILLed mid-stream (flush fails within its deadline,
nothing hangs). The relays forward to each other over MAC-only links unless a test says not."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import psutil
import pytest
import torch
import urllib3
import zmq
from pydantic import SecretStr

from refit_protocol.receiver_api import PrepareRequest
from refit_sidecar.codec.records import Op
from refit_sidecar.codec.wire import EncodedPayload
from refit_sidecar.transport.errors import (
    AttemptObsoleteError,
    DeliveryTimeoutError,
    PayloadRejectedError,
    TransportStoppedError,
)
from refit_sidecar.transport.relay.config import DealerConfig
from refit_sidecar.transport.relay.curve import (
    curve_keys,
    mac_client,
    secure_client,
    secure_server,
)
from refit_sidecar.transport.relay.dealer import RelayDealer
from refit_sidecar.transport.relay.frames import (
    ACK,
    AckStatus,
    FrameMeta,
    LinkSecurity,
    parse_ack,
    sign_frame,
    tag_verifies,
)
from refit_sidecar.transport.relay.transport import RelayTransport, RelayTransportConfig
from tests.harness.operator_env import wait_for
from tests.harness.receivers import HARNESS_MAC_KEY, Cluster, NodeProc, metric_sum, start_cluster
from tests.sidecar.receiver.models import (
    canonical,
    fingerprint,
    metas,
    payloads,
    perturb,
    read_applied,
    recording_settings,
)

CLIENT = DealerConfig(ack_timeout_s=3.0, max_retries=2, unknown_attempt_timeout_s=5.0)


@dataclass
class Held:
    """What every node of the module's cluster holds: the last committed version and its bits
    (owned by the `held` fixture, not the module, so each test starts from the fixture)."""

    version: int
    weights: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(tmp_path_factory.mktemp("relay7"), 7, applier=recording_settings)
    try:
        c.each(lambda n: n.ctl.prewarm(metas(canonical(0))))
        yield c
    finally:
        c.stop_all()


@pytest.fixture(scope="module")
def held(cluster: Cluster) -> Held:
    return Held(0, canonical(0))


def transport(c: Cluster, root: int, **kw: object) -> RelayTransport:
    cfg = RelayTransportConfig(
        root=c.relay_tree[root], token=SecretStr(c.token), client=CLIENT, **kw
    )  # type: ignore[arg-type]
    return RelayTransport(cfg)


def prepare(
    c: Cluster,
    held: Held,
    attempt: str,
    mode: str,
    producers: list[int],
    *,
    open_apply: bool = True,
    mac: bool = True,
) -> None:
    """Prepare `attempt` everywhere; `mac`: the relays forward to each other over MAC-only
    links (the product's default), else over CurveZMQ."""
    version = held.version
    req = PrepareRequest(
        attempt=attempt,
        from_version=version,
        target_version=version + 1,
        mode=mode,
        producers=producers,
        relay_tree=c.relay_tree,
        relay_mac_tree=c.relay_mac_tree if mac else [],
    )  # type: ignore[arg-type]
    answers = c.each(lambda n: n.ctl.prepare(req))
    assert all(a.accepted for a in answers), [a.reason for a in answers]
    if open_apply:
        c.each(lambda n: n.ctl.gate(attempt, True))
        c.each(lambda n: n.ctl.open_apply(attempt))


def finish(
    c: Cluster, held: Held, attempt: str, expected: dict[int, int], target: dict[str, torch.Tensor]
) -> None:
    relayed = c.each(lambda n: n.ctl.relay_flush(attempt, expected, timeout_s=20))
    assert all(r.ok for r in relayed), [r.errors for r in relayed]
    acks = c.each(lambda n: n.ctl.flush(attempt, expected, timeout_s=30))
    assert all(a.ok for a in acks), [a.errors for a in acks]
    total = sum(expected.values())
    assert [a.applied for a in acks] == [total] * len(c.nodes)
    for node in c.nodes:
        rows = [r for r in read_applied(node.applied_log) if r["attempt"] == attempt]
        keys = [(r["producer"], r["payload_id"]) for r in rows]
        assert len(keys) == len(set(keys)) == total, (node.name, keys)  # exactly once
        assert [(r["order"], r["producer"]) for r in rows] == sorted(
            (r["order"], r["producer"]) for r in rows
        ), f"{node.name} applied out of declared order"
        assert rows[-1]["fingerprint"] == fingerprint(target), f"{node.name}: wrong bits"
    version = held.version + 1
    c.each(lambda n: n.ctl.commit(attempt, version))
    c.each(lambda n: n.ctl.cleanup(attempt))
    c.each(lambda n: n.ctl.gate(attempt, False))
    held.version, held.weights = version, target


def send_all(t: RelayTransport, attempt: str, ps: list[EncodedPayload]) -> None:
    for p in ps:
        t.send(attempt, p)
    summary = t.stop_and_wait(attempt)
    assert summary.errors == (), summary
    assert summary.payloads_acknowledged == len(ps), summary


def test_every_payload_reaches_every_node_exactly_once(cluster: Cluster, held: Held) -> None:
    old = held.weights
    assert isinstance(old, dict)
    new = perturb(old, 11)
    names = list(new)
    p0 = payloads("t1", 0, old, new, names=names[:5])
    p1 = payloads("t1", 1, old, new, names=names[5:])
    prepare(cluster, held, "t1", "mixed", [0, 1])
    t0, t1 = transport(cluster, 0), transport(cluster, 3)  # two roots, two rotated trees
    try:
        send_all(t0, "t1", p0)
        send_all(t1, "t1", p1)
    finally:
        t0.close()
        t1.close()
    finish(
        cluster, held, "t1", {0: len(p0), 1: len(p1)}, new
    )  # XOR twice would revert: bits prove once


def test_duplicates_are_acknowledged_and_ignored(cluster: Cluster, held: Held) -> None:
    old = held.weights
    assert isinstance(old, dict)
    new = perturb(old, 12)
    ps = payloads("t2", 0, old, new)
    prepare(cluster, held, "t2", "mixed", [0])
    t = transport(cluster, 0)
    raw = RelayDealer(cluster.relay_tree[5], token=cluster.token, config=CLIENT)

    def node5_staged() -> int:
        return cluster.nodes[5].ctl.status().staged

    try:
        send_all(t, "t2", ps)
        # Forwarding to node 5 continues after the root's ACK.
        wait_for("node 5 has every payload", lambda: node5_staged() == len(ps), timeout=10)
        for p in ps[:3]:  # a producer retry to the root, and a late forward to an inner node
            assert (
                _send_raw(RelayDealer(cluster.relay_tree[0], token=cluster.token, config=CLIENT), p)
                is AckStatus.DUPLICATE
            )
            assert _send_raw(raw, p, root=0) is AckStatus.DUPLICATE
    finally:
        t.close()
        raw.close()
    finish(cluster, held, "t2", {0: len(ps)}, new)


def test_id_reuse_with_other_bytes_fails_the_attempt(cluster: Cluster, held: Held) -> None:
    old = held.weights
    assert isinstance(old, dict)
    a = payloads("t3", 0, old, perturb(old, 13), op=Op.OVERWRITE)
    b = payloads("t3", 0, old, perturb(old, 14), op=Op.OVERWRITE)
    prepare(cluster, held, "t3", "overwrite", [0], open_apply=False)
    t = transport(cluster, 0)
    try:
        t.send("t3", a[0])
        t.send("t3", a[1])
        t.send("t3", b[0])  # a producer bug: same id, other bytes
        summary = t.stop_and_wait("t3")
        assert summary.payloads_acknowledged == 2
        assert "reused with other bytes" in summary.errors[0]
        with pytest.raises(PayloadRejectedError, match="reused with other bytes"):
            t.send("t3", a[2])
    finally:
        t.close()
    root = cluster.nodes[0].ctl
    assert root.status().phase == "failed"
    assert not root.relay_flush("t3", {0: 2}, timeout_s=2).ok
    stop_everywhere(cluster, "t3")


def test_corrupted_body_is_rejected_by_its_mac(cluster: Cluster, held: Held) -> None:
    """A flipped body bit fails the payload's keyed MAC, checked on arrival before the digest,
    before staging and before any forward."""
    old = held.weights
    assert isinstance(old, dict)
    p = payloads("t4", 0, old, perturb(old, 15))[0]
    prepare(cluster, held, "t4", "overwrite", [0], open_apply=False)
    bad = bytearray(p.body)
    bad[len(bad) // 2] ^= 0x01
    client = RelayDealer(cluster.relay_tree[0], token=cluster.token, config=CLIENT)
    try:
        meta = _meta(p)
        with pytest.raises(PayloadRejectedError, match="AuthenticationError"):
            client.submit_data(meta, bytes(bad)).result(10)
    finally:
        client.close()
    statuses = cluster.each(lambda n: n.ctl.status())
    assert statuses[0].phase == "failed"
    assert "AuthenticationError" in statuses[0].errors[0]
    assert [s.staged for s in statuses] == [0] * 7  # never registered, never forwarded
    stop_everywhere(cluster, "t4")


def test_payloads_of_an_obsolete_attempt_are_dropped(cluster: Cluster, held: Held) -> None:
    old = held.weights
    assert isinstance(old, dict)
    new = perturb(old, 16)
    stale = payloads("t5a", 0, old, new)
    prepare(cluster, held, "t5a", "mixed", [0], open_apply=False)
    t = transport(cluster, 0)
    try:
        for p in stale[:2]:
            t.send("t5a", p)
        assert t.stop_and_wait("t5a").payloads_acknowledged == 2
        wait_for(
            "the tree delivered both everywhere",
            lambda: all(s.staged == 2 for s in cluster.each(lambda n: n.ctl.status())),
            timeout=10,
        )
        before = [s.dropped for s in cluster.each(lambda n: n.ctl.status())]
        prepare(cluster, held, "t5b", "overwrite", [0])  # replaces t5a everywhere
        client = RelayDealer(cluster.relay_tree[0], token=cluster.token, config=CLIENT)
        try:
            late = client.submit_data(_meta(stale[2]), stale[2].body)
            with pytest.raises(AttemptObsoleteError):
                late.result(10)
        finally:
            client.close()
        after = [s.dropped for s in cluster.each(lambda n: n.ctl.status())]
        assert all(n >= 2 for n in after)  # every node dropped its two queued t5a payloads
        assert after[0] == before[0] + 3  # ... and the root the late one too
        fresh = payloads("t5b", 0, old, new, op=Op.OVERWRITE)
        send_all(t, "t5b", fresh)
    finally:
        t.close()
    finish(cluster, held, "t5b", {0: len(fresh)}, new)
    for node in cluster.nodes:
        assert not [r for r in read_applied(node.applied_log) if r["attempt"] == "t5a"]


def test_out_of_order_arrival_is_applied_in_declared_order(cluster: Cluster, held: Held) -> None:
    old = held.weights
    assert isinstance(old, dict)
    new = perturb(old, 17)
    ps = payloads("t6", 0, old, new)
    random.Random(6).shuffle(ps)
    assert [p.header.order for p in ps] != sorted(p.header.order for p in ps)
    prepare(cluster, held, "t6", "mixed", [0], mac=False)  # every link CurveZMQ
    t = transport(cluster, 2)
    try:
        send_all(t, "t6", ps)
    finally:
        t.close()
    finish(cluster, held, "t6", {0: len(ps)}, new)  # finish() checks declared order on every node


def test_missing_or_wrong_token_is_rejected(cluster: Cluster, held: Held) -> None:
    node = cluster.nodes[4]
    before = node.ctl.status()
    for token in (None, "wrong-" + cluster.token):
        for method, path in (
            ("GET", "/v1/status"),
            ("POST", "/v1/prepare"),
            ("GET", "/metrics"),
            ("POST", "/v1/flush"),
            ("POST", "/v1/manifest"),
        ):
            status, body = node.ctl.raw(method, path, b"{}", token=token)
            assert status == 401, (path, status, body)
    assert node.ctl.raw("GET", "/healthz", token=None)[0] == 200
    assert node.ctl.status() == before  # nothing changed

    old = held.weights
    assert isinstance(old, dict)
    p = payloads("t7", 0, old, perturb(old, 18))[0]
    prepare(cluster, held, "t7", "overwrite", [0], open_apply=False)
    quick = DealerConfig(ack_timeout_s=0.5, max_retries=1)
    rss = psutil.Process(node.proc.proc.pid).memory_info().rss  # type: ignore[union-attr]
    # Without the policy's Curve keys (no token, a wrong one) no handshake completes: nothing
    # is answered, staged or even buffered.
    for token in (None, "wrong"):
        before = metric_sum(node, REFUSED)
        client = RelayDealer(node.relay, token=token, config=quick)
        try:
            with pytest.raises(DeliveryTimeoutError):  # dropped without an answer
                client.submit_data(_meta(p), p.body).result(10)
        finally:
            client.close()
        wait_for(f"token {token!r} refused", lambda b=before: metric_sum(node, REFUSED) > b)
    # A client that knows the relay's public key but holds another key pair: refused by ZAP.
    before = metric_sum(node, REFUSED)
    stranger = zmq.Context.instance().socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    public, secret = zmq.curve_keypair()
    stranger.curve_publickey, stranger.curve_secretkey = public, secret
    stranger.curve_serverkey = curve_keys(cluster.token).public
    stranger.setsockopt(zmq.SNDTIMEO, 5000)  # no pipe may ever be ready: never block on it
    stranger.connect(node.relay)
    try:
        with contextlib.suppress(zmq.Again):
            stranger.send_multipart([b"PROBE", _meta(p).model_dump_json().encode()])
        wait_for("the stranger refused", lambda: metric_sum(node, REFUSED) > before, timeout=10)
    finally:
        stranger.close(linger=0)
    # Knowing the token is not enough either: frames that carry it, on a socket without the
    # key pair derived from it (64 MiB of them), never reach the relay.
    before = metric_sum(node, REFUSED)
    plain = zmq.Context.instance().socket(zmq.DEALER)
    plain.setsockopt(zmq.LINGER, 0)
    # A DEALER whose only peer keeps failing the handshake may have no pipe to queue into, and
    # then send blocks forever: bound it. Either way the frames must not reach the relay.
    plain.setsockopt(zmq.SNDTIMEO, 5000)
    plain.connect(node.relay)
    meta = _meta(p).model_copy(update={"token": cluster.token}).model_dump_json().encode()
    try:
        with contextlib.suppress(zmq.Again):
            plain.send_multipart([b"DATA", meta, b"\0" * (64 << 20)], copy=False)
        wait_for("the plain socket refused", lambda: metric_sum(node, REFUSED) > before, timeout=10)
    finally:
        plain.close(linger=0)
    grown = psutil.Process(node.proc.proc.pid).memory_info().rss - rss  # type: ignore[union-attr]
    assert grown < 32 << 20, f"an unauthenticated peer made the receiver hold {grown} bytes"
    assert node.ctl.status().staged == 0
    assert metric_sum(node, 'kuberefit_relay_frames_dropped_total{reason="unauthenticated"}') == 0
    stop_everywhere(cluster, "t7")


def test_a_frame_no_peer_will_take_fails_within_the_retry_budget() -> None:
    """A plain client of a Curve relay: the socket may refuse the frame outright (no peer ever
    completes the handshake). It must still fail within ack_timeout x (retries + 1), never hang
    (a CI run once waited forever here)."""
    ctx = zmq.Context.instance()
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    secure_server(server, "the-relays-token")
    endpoint = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
    quick = DealerConfig(ack_timeout_s=0.4, max_retries=1)
    budget = quick.ack_timeout_s * (quick.max_retries + 1)
    body = b"\0" * (1 << 20)
    try:
        for i in range(6):  # either way of failing (never taken / never answered) must be bounded
            client = RelayDealer(endpoint, token=None, config=quick)
            meta = FrameMeta(attempt="t-blocked", producer=0, payload_id=i, size=len(body))
            started = time.monotonic()
            try:
                with pytest.raises(DeliveryTimeoutError):
                    client.submit_data(meta, body).result(budget + 5)
            finally:
                client.close()
            assert time.monotonic() - started < budget + 5
        assert server.poll(0) == 0  # nothing ever reached the relay
    finally:
        server.close(linger=0)


def test_random_frames_from_an_authenticated_peer_are_refused_cleanly(
    cluster: Cluster, held: Held
) -> None:
    """Fuzzing the relay's frame intake (seeded): a peer that holds the policy's keys sends
    malformed multipart messages (random kinds, truncated and mutated metadata, bodies that are
    not payloads). The relay answers or drops each, counts them, and keeps serving: the next
    attempt's real payload is staged."""
    rng = random.Random(15)
    node = cluster.nodes[2]
    old = held.weights
    assert isinstance(old, dict)
    p = payloads("t8", 0, old, perturb(old, 19))[0]
    prepare(cluster, held, "t8", "overwrite", [0], open_apply=False)
    good = _meta(p).model_copy(update={"token": cluster.token}).model_dump_json().encode()
    handled_before = _handled(node)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_client(sock, cluster.token)
    sock.connect(node.relay)
    try:
        for _ in range(300):
            kind = rng.choice([b"DATA", b"PROBE", b"END", b"ACK", b"", rng.randbytes(5)])
            meta = bytearray(good)
            for _ in range(rng.randint(0, 4)):
                meta[rng.randrange(len(meta))] = rng.randrange(256)
            if rng.random() < 0.2:
                meta = meta[: rng.randrange(len(meta))]
            body = rng.choice(
                [b"", rng.randbytes(rng.randint(1, 4096)), p.body[: rng.randint(1, 200)]]
            )
            frames = [kind, bytes(meta), body][: rng.randint(1, 3)] + [b"x"] * rng.randint(0, 2)
            sock.send_multipart(frames)
        wait_for(
            "every random frame answered or dropped",
            lambda: _handled(node) - handled_before >= 300,
            timeout=20,
        )
    finally:
        sock.close(linger=0)
    assert node.ctl.raw("GET", "/healthz", token=None)[0] == 200
    stop_everywhere(cluster, "t8")  # (random frames with t8's ids may have failed it)
    # Still serving: the next attempt's real payload is taken.
    q = payloads("t9", 0, old, perturb(old, 20))[0]
    prepare(cluster, held, "t9", "overwrite", [0], open_apply=False)
    client = RelayDealer(node.relay, token=cluster.token, config=CLIENT)
    try:
        assert client.submit_data(_meta(q), q.body).result(10) is AckStatus.STAGED
    finally:
        client.close()
    stop_everywhere(cluster, "t9")


def test_a_mac_only_link_takes_tagged_frames_only(cluster: Cluster, held: Held) -> None:
    """Anyone on the pod network can reach a relay's MAC-only port. A frame whose tag another
    key made, whose metadata was altered after tagging, or whose tagged metadata travels with
    another payload's body is dropped unanswered, counted, and fails nothing; the genuine frame
    is staged, a replay of it is only a duplicate, and no frame or answer carries the token. A
    peer without the link password (derived from the token) cannot even connect."""
    node = cluster.nodes[5]
    old = held.weights
    assert isinstance(old, dict)
    p, q = payloads("t10", 0, old, perturb(old, 21))[:2]
    prepare(cluster, held, "t10", "overwrite", [0], open_apply=False)
    unauth = 'kuberefit_relay_frames_dropped_total{reason="unauthenticated"}'
    before = metric_sum(node, unauth)
    meta = _meta(p).model_dump_json().encode()
    assert cluster.token.encode() not in meta
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    mac_client(sock, cluster.token)  # the link password: seen by whoever watches the network
    sock.connect(node.relay_mac)
    try:
        altered = _meta(p).model_copy(update={"order": 999}).model_dump_json().encode()
        forgeries = [
            [b"DATA", meta, sign_frame("another-" + cluster.token, b"DATA", meta), p.body],
            [b"DATA", altered, sign_frame(cluster.token, b"DATA", meta), p.body],
            [b"DATA", meta, sign_frame(cluster.token, b"DATA", meta), q.body],  # spliced
            [b"END", meta, b"\0" * 32],
        ]
        for frames in forgeries:
            sock.send_multipart(frames)
        wait_for(
            "every forgery dropped",
            lambda: metric_sum(node, unauth) >= before + len(forgeries),
            timeout=10,
        )
        assert not sock.poll(500), "a forged frame was answered"
        status = node.ctl.status()
        assert status.staged == 0, status  # nothing taken
        assert not status.errors, status  # nothing failed

        client = RelayDealer(
            node.relay_mac, token=cluster.token, config=CLIENT, link=LinkSecurity.MAC
        )
        try:
            assert client.submit_data(_meta(p), p.body).result(10) is AckStatus.STAGED
        finally:
            client.close()
        sock.send_multipart([b"DATA", meta, sign_frame(cluster.token, b"DATA", meta), p.body])
        assert sock.poll(10_000), "the replay was not answered"
        answer = sock.recv_multipart()
        assert answer[0] == ACK
        assert tag_verifies([cluster.token], ACK, answer[1], answer[2])
        assert cluster.token.encode() not in b"".join(answer)
        ack = parse_ack(answer[1])
        assert ack is not None
        assert ack.status is AckStatus.DUPLICATE
        assert node.ctl.status().staged == 1
    finally:
        sock.close(linger=0)
    # A peer without the link password (none, or another token's) gets no connection at all:
    # not one byte of its 64 MiB frame is buffered (counted as a refused handshake).
    rss = psutil.Process(node.proc.proc.pid).memory_info().rss  # type: ignore[union-attr]
    for password_of in (None, "another-" + cluster.token):
        refused = metric_sum(node, REFUSED)
        outsider = zmq.Context.instance().socket(zmq.DEALER)
        outsider.setsockopt(zmq.LINGER, 0)
        outsider.setsockopt(zmq.SNDTIMEO, 5000)
        if password_of is not None:
            mac_client(outsider, password_of)
        outsider.connect(node.relay_mac)
        try:
            with contextlib.suppress(zmq.Again):
                tag = sign_frame(cluster.token, b"DATA", meta)
                outsider.send_multipart([b"DATA", meta, tag, b"\0" * (64 << 20)], copy=False)
            wait_for("the outsider refused", lambda r=refused: metric_sum(node, REFUSED) > r)
            assert not outsider.poll(500)
        finally:
            outsider.close(linger=0)
    grown = psutil.Process(node.proc.proc.pid).memory_info().rss - rss  # type: ignore[union-attr]
    assert grown < 32 << 20, f"a peer without the password made the receiver hold {grown} bytes"
    wrong = RelayDealer(
        node.relay_mac,
        token="another-" + cluster.token,
        config=DealerConfig(ack_timeout_s=0.5, max_retries=1),
        link=LinkSecurity.MAC,
    )
    try:
        with pytest.raises(DeliveryTimeoutError):  # dropped without an answer
            wrong.submit_data(_meta(q), q.body).result(10)
    finally:
        wrong.close()
    assert node.ctl.status().staged == 1
    stop_everywhere(cluster, "t10")


# ------------------------------------------------------------------------------ abandon
def test_abandon_fails_unacknowledged_sends_at_once(cluster: Cluster, held: Held) -> None:
    """A stopped attempt does not wait for ACKs a frozen root (SIGSTOP: alive, connected,
    silent) will not send in time. Without `abandon` this stop lasted until the client gave up
    on the payloads (~9 s with this test's ACK timeouts; up to `stop_timeout_s` in general)."""
    c = cluster
    old = held.weights
    assert isinstance(old, dict)
    ps = payloads("ab1", 0, old, perturb(old, 31, fraction=0.5), op=Op.OVERWRITE)
    assert len(ps) >= 2
    prepare(c, held, "ab1", "overwrite", [0], open_apply=False)  # nothing may be applied
    t = transport(c, 0, max_in_flight=2, stop_timeout_s=30.0)
    root = c.nodes[0].proc
    os.kill(root.pid, signal.SIGSTOP)
    try:
        for p in ps[:2]:
            t.send("ab1", p)  # admitted: the window has room for two
        start = time.monotonic()
        t.abandon("ab1")
        summary = t.stop_and_wait("ab1")
        took = time.monotonic() - start
        with pytest.raises(TransportStoppedError):
            t.send("ab1", ps[-1])
    finally:
        os.kill(root.pid, signal.SIGCONT)
        t.close()
    assert took < 5.0, took
    assert summary.payloads_sent == 2
    assert summary.payloads_acknowledged == 0
    assert summary.errors, summary
    stop_everywhere(cluster, "ab1")


# ------------------------------------------------------------------------------ relay killed
def test_a_relay_killed_mid_stream_fails_flush_within_the_deadline(
    cluster: Cluster, held: Held
) -> None:
    """Last test of the module: it SIGKILLs node 1 of the shared cluster."""
    c = cluster  # tree from node 0: 0 -> (1, 2), 1 -> (3, 4), 2 -> (5, 6)
    old = held.weights
    assert isinstance(old, dict)
    a = perturb(old, 21, fraction=0.5)
    ps = payloads("k1", 0, old, a, op=Op.OVERWRITE)
    ps += [
        _renumber(p, len(ps) + i)
        for i, p in enumerate(payloads("k1", 0, a, perturb(a, 22), op=Op.OVERWRITE))
    ]
    prepare(c, held, "k1", "overwrite", [0])
    t = transport(c, 0)
    start = time.monotonic()
    try:
        for i, p in enumerate(ps):
            if i == 4:
                c.nodes[1].proc.kill()  # SIGKILL an inner relay mid-stream
            t.send("k1", p)
        summary = t.stop_and_wait("k1")
    finally:
        t.close()
    assert summary.payloads_acknowledged == len(ps)  # the root staged everything
    alive = [n for n in c.nodes if n.name != "node1"]
    flushed = c.each(lambda n: n.ctl.relay_flush("k1", {0: len(ps)}, timeout_s=6), alive)
    by = {n.name: f for n, f in zip(alive, flushed, strict=True)}
    assert all(by[n].ok for n in ("node2", "node5", "node6")), by
    assert not by["node0"].ok
    assert any(c.nodes[1].relay in e for e in by["node0"].errors), by["node0"].errors
    for orphan in ("node3", "node4"):  # below the dead relay: payloads missing
        assert not by[orphan].ok
        assert by[orphan].staged < len(ps)
    acks = c.each(lambda n: n.ctl.flush("k1", {0: len(ps)}, timeout_s=3), alive)
    assert not all(a.ok for a in acks)
    with pytest.raises(urllib3.exceptions.HTTPError):  # the node is gone
        c.nodes[1].ctl.status()
    assert time.monotonic() - start < 40


# ------------------------------------------------------------------------------ helpers
def stop_everywhere(c: Cluster, attempt: str) -> None:
    stops = c.each(lambda n: n.ctl.stop(attempt))
    assert all(s.drained for s in stops)
    c.each(lambda n: n.ctl.cleanup(attempt))
    assert not any(s.dirty for s in c.each(lambda n: n.ctl.status()))  # nothing was applied


def _meta(p: EncodedPayload, root: int | None = None) -> FrameMeta:
    return FrameMeta.of(p).model_copy(update={"root": root})


def _send_raw(client: RelayDealer, p: EncodedPayload, root: int | None = None) -> AckStatus:
    try:
        return client.submit_data(_meta(p, root), p.body).result(10)
    finally:
        if root is None:
            client.close()


def _renumber(p: EncodedPayload, i: int) -> EncodedPayload:
    from refit_sidecar.codec.decode import decode_payload
    from refit_sidecar.codec.encode import encode_payload
    from refit_sidecar.codec.wire import PayloadHeader

    d = decode_payload(p.body)
    header = PayloadHeader(1, d.header.attempt, d.header.producer, i, i)
    return encode_payload(header, d.items, mac_key=HARNESS_MAC_KEY)


REFUSED = 'kuberefit_relay_frames_dropped_total{reason="handshake'


def _handled(node: NodeProc) -> float:
    """Frames the relay answered or dropped (every kind, status and reason)."""
    frames = metric_sum(node, "kuberefit_relay_frames_total{")
    return frames + metric_sum(node, "kuberefit_relay_frames_dropped_total{")


def _metric(node: NodeProc, name: str) -> float:
    status, _ = node.ctl.raw("GET", "/metrics", token=True)
    assert status == 200
    resp = node.ctl.http.request(
        "GET", node.http + "/metrics", headers={"Authorization": f"Bearer {node.ctl.token}"}
    )
    for line in resp.data.decode().splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_producer_hop_window_follows_the_send_window_unless_set() -> None:
    """The producer's DEALER to its root defaults to 16 frames (as many as the send window's
    payloads); a plain `DealerConfig` keeps what it sets and takes that default otherwise."""
    assert RelayTransportConfig(root="tcp://r:1").client.window == 16
    timeouts = RelayTransportConfig(root="tcp://r:1", client=DealerConfig(ack_timeout_s=3))
    assert (timeouts.client.window, timeouts.client.ack_timeout_s) == (16, 3)
    assert RelayTransportConfig(root="tcp://r:1", client=DealerConfig(window=4)).client.window == 4
