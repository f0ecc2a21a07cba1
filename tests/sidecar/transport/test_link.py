"""Trainer and rollout "clusters" in separate network namespaces joined by a rate-limited veth
(tc tbf): one producer streams to a 3-node relay tree in the rollout namespace. Each payload
crosses the link once, so delivery takes about V_payload / link rate, and no longer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from refit_protocol.receiver_api import PrepareRequest
from tests.harness.netns import create_link
from tests.harness.receivers import REPO, start_cluster
from tests.sidecar.receiver.models import canonical, fingerprint, metas, read_applied
from tests.sidecar.transport.link_producer import link_target

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
        assert delivery >= 0.9 * ideal  # the link really limits (each payload crosses once)
        assert delivery <= 1.5 * ideal + 2.0  # and the tree adds little beyond it
    finally:
        if cluster is not None:
            cluster.stop_all()
        link.close()
