"""The HTTP control plane in process, over real TCP: bearer auth, typed errors that leave state
intact, refusal to serve unauthenticated on a non-loopback address, and the asyncio client."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from pydantic import SecretStr

from refit_operator.receiver_client import ReceiverHttpClient, ReceiverHttpError
from refit_protocol.errors import EndpointError
from refit_protocol.receiver_api import (
    FlushRequest,
    GateRequest,
    ManifestEntry,
    PrepareRequest,
    PrewarmRequest,
)
from refit_sidecar.receiver.config import ReceiverConfig
from refit_sidecar.receiver.node import ReceiverNode
from tests.sidecar.receiver.models import NODE_TOKEN, RecordingApplier, TinyModel, canonical, metas

TOKEN = NODE_TOKEN  # the `node` fixture's (conftest.py)


def client(
    node: ReceiverNode, session: aiohttp.ClientSession, token: str | None = TOKEN
) -> ReceiverHttpClient:
    return ReceiverHttpClient("n0", f"http://127.0.0.1:{node.port}", token=token, session=session)


def test_refuses_to_serve_unauthenticated_beyond_loopback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBEREFIT_TOKEN", raising=False)
    applier = RecordingApplier(TinyModel(canonical(0)), str(tmp_path / "log"))
    with pytest.raises(ValueError, match="without a token"):
        ReceiverNode(ReceiverConfig(node="n", host="0.0.0.0"), applier)
    with pytest.raises(ValueError, match="without a token"):
        ReceiverNode(
            ReceiverConfig(node="n", relay={"bind": "tcp://10.1.2.3:5701"}),
            applier,  # type: ignore[arg-type]
        )
    with pytest.raises(ValueError, match="without a token"):  # the MAC-only ROUTER counts too
        ReceiverNode(
            ReceiverConfig(
                node="n",
                relay={"bind": "tcp://127.0.0.1:0", "mac_bind": "tcp://0.0.0.0:5702"},
            ),
            applier,  # type: ignore[arg-type]
        )
    ReceiverNode(ReceiverConfig(node="n", host="0.0.0.0", allow_insecure=True), applier)
    ReceiverNode(ReceiverConfig(node="n", host="0.0.0.0", token=SecretStr("t")), applier)
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    n = ReceiverNode(ReceiverConfig(node="n", host="0.0.0.0", token_file=token_file), applier)
    assert n.token == "from-file"


async def test_client_drives_an_attempt_and_errors_are_typed(
    node: ReceiverNode, session: aiohttp.ClientSession
) -> None:
    c = client(node, session)
    pre = await c.prewarm(PrewarmRequest(metas=metas(canonical(0))))
    assert pre.ranks[0].scratch_bytes > 0
    req = PrepareRequest(
        attempt="a1", from_version=0, target_version=1, mode="mixed", producers=[0]
    )
    assert (await c.prepare(req)).accepted
    with pytest.raises(ReceiverHttpError) as err:
        await c.open_apply("a1")  # gate still open
    assert err.value.status == 409
    await c.gate(GateRequest(attempt="a1", closed=True))
    await c.open_apply("a1")
    with pytest.raises(ReceiverHttpError) as err:
        await c.open_apply("zz")
    assert err.value.status == 409
    assert err.value.reason == "unknown_attempt"
    entry = ManifestEntry(
        attempt="a1",
        producer=0,
        payload_id=0,
        order=0,
        bucket="b",
        key="k",
        digest="00" * 16,
        size=1,
    )
    with pytest.raises(ReceiverHttpError) as err:
        await c.manifest(entry)
    assert err.value.status == 422  # no object storage on this node: refused, state intact
    assert "does not receive over s3" in str(err.value)
    assert (await c.status()).phase == "prepared"
    ack = await c.flush(FlushRequest(attempt="a1", expected={0: 1}, timeout_s=1))
    assert not ack.ok
    assert "0:0(absent)" in ack.errors[0]
    assert (await c.status()).phase == "failed"
    stop = await c.stop("a1")
    assert stop.drained
    assert not (await c.status()).dirty  # nothing was applied


async def test_bad_requests_leave_state_intact(
    node: ReceiverNode, session: aiohttp.ClientSession
) -> None:
    c = client(node, session)
    await c.prewarm(PrewarmRequest(metas=metas(canonical(0))))
    before = await c.status()
    base = f"http://127.0.0.1:{node.port}/v1"
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    for path, body in (
        ("/prepare", b"not json"),
        ("/prepare", b'{"attempt": 5}'),
        (
            "/prepare",
            b'{"attempt":"a","from_version":-1,"target_version":1,"mode":"x","producers":[]}',
        ),
        ("/gate", b'{"attempt": "a", "closed": "maybe", "extra": 1}'),
        (
            "/prewarm",
            b'{"metas": [{"name": "t0.weight", "shape": [4096], "dtype": "complex1024"}]}',
        ),
        ("/flush", b"[]"),
    ):
        async with session.post(base + path, data=body, headers=auth) as resp:
            assert resp.status == 400, (path, resp.status, await resp.text())
            data = await resp.json()
            assert data["code"] == "bad_request"
    assert await c.status() == before
    with pytest.raises(EndpointError):
        await client(node, session, token="nope").status()
    async with session.get(f"http://127.0.0.1:{node.port}/metrics") as resp:
        assert resp.status == 401
    async with session.get(f"http://127.0.0.1:{node.port}/metrics", headers=auth) as resp:
        assert resp.status == 200
        text = await resp.text()
    # A refused token is counted by route with code 401 (no separate counter).
    assert 'kuberefit_receiver_http_requests_total{code="401",path="/v1/status"} 1.0' in text
    assert 'kuberefit_receiver_http_requests_total{code="401",path="/metrics"} 1.0' in text
    assert "unauthorized_total" not in text
