"""`POST /v1/prewarm` on hostile metadata, through the real HTTP app over TCP: every meta the
codec cannot carry or the shared limits refuse is a 400 naming the reason, with the node's state
unchanged, and scratch is sized from the tensors the model has, never from a declared stranger."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
import torch

from refit_sidecar.receiver.node import ReceiverNode
from tests.sidecar.receiver.models import NODE_TOKEN, canonical, metas

TOKEN = NODE_TOKEN  # the `node` fixture's (conftest.py)
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MODEL_BYTES = 4096 * 4  # the model's largest tensor: 4096 float32


def valid() -> list[dict[str, Any]]:
    return [m.model_dump(mode="json") for m in metas(canonical(0))]


async def post(
    node: ReceiverNode, session: aiohttp.ClientSession, body: object
) -> tuple[int, dict[str, Any]]:
    url = f"http://127.0.0.1:{node.port}/v1/prewarm"
    async with session.post(url, json=body, headers=AUTH) as resp:
        return resp.status, await resp.json()


async def get(node: ReceiverNode, session: aiohttp.ClientSession, path: str) -> Any:
    url = f"http://127.0.0.1:{node.port}/v1{path}"
    async with session.get(url, headers=AUTH) as resp:
        assert resp.status == 200
        return await resp.json()


BAD_METAS = [
    ({"name": "t0.weight", "shape": [4096], "dtype": "complex64"}, "'complex64' is not carried"),
    (
        {"name": "t0.weight", "shape": [4096], "dtype": "float8_e4m3fnuz"},
        "'float8_e4m3fnuz' is not carried",
    ),
    ({"name": "t0.weight", "shape": [4096], "dtype": "qint8"}, "'qint8' is not carried"),
    ({"name": "t0.weight", "shape": [1 << 40], "dtype": "float32"}, "MAX_NUMEL"),
    ({"name": "t0.weight", "shape": [1 << 20, 1 << 20], "dtype": "bfloat16"}, "MAX_NUMEL"),
    ({"name": "t0.weight", "shape": [0, 1 << 62], "dtype": "bfloat16"}, "MAX_NUMEL"),
    ({"name": "t0.weight", "shape": [1] * 17, "dtype": "float32"}, "MAX_NDIM"),
    ({"name": "t" * 4097, "shape": [4], "dtype": "float32"}, "MAX_NAME_BYTES"),
    ({"name": "t0.weight", "shape": [-4096], "dtype": "float32"}, "greater than or equal to 0"),
]


async def test_bad_metas_are_400_with_the_reason_and_change_nothing(
    node: ReceiverNode, session: aiohttp.ClientSession
) -> None:
    status, first = await post(node, session, {"metas": valid()})
    assert status == 200
    before = await get(node, session, "/status")
    for bad, reason in BAD_METAS:
        status, body = await post(node, session, {"metas": [*valid()[1:], bad]})
        assert status == 400, (bad["dtype"], bad["shape"][:3], body)
        assert body["code"] == "bad_request"
        assert reason in body["error"], body["error"]
        assert await get(node, session, "/status") == before
        assert await get(node, session, "/prewarm") == first  # the classification is kept
    status, again = await post(node, session, {"metas": valid()})
    assert status == 200
    assert again == first


async def test_scratch_is_sized_from_the_tensors_the_model_has(
    node: ReceiverNode, session: aiohttp.ClientSession
) -> None:
    """Declared tensors the model does not have cost no scratch, however large (within the
    limits): a 1 TiB stranger used to be allocated (a 500), a 64 MiB one to be kept."""
    for numel in (1 << 24, 1 << 38):
        ghost = {"name": "ghost.weight", "shape": [numel], "dtype": "float32"}
        status, body = await post(node, session, {"metas": [*valid(), ghost]})
        assert status == 200, body
        (rank,) = body["ranks"]
        assert rank["scratch_bytes"] == MODEL_BYTES
        assert set(rank["unsupported"]) == {"ghost.weight"}
    status, body = await post(node, session, {"metas": valid()})
    assert status == 200
    assert body["ranks"][0]["scratch_bytes"] == MODEL_BYTES


async def test_scratch_the_device_cannot_hold_is_a_400(
    node: ReceiverNode, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor the model takes, declared larger than the device can allocate (simulated: no
    test allocates terabytes), is refused without changing the node's state."""
    status, first = await post(node, session, {"metas": valid()})
    assert status == 200
    real_empty = torch.empty

    def empty(*size: Any, **kw: Any) -> torch.Tensor:
        n = size[0] if size and isinstance(size[0], int) else 0
        if n > 1 << 30:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory (simulated)")
        return real_empty(*size, **kw)

    monkeypatch.setattr(torch, "empty", empty)  # what ApplyContext allocates scratch with
    huge = [*valid()[1:], {"name": "t0.weight", "shape": [1 << 36], "dtype": "float32"}]
    status, body = await post(node, session, {"metas": huge})
    monkeypatch.undo()
    assert status == 400, body
    assert body["code"] == "bad_request"
    assert "t0.weight: cannot allocate 274877906944 bytes of scratch" in body["error"]
    assert await get(node, session, "/prewarm") == first
    status, again = await post(node, session, {"metas": valid()})
    assert (status, again) == (200, first)
