"""HttpMembership against a real receiver service over TCP: dense restore of a joining node from a
checkpoint directory (bits compared through integer views), liveness probes, and failures that
leave the node holding no known version. Also the safetensors header reader it relies on."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import torch
from pydantic import SecretStr
from safetensors.torch import save_file

from refit_operator.checkpoint_meta import CheckpointMetaError, read_metas
from refit_operator.http_membership import HttpMembership, NodeEndpoint
from refit_protocol.commit import CommitRecord
from refit_protocol.errors import EndpointError
from refit_sidecar.bits import bits_numpy
from refit_sidecar.receiver.appliers.inprocess import InProcessApplier
from refit_sidecar.receiver.config import ReceiverConfig
from refit_sidecar.receiver.node import ReceiverNode
from tests.sidecar.receiver.models import TinyModel, canonical, metas

TOKEN = "membership-token"


def _write_checkpoint(root: Path, version: int, state: dict[str, torch.Tensor]) -> Path:
    d = root / f"v{version}"
    d.mkdir(parents=True)
    save_file(state, str(d / "model.safetensors"))
    return d


@pytest.fixture
async def joining(tmp_path: Path) -> AsyncIterator[tuple[ReceiverNode, TinyModel]]:
    """A node restarted with unknown bits (v0 weights, but it does not know it)."""
    model = TinyModel(canonical(0))
    cfg = ReceiverConfig(node="n0", port=0, token=SecretStr(TOKEN), held_version=None)
    node = ReceiverNode(cfg, InProcessApplier(model))
    await node.start()
    try:
        yield node, model
    finally:
        await node.close()


def test_read_metas_matches_the_tensors_and_rejects_bad_files(tmp_path: Path) -> None:
    state = {**canonical(1, tensors=3), "ids": torch.arange(7, dtype=torch.int64)}
    state["half"] = torch.ones(2, 3, dtype=torch.bfloat16)
    d = _write_checkpoint(tmp_path, 1, state)
    got = {m.name: (m.shape, m.dtype) for m in read_metas(d)}
    assert got == {m.name: (m.shape, m.dtype) for m in metas(state)}
    with pytest.raises(CheckpointMetaError, match=r"no \*\.safetensors"):
        read_metas(tmp_path / "missing")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.safetensors").write_bytes(b"\xff" * 8 + b"{")
    with pytest.raises(CheckpointMetaError, match="too large"):
        read_metas(bad)
    (bad / "x.safetensors").write_bytes((5).to_bytes(8, "little") + b"{nope")
    with pytest.raises(CheckpointMetaError, match="not JSON"):
        read_metas(bad)


async def test_restore_loads_the_committed_checkpoint_bit_exactly(
    tmp_path: Path, joining: tuple[ReceiverNode, TinyModel]
) -> None:
    node, model = joining
    target = canonical(7)
    target["t0.weight"][3] = -0.0  # signed zero and NaN payload bits must arrive exactly
    target["t1.weight"].view(torch.int32)[5] = 0x7FC00123
    _write_checkpoint(tmp_path, 4, target)
    async with aiohttp.ClientSession() as session:
        m = HttpMembership(
            [NodeEndpoint("n0", f"http://127.0.0.1:{node.port}")],
            session,
            token=TOKEN,
            checkpoint_of=lambda v: str(tmp_path / f"v{v}"),
        )
        (r,) = await m.receivers()
        assert (await r.status()).held_version is None
        await m.restore(r, CommitRecord(4, "g-4"))
        status = await r.status()
        assert (status.held_version, status.prewarmed, status.gate_closed) == (4, True, False)
        assert not await m.confirmed_dead("n0")
    for name, want in target.items():
        got = model.p[name.replace(".", "_")].data
        assert (bits_numpy(got) == bits_numpy(want)).all(), name


async def test_failed_restore_is_typed_and_leaves_no_known_version(
    tmp_path: Path, joining: tuple[ReceiverNode, TinyModel]
) -> None:
    node, _ = joining
    _write_checkpoint(tmp_path, 1, canonical(1))  # metas readable, but v2's files are missing
    async with aiohttp.ClientSession() as session:
        m = HttpMembership(
            [NodeEndpoint("n0", f"http://127.0.0.1:{node.port}")],
            session,
            token=TOKEN,
            checkpoint_of=lambda v: str(tmp_path / f"v{v}"),
        )
        m._metas[2] = await m.metas(1)  # the coordinator has v2's metadata, the node lacks files
        (r,) = await m.receivers()
        with pytest.raises(EndpointError, match=r"dense restore from .* failed"):
            await m.restore(r, CommitRecord(2, "g-2"))
        assert (await r.status()).held_version is None


async def test_a_checkpoint_missing_tensors_is_refused_and_the_gate_stays_closed(
    tmp_path: Path, joining: tuple[ReceiverNode, TinyModel]
) -> None:
    """A restore that loads fewer tensors than expected (a wrong or partial checkpoint) must not
    claim the version; the node keeps its gate closed (unknown bits do not serve)."""
    node, _ = joining
    full = canonical(3)
    partial = {k: v for k, v in full.items() if k != "t5.weight"}
    _write_checkpoint(tmp_path, 3, partial)
    async with aiohttp.ClientSession() as session:
        m = HttpMembership(
            [NodeEndpoint("n0", f"http://127.0.0.1:{node.port}")],
            session,
            token=TOKEN,
            checkpoint_of=lambda v: str(tmp_path / f"v{v}"),
        )
        m._metas[3] = metas(full)  # the coordinator expects every tensor
        (r,) = await m.receivers()
        assert (await r.status()).gate_closed  # started without a known version
        with pytest.raises(EndpointError, match="1 expected tensors are not in the checkpoint"):
            await m.restore(r, CommitRecord(3, "g-3"))
        status = await r.status()
        assert (status.held_version, status.gate_closed) == (None, True)


async def test_liveness_refused_port_is_dead_and_absent_nodes_are_not_members() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    async with aiohttp.ClientSession() as session:
        m = HttpMembership(
            [NodeEndpoint("gone", f"http://127.0.0.1:{port}")],
            session,
            token=TOKEN,
            checkpoint_of=str,
            probe_timeout_s=1,
        )
        assert await m.receivers() == []
        assert await m.confirmed_dead("gone")
