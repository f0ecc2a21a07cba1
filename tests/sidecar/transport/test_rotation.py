"""Live token rotation across real receiver processes and a relay tree (issue 15).

Three receiver node processes each follow their own token file (one mounted Secret per pod,
updated at different moments as the kubelet does); the producer side follows its own. The token
is rotated from A to B while nothing restarts: deliveries keep working before, during and after
the grace period; the relays bind again with B's Curve keys; once twice the grace has passed A
is refused on every path (Curve handshake, frame token, HTTP bearer) and the refusals are counted.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from refit_protocol.keys import payload_mac_key
from refit_protocol.kit.tokens import FileTokenRing
from refit_protocol.receiver_api import PrepareRequest
from refit_sidecar.transport.errors import DeliveryTimeoutError
from refit_sidecar.transport.relay.config import DealerConfig
from refit_sidecar.transport.relay.dealer import RelayDealer
from refit_sidecar.transport.relay.frames import FrameMeta
from refit_sidecar.transport.relay.transport import RelayTransport, RelayTransportConfig
from tests.harness.operator_env import wait_for
from tests.harness.receivers import Cluster, metric_sum, start_cluster
from tests.sidecar.receiver.models import (
    canonical,
    fingerprint,
    metas,
    payloads,
    perturb,
    read_applied,
    recording_settings,
)

GRACE_S = 2.0
A, B = "rotation-token-a-5d1c0f", "rotation-token-b-93e7aa"
CLIENT = DealerConfig(ack_timeout_s=3.0, max_retries=2, unknown_attempt_timeout_s=5.0)
REFUSED = 'kuberefit_relay_frames_dropped_total{reason="handshake'


class Rotation:
    """The cluster, each pod's token file, and the version the nodes hold."""

    def __init__(self, workdir: Path) -> None:
        self.files = [workdir / f"token-{i}" for i in range(4)]  # 3 nodes + the producer pod
        for f in self.files:
            f.write_text(A + "\n")
        self.cluster: Cluster = start_cluster(
            workdir,
            3,
            applier=recording_settings,
            token=A,
            token_file=lambda i: self.files[i],
            token_rotation_grace_s=GRACE_S,
        )
        self.producer = FileTokenRing(self.files[3], grace_s=GRACE_S, check_every_s=0.1)
        self.version, self.weights = 0, canonical(0)
        self.pids = [n.proc.proc.pid for n in self.cluster.nodes]  # type: ignore[union-attr]
        self.cluster.each(lambda n: n.ctl.prewarm(metas(self.weights)))

    def rotate(self, nodes: list[int], text: str) -> None:
        for i in nodes:
            tmp = self.files[i].with_suffix(".new")
            tmp.write_text(text)
            tmp.replace(self.files[i])  # atomic, as the kubelet's symlink swap

    def refit(self, attempt: str, seed: int) -> None:
        """One attempt through the relay tree, sealed and sent as a producer would now."""
        c = self.cluster
        new = perturb(self.weights, seed)
        token = self.producer.sending()
        assert token is not None
        ps = payloads(attempt, 0, self.weights, new, mac_key=payload_mac_key(token))
        req = PrepareRequest(
            attempt=attempt,
            from_version=self.version,
            target_version=self.version + 1,
            mode="mixed",
            producers=[0],
            relay_tree=c.relay_tree,
        )
        answers = c.each(lambda n: n.ctl.prepare(req))
        assert all(a.accepted for a in answers), [a.reason for a in answers]
        c.each(lambda n: n.ctl.gate(attempt, True))
        c.each(lambda n: n.ctl.open_apply(attempt))
        t = RelayTransport(
            RelayTransportConfig(root=c.relay_tree[0], client=CLIENT), tokens=self.producer
        )
        try:
            for p in ps:
                t.send(attempt, p)
            summary = t.stop_and_wait(attempt)
        finally:
            t.close()
        assert summary.errors == (), summary
        expected = {0: len(ps)}
        relayed = c.each(lambda n: n.ctl.relay_flush(attempt, expected, timeout_s=20))
        assert all(r.ok for r in relayed), [r.errors for r in relayed]
        acks = c.each(lambda n: n.ctl.flush(attempt, expected, timeout_s=30))
        assert all(a.ok for a in acks), [a.errors for a in acks]
        for node in c.nodes:
            rows = [r for r in read_applied(node.applied_log) if r["attempt"] == attempt]
            assert len(rows) == len(ps), node.name
            assert rows[-1]["fingerprint"] == fingerprint(new), f"{node.name}: wrong bits"
        self.version += 1
        c.each(lambda n: n.ctl.commit(attempt, self.version))
        c.each(lambda n: n.ctl.cleanup(attempt))
        c.each(lambda n: n.ctl.gate(attempt, False))
        self.weights = new

    def use(self, token: str) -> None:
        for n in self.cluster.nodes:
            n.ctl.token = token


@pytest.fixture(scope="module")
def rotation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rotation]:
    r = Rotation(tmp_path_factory.mktemp("rotation"))
    try:
        yield r
    finally:
        r.cluster.stop_all()


def _status(r: Rotation, i: int, token: str) -> int:
    return r.cluster.nodes[i].ctl.raw("GET", "/v1/status", token=token)[0]


def test_the_token_rotates_live_without_a_restart(rotation: Rotation) -> None:
    r = rotation
    r.refit("rot-1", 31)  # everyone on A

    # The Secret changes: the producer's pod and node0 see B first, nodes 1-2 later.
    r.rotate([3, 0], f"{B}\n")
    wait_for("the producer saw B", lambda: B in r.producer.accepted())
    assert r.producer.sending() == A  # within the grace: still A, which every node accepts
    assert _status(r, 0, B) == 200  # node0 accepts B at once (read again on a miss)
    assert _status(r, 1, B) == 401  # node1's copy is not updated yet
    r.refit("rot-2", 32)  # mid-rotation: delivered as before

    r.rotate([1, 2], f"{B}\n")
    wait_for("every node accepts B", lambda: all(_status(r, i, B) == 200 for i in range(3)))
    assert all(_status(r, i, A) == 200 for i in (1, 2))  # and still A (for 2 x grace)
    wait_for("the producer sends B", lambda: r.producer.sending() == B, timeout=3 * GRACE_S)
    time.sleep(GRACE_S)  # every relay is past its grace: serving B's Curve keys
    r.use(B)
    r.refit("rot-3", 33)  # after the rotation: B end to end (relay keys, frame tokens, MACs)

    # Twice the grace after each pod saw B, A is refused everywhere.
    wait_for(
        "A refused",
        lambda: all(_status(r, i, A) == 401 for i in range(3)),
        timeout=4 * GRACE_S,
    )
    node = r.cluster.nodes[0]
    before = metric_sum(node, REFUSED)
    quick = DealerConfig(ack_timeout_s=0.5, max_retries=1)
    stale = RelayDealer(node.relay, token=A, config=quick)
    try:
        with pytest.raises(DeliveryTimeoutError):  # no handshake with A's keys any more
            stale.submit_data(FrameMeta(attempt="rot-x", producer=0), b"x" * 64).result(10)
    finally:
        stale.close()
    wait_for("the stale handshake counted", lambda: metric_sum(node, REFUSED) > before)
    r.refit("rot-4", 34)  # and B keeps working
    assert [n.proc.proc.pid for n in r.cluster.nodes] == r.pids  # type: ignore[union-attr]
    assert all(n.proc.proc.poll() is None for n in r.cluster.nodes)  # type: ignore[union-attr]
