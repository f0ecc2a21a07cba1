"""Trainer and rollout "clusters" in separate network namespaces joined by a rate-limited veth
(tc tbf): one producer streams to a 3-node relay tree in the rollout namespace. Each payload
crosses the link once: delivery takes at least V_payload / link rate, and the link carries about
V_payload, not a multiple of it. (How little time the tree adds beyond the link is a figure for
`kuberefit bench refit --link-mbit`, not a bound a test on a loaded machine can hold.)

An on-path observer captures every frame on the link meanwhile (`tests.harness.wire_capture`):
it must find neither the token nor any payload bytes (CurveZMQ encrypts every relay link), and
replaying the captured producer stream, as is or altered, must get nothing staged and be counted
as a refused handshake."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from refit_protocol.receiver_api import PrepareRequest
from tests.harness.netns import Link, create_link
from tests.harness.operator_env import wait_for
from tests.harness.receivers import REPO, NodeProc, metric_sum, start_cluster
from tests.harness.wire_capture import client_stream, segments
from tests.sidecar.receiver.models import canonical, fingerprint, metas, read_applied
from tests.sidecar.transport.link_producer import link_payloads, link_target

RATE_MBIT = float(os.environ.get("KUBEREFIT_LINK_MBIT", "100"))  # other rates: measurements
TENSORS, NUMEL = 4, 2 << 20  # 4 payloads of 8 MiB, incompressible


def test_delivery_time_follows_payload_volume_over_link_rate(tmp_path: Path) -> None:
    link = create_link(RATE_MBIT)
    cluster = None
    try:

        def applier(i: int, log: Path) -> dict[str, object]:
            return {
                "kind": "factory",
                "factory": "tests.sidecar.receiver.models:recording_applier",
                "options": {"log_path": str(log), "tensors": TENSORS, "numel": NUMEL},
            }

        cluster = start_cluster(
            tmp_path,
            3,
            applier=applier,
            host=link.rollout_ip,
            http_bind="0.0.0.0",
            ctl_host=link.control_ip,
            wrap=lambda argv: link.wrap(link.rollout_ns, argv),
        )
        cluster.each(lambda n: n.ctl.prewarm(metas(canonical(0, TENSORS, NUMEL))))
        req = PrepareRequest(
            attempt="l1",
            from_version=0,
            target_version=1,
            mode="overwrite",
            producers=[0],
            relay_tree=cluster.relay_tree,
            relay_mac_tree=cluster.relay_mac_tree,  # inside the rollout side: MAC-only links
        )
        assert all(a.accepted for a in cluster.each(lambda n: n.ctl.prepare(req)))
        cluster.each(lambda n: n.ctl.gate("l1", True))
        cluster.each(lambda n: n.ctl.open_apply("l1"))

        arrived: list[float] = []

        def watch() -> None:  # when has every node staged every payload?
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if all(s.staged == TENSORS for s in cluster.each(lambda n: n.ctl.status())):
                    arrived.append(time.monotonic())
                    return
                time.sleep(0.01)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        env = dict(os.environ, PYTHONPATH=str(REPO))
        pcap = tmp_path / "link.frames"
        observer = subprocess.Popen(
            link.wrap(
                link.rollout_ns,
                [
                    sys.executable,
                    "-m",
                    "tests.harness.wire_capture",
                    "capture",
                    _dev(link),
                    str(pcap),
                ],
            ),
            env=env,
            cwd=REPO,
        )
        deadline = time.monotonic() + 30
        while not pcap.with_suffix(".ready").exists():
            assert observer.poll() is None, "capture exited"
            assert time.monotonic() < deadline, "capture did not start"
            time.sleep(0.05)
        argv = [
            sys.executable,
            "-m",
            "tests.sidecar.transport.link_producer",
            "--root",
            cluster.relay_tree[0],
            "--token",
            cluster.token,
            "--attempt",
            "l1",
            "--tensors",
            str(TENSORS),
            "--numel",
            str(NUMEL),
        ]
        proc = subprocess.run(
            link.wrap(link.trainer_ns, argv),
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=REPO,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        sent = json.loads(proc.stdout.strip().splitlines()[-1])
        assert sent["errors"] == []
        assert sent["acknowledged"] == TENSORS
        watcher.join(60)
        assert arrived, "payloads did not reach every node"
        relayed = cluster.each(lambda n: n.ctl.relay_flush("l1", {0: TENSORS}, timeout_s=60))
        assert all(r.ok for r in relayed), [r.errors for r in relayed]
        acks = cluster.each(lambda n: n.ctl.flush("l1", {0: TENSORS}, timeout_s=60))
        assert all(a.ok for a in acks), [a.errors for a in acks]
        target = fingerprint(link_target(1, TENSORS, NUMEL))
        for node in cluster.nodes:
            assert read_applied(node.applied_log)[-1]["fingerprint"] == target

        delivery = arrived[0] - sent["t_start"]
        ideal = sent["bytes"] / link.rate_bytes_s
        print(
            f"V_payload {sent['bytes'] / 2**20:.1f} MiB over {RATE_MBIT} Mbit/s: "
            f"ideal {ideal:.2f}s, producer acked {sent['t_acked'] - sent['t_start']:.2f}s, "
            f"delivered to 3 nodes {delivery:.2f}s ({delivery / ideal:.2f}x)"
        )
        assert delivery >= 0.9 * ideal  # the link really limits

        # -- what an on-path observer got ----------------------------------------------------
        observer.terminate()
        observer.wait(10)
        seen = pcap.read_bytes()
        assert len(seen) > sent["bytes"], "the capture missed the transition's traffic"
        # Every frame both ways, with headers and control traffic: well under two crossings.
        print(f"captured {len(seen) / sent['bytes']:.2f}x V_payload on the link")
        assert len(seen) < 1.5 * sent["bytes"], "payloads crossed the link more than once"
        assert cluster.token.encode() not in seen
        for p in link_payloads("l1", 1, TENSORS, NUMEL):
            body = p.body
            for at in range(len(body) // 8, len(body), len(body) // 8):
                assert body[at : at + 32] not in seen, "payload bytes crossed the link in clear"
        root = cluster.nodes[0]
        host, port = root.relay.removeprefix("tcp://").rsplit(":", 1)
        stream = client_stream(segments(pcap), host, int(port))[: 1 << 20]
        assert len(stream) > 1000
        refused_before, frames_before = _refused(root), _frames(root)
        for i, attack in enumerate(
            (stream, stream[:300] + bytes([stream[300] ^ 1]) + stream[301:])
        ):
            path = tmp_path / f"replay-{i}"
            path.write_bytes(attack)
            done = subprocess.run(
                link.wrap(
                    link.trainer_ns,
                    [
                        sys.executable,
                        "-m",
                        "tests.harness.wire_capture",
                        "replay",
                        host,
                        port,
                        str(path),
                    ],
                ),
                env=env,
                cwd=REPO,
                capture_output=True,
                timeout=60,
                check=False,
            )
            assert done.returncode == 0, done.stderr[-2000:]
            wait_for(f"replay {i} refused", lambda i=i: _refused(root) >= refused_before + i + 1)
        assert _frames(root) == frames_before  # not one frame of the replays was handled
        assert all(s.staged == TENSORS for s in cluster.each(lambda n: n.ctl.status()))
    finally:
        if cluster is not None:
            cluster.stop_all()
        link.close()


def _dev(link: Link) -> str:
    """The rollout namespace's end of the shaped veth (the device that has rollout_ip)."""
    out = subprocess.run(
        ["ip", "-n", link.rollout_ns, "-o", "-4", "addr", "show"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for line in out.splitlines():
        if f" {link.rollout_ip}/" in line:
            return line.split()[1]
    raise AssertionError(f"no device with {link.rollout_ip} in {link.rollout_ns}:\n{out}")


def _refused(node: NodeProc) -> float:
    """Connections refused at the CurveZMQ handshake (either reason)."""
    return metric_sum(node, 'kuberefit_relay_frames_dropped_total{reason="handshake')


def _frames(node: NodeProc) -> float:
    return metric_sum(node, "kuberefit_relay_frames_total{")
