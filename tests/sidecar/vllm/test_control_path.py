"""The refit control path's admission, on the middleware itself (the e2e tests drive it inside a
real vLLM server): loopback peers with the pod's token only, refit operations only, bounded
bodies, and every other path left to vLLM."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from refit_sidecar.vllm.control_path import MAX_BODY_BYTES, PREFIX, RefitControlMiddleware

TOKEN = "pod-token"


class RecordingInnerApp:
    """Stands in for vLLM's own routes: records what the middleware let through."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.paths.append(scope["path"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def _call(
    mw: RefitControlMiddleware,
    path: str,
    *,
    body: bytes = b"{}",
    token: str | None = TOKEN,
    peer: str = "127.0.0.1",
    method: str = "POST",
    query: bytes = b"",
) -> tuple[int, dict[str, Any]]:
    headers = [(b"content-length", str(len(body)).encode())]
    if token is not None:
        headers.append((b"authorization", f"Bearer {token}".encode()))
    scope = {
        "type": "http",
        "path": path,
        "method": method,
        "headers": headers,
        "client": (peer, 40000),
        "query_string": query,
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(mw(scope, receive, send))
    status = sent[0]["status"]
    payload = sent[1]["body"]
    return status, json.loads(payload) if payload else {}


def _rpc(method: str) -> bytes:
    return json.dumps({"method": method, "args": []}).encode()


@pytest.fixture
def inner() -> RecordingInnerApp:
    return RecordingInnerApp()


def test_refusals(inner: RecordingInnerApp) -> None:
    mw = RefitControlMiddleware(inner, token=TOKEN)
    rpc, fp = f"{PREFIX}/rpc", _rpc("refit_fingerprint")
    cases = [
        ({"path": rpc, "body": fp, "peer": "10.0.0.9"}, 403, "loopback"),
        ({"path": rpc, "body": fp, "token": None}, 401, "token"),
        ({"path": rpc, "body": fp, "token": "wrong"}, 401, "token"),
        ({"path": rpc, "body": _rpc("load_model")}, 403, "not a refit operation"),
        ({"path": rpc, "body": _rpc("__init__")}, 403, "not a refit operation"),
        ({"path": rpc, "body": b"[1]"}, 400, "JSON object"),
        ({"path": rpc, "body": b"{nope"}, 400, "not JSON"),
        ({"path": rpc, "method": "GET"}, 405, "only POST"),
        ({"path": f"{PREFIX}/pause", "query": b"mode=explode"}, 400, "mode must be"),
        ({"path": f"{PREFIX}/sleep"}, 404, "no such refit operation"),
        ({"path": rpc, "body": b" " * (MAX_BODY_BYTES + 1)}, 413, "exceeds"),
    ]
    for kwargs, status, words in cases:
        got, answer = _call(mw, **kwargs)  # type: ignore[arg-type]
        assert got == status, (kwargs.get("path"), answer)
        assert words in answer["error"], answer
    assert inner.paths == []  # nothing under the prefix ever reaches vLLM's own routes


def test_without_a_token_everything_is_refused(
    inner: RecordingInnerApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBEREFIT_TOKEN", raising=False)
    monkeypatch.delenv("KUBEREFIT_TOKEN_FILE", raising=False)
    mw = RefitControlMiddleware(inner)
    status, answer = _call(mw, f"{PREFIX}/resume", token="anything")
    assert status == 503
    assert "KUBEREFIT_TOKEN" in answer["error"]


def test_token_from_the_environment_and_other_paths_untouched(
    inner: RecordingInnerApp, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    monkeypatch.setenv("KUBEREFIT_TOKEN_FILE", str(path))
    mw = RefitControlMiddleware(inner)
    assert mw.tokens.accepted() == (TOKEN,)  # followed: a rotated file is taken live
    status, _ = _call(mw, "/v1/completions", token=None, peer="10.0.0.9")
    assert status == 204
    status, _ = _call(mw, "/collective_rpc", token=None)
    assert status == 204  # vLLM itself answers (404 without its development mode)
    assert inner.paths == ["/v1/completions", "/collective_rpc"]
