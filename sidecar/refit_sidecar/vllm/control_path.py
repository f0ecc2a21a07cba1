"""The refit control path inside vLLM's OpenAI server, without its development mode.

vLLM serves `/collective_rpc`, `/pause` and `/resume` only in its development mode; those
routes run any worker method and `--api-key` does not cover them. Instead the rollout pod
starts vLLM with

    --middleware refit_sidecar.vllm.control_path.RefitControlMiddleware

and this ASGI middleware answers exactly four requests under `/kuberefit/v1/`, from a loopback
peer (the sidecar in the same pod) carrying the pod's bearer token (`$KUBEREFIT_TOKEN` or the
file `$KUBEREFIT_TOKEN_FILE`):

- `POST /kuberefit/v1/rpc {"method", "args", "timeout"}`: the engine's `collective_rpc` for the
  refit worker methods in `ALLOWED` only (prewarm, apply, dense load, fingerprint, audit);
- `POST /kuberefit/v1/pause?mode=wait|abort|keep` and `POST /kuberefit/v1/resume`: the
  engine's own pause and resume (the request gate);
- `POST /kuberefit/v1/status`: whether the engine is healthy, whether it runs the refit
  worker extension (`--worker-extension-cls`) and, in `refit_unavailable`, why this vLLM cannot
  refit (`api_check`), for the receiver's `/readyz`; no worker is called.

Everything else under the prefix is refused with the error body of every KubeRefit plane
(`{"error", "code", "details"}`); every other path goes to vLLM untouched. Without a configured
token the path refuses everything (fail closed). A vLLM that lacks an API the path relies on
(`api_check`) serves on: every refit operation answers 503 with the one line naming it.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

from refit_protocol.errors import ErrorBody
from refit_protocol.kit.auth import is_loopback_host, open_ring, ring_accepts_bearer
from refit_protocol.kit.loggers import get_logger
from refit_protocol.kit.tokens import TokenRing, as_ring
from refit_protocol.pod_contract import VLLM_MIDDLEWARE, VLLM_WORKER_EXTENSION
from refit_sidecar.vllm import api_check

log = get_logger("kuberefit.vllm")

PREFIX = "/kuberefit/v1"
#: What `vllm ... --middleware` takes.
MIDDLEWARE_QUALNAME = VLLM_MIDDLEWARE  # what injection appends as --middleware
#: The worker extension's methods the control path runs; nothing else reaches a worker.
ALLOWED = frozenset(
    {"refit_prewarm", "refit_apply", "refit_dense_load", "refit_fingerprint", "refit_audit"}
)
PAUSE_MODES = frozenset({"wait", "abort", "keep"})
#: Requests carry metadata and file paths, never tensors.
MAX_BODY_BYTES = 8 << 20

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class _RefusedError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def pod_tokens() -> TokenRing:
    """The pod's token(s), as every sidecar resolves them ($KUBEREFIT_TOKEN_FILE, followed
    across rotations, else $KUBEREFIT_TOKEN)."""
    return open_ring(None, None)


class RefitControlMiddleware:
    """ASGI middleware serving the refit control path (see the module docstring)."""

    def __init__(self, app: ASGIApp, token: str | TokenRing | None = None) -> None:
        self.app = app
        self.tokens = as_ring(token) if token is not None else pod_tokens()
        #: Why this vLLM cannot refit (an API the path relies on is missing), else None.
        self.unavailable = api_check.protocol_problem()
        if self.unavailable:
            log.warning("refit.unavailable", reason=self.unavailable)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or not str(scope.get("path", "")).startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        try:
            self._admit(scope)
            body = await _read_body(receive, _content_length(scope))
            status, answer = 200, await self._dispatch(scope, body)
        except _RefusedError as exc:
            status, answer = exc.status, ErrorBody.of(exc.status, str(exc)).to_json()
        except Exception as exc:  # the engine failed: say what, never a traceback
            status = 500
            answer = ErrorBody.of(500, f"{type(exc).__name__}: {exc}").to_json()
        await _respond(send, status, answer)

    def _admit(self, scope: Scope) -> None:
        client = scope.get("client") or ("", 0)
        if not is_loopback_host(str(client[0])):
            raise _RefusedError(403, "the refit control path answers loopback peers only")
        if not self.tokens:
            raise _RefusedError(
                503, "no token configured ($KUBEREFIT_TOKEN or $KUBEREFIT_TOKEN_FILE)"
            )
        if not ring_accepts_bearer(self.tokens, _header(scope, b"authorization")):
            raise _RefusedError(401, "missing or invalid bearer token")
        if scope.get("method") != "POST":
            raise _RefusedError(405, "only POST")

    async def _dispatch(self, scope: Scope, body: bytes) -> dict[str, Any]:
        path = str(scope["path"])[len(PREFIX) :]
        if path == "/rpc":
            method, args, timeout = _rpc_request(body)  # checked before the engine is touched
            engine = self._refit_engine(scope)
            results = await engine.collective_rpc(method=method, timeout=timeout, args=args)
            return {"results": [_plain(r) for r in results or []]}
        if path == "/pause":
            query = parse_qs(scope.get("query_string", b"").decode())
            mode = (query.get("mode") or ["wait"])[0]
            if mode not in PAUSE_MODES:
                raise _RefusedError(400, f"mode must be one of {sorted(PAUSE_MODES)}, not {mode!r}")
            await self._refit_engine(scope).pause_generation(mode=mode)
            return {"status": "paused"}
        if path == "/resume":
            await self._refit_engine(scope).resume_generation()
            return {"status": "resumed"}
        if path == "/status":
            unavailable = self._unavailable(_engine(scope))
            return await _status(scope) | {"refit_unavailable": unavailable or ""}
        raise _RefusedError(404, f"no such refit operation: {path or '/'}")

    def _unavailable(self, engine: Any) -> str | None:
        """Why this vLLM cannot refit: its class lacks an API, or the live engine does."""
        return self.unavailable or api_check.engine_problem(engine)

    def _refit_engine(self, scope: Scope) -> Any:
        """The engine client, or 503 naming the API this vLLM lacks (`api_check`)."""
        engine = _engine(scope)
        unavailable = self._unavailable(engine)
        if unavailable:
            raise _RefusedError(503, unavailable)
        return engine


def _engine(scope: Scope) -> Any:
    """vLLM's engine client (the server keeps it on the app's state)."""
    return scope["app"].state.engine_client


async def _status(scope: Scope) -> dict[str, Any]:
    """Engine health and the worker extension it runs (`--worker-extension-cls`)."""
    engine = _engine(scope)
    check_health = getattr(engine, "check_health", None)  # missing: refit_unavailable says so
    try:
        if callable(check_health):
            await check_health()
        healthy, error = True, ""
    except Exception as exc:  # a dead engine raises its error
        healthy, error = False, f"{type(exc).__name__}: {exc}".rstrip(": ")
    config = getattr(engine, "vllm_config", None)
    if config is None:
        config = getattr(scope["app"].state, "vllm_config", None)
    ext = getattr(getattr(config, "parallel_config", None), "worker_extension_cls", "") or ""
    name = ext if isinstance(ext, str) else f"{ext.__module__}.{ext.__qualname__}"
    return {
        "engine_healthy": healthy,
        "engine_error": error,
        "worker_extension": name,
        "refit_extension": _has_refit_methods(ext),
    }


def _has_refit_methods(ext: Any) -> bool | None:
    """The worker extension is ours or has every refit method (e.g. a user's class combining
    theirs with ours, vLLM taking only one); None when its module cannot be imported here to
    tell (the workers may still load it)."""
    if not ext:
        return False
    if isinstance(ext, str):
        if ext == VLLM_WORKER_EXTENSION:
            return True
        module, _, attr = ext.rpartition(".")
        try:
            ext = getattr(importlib.import_module(module), attr, None)
        except Exception:
            return None
    return ext is not None and all(callable(getattr(ext, m, None)) for m in ALLOWED)


def _rpc_request(body: bytes) -> tuple[str, tuple[Any, ...], float | None]:
    try:
        req = json.loads(body or b"{}")
    except ValueError as exc:
        raise _RefusedError(400, f"body is not JSON: {exc}") from exc
    if not isinstance(req, dict):
        raise _RefusedError(400, "body must be a JSON object")
    method, args, timeout = req.get("method"), req.get("args", []), req.get("timeout")
    if method not in ALLOWED:
        raise _RefusedError(403, f"method {method!r} is not a refit operation ({sorted(ALLOWED)})")
    if not isinstance(args, list):
        raise _RefusedError(400, "args must be a list")
    if timeout is not None and not isinstance(timeout, int | float):
        raise _RefusedError(400, "timeout must be a number")
    return str(method), tuple(args), None if timeout is None else float(timeout)


def _plain(result: Any) -> Any:
    return result if result is None or isinstance(result, dict | list) else str(result)


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers") or []:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return ""


def _content_length(scope: Scope) -> int | None:
    raw = _header(scope, b"content-length")
    if not raw:
        return None
    if not raw.isdigit():
        raise _RefusedError(400, "bad Content-Length")
    return int(raw)


async def _read_body(receive: Receive, declared: int | None) -> bytes:
    """The request body, refused before reading past MAX_BODY_BYTES."""
    if declared is not None and declared > MAX_BODY_BYTES:
        raise _RefusedError(413, f"body of {declared} bytes exceeds {MAX_BODY_BYTES}")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message.get("type") != "http.request":
            break
        chunk = bytes(message.get("body") or b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _RefusedError(413, f"body exceeds {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    return b"".join(chunks)


async def _respond(send: Send, status: int, answer: dict[str, Any]) -> None:
    body = json.dumps(answer).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
