"""The publisher against real producer services over real sockets: first export, sync and async
publishing, refusals (version, layout, files, token, resume rules), an unreachable sidecar and
the bound on chunk files in flight."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from refit_protocol.pod_contract import TRAINER_ALIVE_FILE, TRAINER_DONE_FILE
from refit_protocol.producer_api import (
    CandidateChunkAck,
    CandidateChunkRequest,
    CandidateStaged,
    CandidateStageRequest,
)
from refit_sidecar.bits import int_view
from refit_sidecar.codec import apply_item_, decode_payload
from refit_sidecar.trainer.chunk_files import write_chunk_file
from refit_sidecar.trainer.errors import (
    CandidateDroppedError,
    CandidateMismatchError,
    ChunkFileError,
    FingerprintMismatchError,
    SidecarUnreachableError,
    StagingError,
    StagingStateError,
    TransitionTimeoutError,
    VersionMismatchError,
)
from refit_sidecar.trainer.manifest import to_wire
from refit_sidecar.trainer.publisher import Publisher, PublisherConfig
from refit_sidecar.trainer.state_dict import StateDictSource
from refit_sidecar.trainer.synthetic import SyntheticTrainer
from tests.harness.operator_env import REPO, wait_for
from tests.harness.procs import ManagedProcess, free_port, http_ok
from tests.harness.s3 import S3Server
from tests.sidecar.trainer.sidecars import (
    TOKEN,
    ChangesOf,
    Sidecar,
    run_transition,
    serve_sidecars,
    shm_root,
)

CHUNK = 20_000  # ~2 tensors of 64x64 BF16 per chunk


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {
        f"model.layers.{i}.mlp.down_proj.weight": (torch.randn(64, 64, generator=g) * 0.05).to(
            torch.bfloat16
        )
        for i in range(10)
    }
    out["model.norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    return out


def replay(old: dict[str, torch.Tensor], sidecars: list[Sidecar], attempt: str) -> dict:  # type: ignore[type-arg]
    out = {n: t.clone() for n, t in old.items()}
    for s in sidecars:
        for payload in s.payloads(attempt):
            for item in decode_payload(payload.body).items:
                apply_item_(out[item.meta.name], item)
    return out


def assert_bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(int_view(a[n]), int_view(b[n])), n


def owned_names(s: Sidecar) -> set[str]:
    b = s.service.baseline
    names: set[str] = set()
    for name in b.metadata:
        try:
            b.stored_bits(name)
        except KeyError:
            continue
        names.add(name)
    return names


def inbox_files(s: Sidecar) -> list[Path]:
    """The chunk files in the inbox (not the trainer's liveness lock and marker)."""
    liveness = {TRAINER_ALIVE_FILE, TRAINER_DONE_FILE}
    files = s.inbox.iterdir() if s.inbox.exists() else []
    return sorted(p for p in files if p.name not in liveness)


async def publish_all(pubs: list[Publisher], version: int, state: dict, **kw: object) -> list:  # type: ignore[type-arg]
    """Every rank publishes at once (each to its own sidecar), as trainer ranks do."""
    return await asyncio.gather(
        *(asyncio.to_thread(p.publish, version, StateDictSource(state), **kw) for p in pubs)  # type: ignore[arg-type]
    )


async def test_first_export_then_sync_publish(tmp_path: Path, payload_s3: S3Server) -> None:
    v0 = weights()
    async with serve_sidecars(tmp_path, 2, payload_s3, chunk_bytes=CHUNK) as sidecars:
        pubs = [Publisher(s.publisher_config()) for s in sidecars]
        init = await asyncio.gather(
            *(asyncio.to_thread(p.initialize, StateDictSource(v0)) for p in pubs)
        )
        assert [r.producer for r in init] == [0, 1]
        assert all(r.chunks_total == init[0].chunks_total > 2 for r in init)
        assert sum(r.chunks_sent for r in init) == init[0].chunks_total
        # The first export is the baseline: ownership complete and disjoint, bits identical.
        owned = [owned_names(s) for s in sidecars]
        assert not owned[0] & owned[1]
        assert owned[0] | owned[1] == set(v0)
        for s, names in zip(sidecars, owned, strict=True):
            for n in names:
                stored = torch.from_numpy(s.service.baseline.stored_bits(n).copy())
                assert torch.equal(stored, int_view(v0[n]).reshape(-1)), n
            assert inbox_files(s) == []

        v1 = SyntheticTrainer(v0, relative_step=1e-3, seed=1).step()
        coordinator = asyncio.create_task(run_transition(sidecars, 1))
        results = await publish_all(pubs, 1, v1)
        attempt, reports = await coordinator
        assert all(r.committed and r.version == 1 for r in results)
        changed = sum(r.changed_elements for r in reports)
        assert 0 < changed < sum(r.total_elements for r in reports)
        assert_bits_equal(replay(v0, sidecars, attempt), v1)
        statuses = await asyncio.gather(*(asyncio.to_thread(p.status) for p in pubs))
        assert [st.committed_version for st in statuses] == [1, 1]
        assert all(inbox_files(s) == [] for s in sidecars)


async def test_a_planning_source_sends_changes_the_sidecar_applies_to_its_baseline(
    tmp_path: Path, payload_s3: S3Server
) -> None:
    """What a projecting trainer sends (the 2-D tensors as changes, the 1-D whole) is staged as
    whole tensors: the delta replayed on v0 is v1, twice in a row (the baseline advanced)."""
    trainer = SyntheticTrainer(weights(), relative_step=1e-3, seed=5)
    v0 = weights()
    v1, v2 = trainer.step(), trainer.step()
    async with serve_sidecars(tmp_path, 2, payload_s3, chunk_bytes=CHUNK) as sidecars:
        pubs = [Publisher(s.publisher_config()) for s in sidecars]
        await asyncio.gather(*(asyncio.to_thread(p.initialize, ChangesOf(v0, v0)) for p in pubs))
        old = v0
        for version, new in ((1, v1), (2, v2)):
            coordinator = asyncio.create_task(run_transition(sidecars, version))
            results = await asyncio.gather(
                *(asyncio.to_thread(p.publish, version, ChangesOf(old, new)) for p in pubs)
            )
            attempt, _ = await coordinator
            assert_bits_equal(replay(old, sidecars, attempt), new)
            assert sum(r.changed_tensors for r in results) == 10  # the 64x64 matrices
            assert all(inbox_files(s) == [] for s in sidecars)
            old = new


async def test_async_publish_returns_once_staged(tmp_path: Path, payload_s3: S3Server) -> None:
    trainer = SyntheticTrainer(weights(), relative_step=1e-3, seed=2)
    v0 = weights()
    async with serve_sidecars(tmp_path, 1, payload_s3, chunk_bytes=CHUNK) as sidecars:
        pub = Publisher(sidecars[0].publisher_config())
        await asyncio.to_thread(pub.initialize, StateDictSource(v0))
        v1, v2 = trainer.step(), trainer.step()
        r1 = await asyncio.to_thread(pub.publish, 1, StateDictSource(v1), wait=False)
        assert not r1.committed
        assert sidecars[0].service.candidate_version == 1
        # v2 is exported while v1's transition has not run: it waits for v1's commit.
        second = asyncio.create_task(
            asyncio.to_thread(pub.publish, 2, StateDictSource(v2), wait=False)
        )
        await asyncio.sleep(0.5)
        assert not second.done()
        attempt1, _ = await run_transition(sidecars, 1)
        r2 = await asyncio.wait_for(second, 30)
        assert r2.version == 2
        assert not r2.committed
        attempt2, _ = await run_transition(sidecars, 2)
        assert_bits_equal(replay(replay(v0, sidecars, attempt1), sidecars, attempt2), v2)


async def test_wrong_versions_are_refused(tmp_path: Path, payload_s3: S3Server) -> None:
    v0 = weights()
    async with serve_sidecars(tmp_path, 1, payload_s3, chunk_bytes=CHUNK) as sidecars:
        pub = Publisher(sidecars[0].publisher_config())
        with pytest.raises(StagingStateError, match="initialize"):
            await asyncio.to_thread(pub.publish, 1, StateDictSource(v0))
        with pytest.raises(VersionMismatchError, match="committed version v0"):
            await asyncio.to_thread(pub.initialize, StateDictSource(v0), version=1)
        await asyncio.to_thread(pub.initialize, StateDictSource(v0))
        with pytest.raises(VersionMismatchError, match=r"not the next version.*next is v1"):
            await asyncio.to_thread(pub.publish, 3, StateDictSource(v0))
        with pytest.raises(VersionMismatchError, match="already committed"):
            await asyncio.to_thread(pub.publish, 0, StateDictSource(v0))
        # The sidecar enforces the rule itself (a client that skips its own check).
        with pytest.raises(VersionMismatchError, match="v5 is not the next"):
            await asyncio.to_thread(
                pub._call,
                "POST",
                "/candidate",
                CandidateStageRequest(version=5, manifest=[], chunks=[]),
                CandidateStaged,
            )
        with pytest.raises(ChunkFileError, match="unsafe"):
            await asyncio.to_thread(
                pub._call,
                "POST",
                "/candidate/chunk",
                CandidateChunkRequest(version=1, index=0, file="../../etc/passwd", names=["x"]),
                CandidateChunkAck,
            )
        assert sidecars[0].service.candidate_version is None


@pytest.mark.parametrize("producers", [1, 2])
@pytest.mark.parametrize("change", ["shape", "dtype", "missing", "extra"])
async def test_layout_mismatch_is_refused(
    tmp_path: Path, payload_s3: S3Server, producers: int, change: str
) -> None:
    v0 = weights()
    bad = dict(v0)
    name = "model.layers.3.mlp.down_proj.weight"
    if change == "shape":
        bad[name] = v0[name].reshape(32, 128)
    elif change == "dtype":
        bad[name] = v0[name].float()
    elif change == "missing":
        del bad[name]
    else:
        bad["model.layers.3.mlp.extra.weight"] = v0[name].clone()
    async with serve_sidecars(tmp_path, producers, payload_s3, chunk_bytes=CHUNK) as sidecars:
        pubs = [Publisher(s.publisher_config()) for s in sidecars]
        await asyncio.gather(*(asyncio.to_thread(p.initialize, StateDictSource(v0)) for p in pubs))
        outcomes = await asyncio.gather(
            *(asyncio.to_thread(p.publish, 1, StateDictSource(bad)) for p in pubs),
            return_exceptions=True,
        )
        for exc in outcomes:
            assert isinstance(exc, CandidateMismatchError), exc
        text = " ".join(str(e) for e in outcomes)
        expect = {
            "shape": "[32, 128] bfloat16, the baseline has [64, 64] bfloat16",
            "dtype": "[64, 64] float32, the baseline has [64, 64] bfloat16",
            "missing": f"missing ({name}",
            "extra": "not in the baseline (model.layers.3.mlp.extra.weight",
        }[change]
        assert expect in text
        for s in sidecars:
            assert s.service.candidate_version is None
            assert inbox_files(s) == []
            assert s.service._staging is not None
            assert s.service._staging.chunks(1) == {}
        # Nothing stuck: the right export of v1 still goes through.
        v1 = SyntheticTrainer(v0, relative_step=1e-3, seed=3).step()
        coordinator = asyncio.create_task(run_transition(sidecars, 1))
        await publish_all(pubs, 1, v1)
        attempt, _ = await coordinator
        assert_bits_equal(replay(v0, sidecars, attempt), v1)


async def test_unreachable_sidecar(tmp_path: Path) -> None:
    pub = Publisher(PublisherConfig(url=f"http://127.0.0.1:{free_port()}", inbox=tmp_path))
    t0 = time.monotonic()
    with pytest.raises(SidecarUnreachableError, match="unreachable"):
        await asyncio.to_thread(pub.publish, 1, StateDictSource(weights()))
    assert time.monotonic() - t0 < 10


async def test_wrong_token(tmp_path: Path, payload_s3: S3Server) -> None:
    async with serve_sidecars(tmp_path, 1, payload_s3, chunk_bytes=CHUNK) as sidecars:
        pub = Publisher(sidecars[0].publisher_config(token="not-the-token"))
        with pytest.raises(StagingError, match="bearer token"):
            await asyncio.to_thread(pub.initialize, StateDictSource(weights()))


@pytest.mark.parametrize("limit", [1, 3])
async def test_chunk_files_in_flight_are_bounded(
    tmp_path: Path, payload_s3: S3Server, limit: int
) -> None:
    v0 = weights()
    async with serve_sidecars(
        tmp_path, 1, payload_s3, chunk_bytes=9000
    ) as sidecars:  # a chunk per tensor
        side = sidecars[0]
        original = side.service.ingest_chunk

        stalled = [True]

        def slow_ingest(req: CandidateChunkRequest) -> CandidateChunkAck:
            if stalled[0]:  # a sidecar stalled at its first chunk: the trainer fills its window
                stalled[0] = False
                wait_for(f"{limit} chunk files handed over", lambda: peak >= limit, timeout=60)
            time.sleep(0.05)  # then a slow one: the trainer must not run ahead of it
            return original(req)

        side.service.ingest_chunk = slow_ingest  # type: ignore[method-assign]
        peak = 0
        stop = threading.Event()

        def watch() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, len(inbox_files(side)))
                time.sleep(0.001)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            pub = Publisher(side.publisher_config(max_in_flight=limit))
            result = await asyncio.to_thread(pub.initialize, StateDictSource(v0))
        finally:
            stop.set()
            watcher.join()
        assert result.chunks_sent == result.chunks_total == len(v0) - 1  # norm joins the last
        assert result.max_in_flight_seen == limit
        assert 1 <= peak <= limit
        assert inbox_files(side) == []


async def test_fresh_start_must_match_the_rollout_checkpoint(
    tmp_path: Path, payload_s3: S3Server
) -> None:
    v0 = weights()
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    save_file(v0, str(good / "model.safetensors"))
    flipped = dict(v0)
    name = "model.layers.7.mlp.down_proj.weight"
    bits = int_view(v0[name]).clone()
    bits.view(-1)[5] ^= 1
    flipped[name] = bits.view(torch.bfloat16)
    save_file(flipped, str(bad / "model.safetensors"))

    async with serve_sidecars(
        tmp_path / "a", 2, payload_s3, chunk_bytes=CHUNK, reference=good
    ) as sidecars:
        pubs = [Publisher(s.publisher_config()) for s in sidecars]
        results = await asyncio.gather(
            *(asyncio.to_thread(p.initialize, StateDictSource(v0)) for p in pubs)
        )
        assert all(r.fingerprint for r in results)
        assert all(s.service.baseline_ready for s in sidecars)

    async with serve_sidecars(
        tmp_path / "b", 2, payload_s3, chunk_bytes=CHUNK, reference=bad
    ) as sidecars:
        pubs = [Publisher(s.publisher_config()) for s in sidecars]
        outcomes = await asyncio.gather(
            *(asyncio.to_thread(p.initialize, StateDictSource(v0)) for p in pubs),
            return_exceptions=True,
        )
        refused = [o for o in outcomes if isinstance(o, FingerprintMismatchError)]
        assert len(refused) == 1  # only the owner of the flipped tensor can see it
        assert name in str(refused[0])
        assert "same HF weights" in str(refused[0])
        owner = outcomes.index(refused[0])
        assert not sidecars[owner].service.baseline_ready
        assert inbox_files(sidecars[owner]) == []


async def test_trainer_restart_against_a_surviving_sidecar(
    tmp_path: Path, payload_s3: S3Server
) -> None:
    v0 = weights()
    trainer = SyntheticTrainer(v0, relative_step=1e-3, seed=4)
    v1 = trainer.step()
    async with serve_sidecars(tmp_path, 1, payload_s3, chunk_bytes=CHUNK) as sidecars:
        pub = Publisher(sidecars[0].publisher_config())
        first = await asyncio.to_thread(pub.initialize, StateDictSource(v0))
        coordinator = asyncio.create_task(run_transition(sidecars, 1))
        await asyncio.to_thread(pub.publish, 1, StateDictSource(v1))
        await coordinator
        # The trainer restarts from its checkpoint of v1: a new publisher, the same sidecar.
        again = Publisher(sidecars[0].publisher_config())
        with pytest.raises(VersionMismatchError, match="committed version v1"):
            await asyncio.to_thread(again.initialize, StateDictSource(v0), version=0)
        with pytest.raises(FingerprintMismatchError, match="baseline of v1"):
            await asyncio.to_thread(again.initialize, StateDictSource(v0), version=1)
        resumed = await asyncio.to_thread(again.initialize, StateDictSource(v1), version=1)
        assert resumed.fingerprint != first.fingerprint
        v2 = trainer.step()
        coordinator = asyncio.create_task(run_transition(sidecars, 2))
        await asyncio.to_thread(again.publish, 2, StateDictSource(v2))
        attempt, _ = await coordinator
        assert_bits_equal(replay(v1, sidecars, attempt), v2)


async def test_incomplete_or_foreign_chunks_are_refused(
    tmp_path: Path, payload_s3: S3Server
) -> None:
    v0 = weights()
    async with serve_sidecars(tmp_path, 2, payload_s3, chunk_bytes=CHUNK) as sidecars:
        pubs = [Publisher(s.publisher_config()) for s in sidecars]
        await asyncio.gather(*(asyncio.to_thread(p.initialize, StateDictSource(v0)) for p in pubs))
        side, pub = sidecars[0], pubs[0]
        manifest = to_wire(list(side.service.baseline.metadata.values()))
        with pytest.raises(CandidateMismatchError, match="missing"):
            await asyncio.to_thread(
                pub._call,
                "POST",
                "/candidate",
                CandidateStageRequest(version=1, manifest=manifest, chunks=[]),
                CandidateStaged,
            )
        names = list(v0)[2:4]  # chunk 1: producer 1's
        write_chunk_file(side.inbox, "c1.safetensors", [(n, v0[n]) for n in names])
        with pytest.raises(CandidateMismatchError, match="belongs to producer 1"):
            await asyncio.to_thread(
                pub._call,
                "POST",
                "/candidate/chunk",
                CandidateChunkRequest(version=1, index=1, file="c1.safetensors", names=names),
                CandidateChunkAck,
            )
        assert side.service.candidate_version is None


async def test_a_wait_that_outlasts_its_deadline_says_so(
    tmp_path: Path, payload_s3: S3Server
) -> None:
    """publish(wait=True) with no coordinator running: TransitionTimeoutError naming what it
    waited for; the staged candidate stays for the coordinator to pick up."""
    v0 = weights()
    async with serve_sidecars(tmp_path, 1, payload_s3, chunk_bytes=CHUNK) as sidecars:
        pub = Publisher(sidecars[0].publisher_config(commit_timeout_s=1, poll_interval_s=0.05))
        await asyncio.to_thread(pub.initialize, StateDictSource(v0))
        v1 = SyntheticTrainer(v0, relative_step=1e-3, seed=5).step()
        t0 = time.monotonic()
        with pytest.raises(TransitionTimeoutError, match="is the coordinator running"):
            await asyncio.to_thread(pub.publish, 1, StateDictSource(v1))
        assert 1 <= time.monotonic() - t0 < 30
        assert sidecars[0].service.candidate_version == 1


def _producer_process(tmp_path: Path, port: int, inbox: Path) -> ManagedProcess:
    config = {
        "host": "127.0.0.1",
        "port": port,
        "token": TOKEN,
        "baseline": {"directory": str(tmp_path / "baseline"), "export_chunk_bytes": CHUNK},
        "staging": {"inbox": str(inbox), "candidate_dir": str(tmp_path / "candidates")},
        "transport": {"root": "", "stop_timeout_s": 5.0},
    }
    path = tmp_path / "producer.json"
    path.write_text(json.dumps(config))
    argv = [str(REPO / ".venv/bin/kuberefit"), "producer", "serve", "--config", str(path)]
    return ManagedProcess("producer", argv, tmp_path / "producer.log", cwd=REPO)


async def test_a_sidecar_restart_during_the_wait_drops_the_candidate_and_says_so(
    tmp_path: Path,
) -> None:
    """The real `kuberefit producer serve` process is killed while the trainer waits for v1 to
    commit and started again: the wait rides out the outage, then raises CandidateDroppedError
    (the new process does not hold v1), which tells the trainer to publish v1 again."""
    port = free_port()
    inbox = shm_root() / "restart"
    inbox.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    proc = _producer_process(tmp_path, port, inbox)
    try:
        proc.start(lambda: http_ok(url + "/healthz"), timeout=60)
        pub = Publisher(
            PublisherConfig(
                url=url, inbox=inbox, token=TOKEN, commit_timeout_s=120, poll_interval_s=0.1
            )
        )
        v0 = weights()
        await asyncio.to_thread(pub.initialize, StateDictSource(v0))
        v1 = SyntheticTrainer(v0, relative_step=1e-3, seed=6).step()
        waiting = asyncio.create_task(asyncio.to_thread(pub.publish, 1, StateDictSource(v1)))
        await asyncio.to_thread(
            wait_for, "v1 staged", lambda: pub.status().candidate_version == 1, timeout=60
        )
        assert not waiting.done()
        proc.kill()
        proc.proc.wait(10)  # type: ignore[union-attr]
        await asyncio.sleep(0.5)  # the publisher now meets a refused connection, and waits on
        assert not waiting.done()
        proc.start(lambda: http_ok(url + "/healthz"), timeout=60)
        with pytest.raises(CandidateDroppedError, match="publish v1 again"):
            await asyncio.wait_for(waiting, 60)
    finally:
        proc.stop(grace=5)
        shutil.rmtree(inbox.parent, ignore_errors=True)  # the private shm_root() too
