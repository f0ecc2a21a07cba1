"""The vLLM applier: a vLLM OpenAI server in the same pod, started with
`--worker-extension-cls refit_sidecar.vllm.worker_extension.RefitWorkerExtension`.

Every call goes to the refit control path the server loads with `--middleware
refit_sidecar.vllm.control_path.RefitControlMiddleware` (loopback peer and the pod's token;
never vLLM's development mode): `POST /kuberefit/v1/rpc` runs one of the worker extension's refit
methods with JSON arguments (tensors cannot travel there): prewarm sends canonical metadata as
lists; each payload, decoded once by the receiver, is written to a decoded payload file on the
shared-memory volume (`codec.decoded_file`); each group of staged payloads is applied with one
`refit_apply(paths, check_samples)` on every worker, which only reads them (each in its own
pod: a server spanning several hosts has a receiver per host staging the same file at the same
path, `vllm_host`). The request
gate is the engine's own pause (`/kuberefit/v1/pause?mode=wait`: in-flight requests finish
first) and resume.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import urllib3

from refit_protocol.kit.auth import bearer_header
from refit_protocol.kit.config_files import ensure_directory
from refit_protocol.kit.tokens import TokenRing, as_ring
from refit_protocol.pod_contract import VLLM_MIDDLEWARE, VLLM_WORKER_EXTENSION
from refit_protocol.receiver_api import RankPrewarm
from refit_sidecar.apply.checkpoint import CheckpointError
from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.codec.wire import DecodedPayload
from refit_sidecar.receiver.appliers.base import ApplyReport, StagedPayload
from refit_sidecar.receiver.appliers.payload_files import discard_file, stage_file
from refit_sidecar.receiver.config import ApplierConfig
from refit_sidecar.vllm.control_path import PREFIX as CONTROL_PREFIX
from refit_sidecar.vllm.rpc_args import metas_to_wire


class VllmRpcError(RuntimeError):
    """The vLLM server refused or failed a call; the message carries its answer."""


class VllmHttpApplier:
    def __init__(self, config: ApplierConfig) -> None:
        self.config = config
        self.base = config.vllm_url.rstrip("/")
        self.shm_dir = config.shm_dir
        ensure_directory(self.shm_dir, "applier.shm_dir")
        self._http = urllib3.PoolManager(maxsize=4, retries=False)
        token = config.control_token.get_secret_value() if config.control_token else None
        #: The control path's token; `ReceiverNode` sets its own ring (followed across rotations).
        self.tokens: TokenRing = as_ring(token)

    # -- HTTP --------------------------------------------------------------------------------------
    def _post(self, path: str, body: dict[str, Any] | None = None, **query: str) -> Any:
        url = self.base + path
        if query:
            url += "?" + "&".join(f"{k}={v}" for k, v in query.items())
        resp = self._http.request(
            "POST",
            url,
            body=json.dumps(body or {}).encode(),
            headers={"Content-Type": "application/json", **bearer_header(self.tokens.newest())},
            timeout=urllib3.Timeout(total=self.config.rpc_timeout_s),
        )
        if resp.status != 200:
            raise VllmRpcError(f"{path}: HTTP {resp.status}: {resp.data[:500]!r}")
        return json.loads(resp.data) if resp.data else None

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        out = self._post(
            f"{CONTROL_PREFIX}/rpc",
            {"method": method, "args": list(args), "timeout": self.config.rpc_timeout_s},
        )
        results = out.get("results") if isinstance(out, dict) else None
        if not isinstance(results, list):
            raise VllmRpcError(f"{method}: unexpected answer {out!r}")
        return results

    # -- readiness ---------------------------------------------------------------------------------
    def readiness_checks(self, timeout_s: float = 2.0) -> list[tuple[str, bool, str]]:
        """`vllm`: the server answers and its engine is healthy; `refit_extension`: it runs
        the refit control path (`--middleware`) and worker extension (`--worker-extension-cls`).
        Each failed check's detail names what is missing and the server's URL."""
        where = f"vLLM at {self.base}"
        extension = f"start vLLM with --middleware {VLLM_MIDDLEWARE}"
        workers = f"--worker-extension-cls {VLLM_WORKER_EXTENSION}"
        try:
            resp = self._http.request(
                "POST",
                self.base + f"{CONTROL_PREFIX}/status",
                body=b"{}",
                headers={"Content-Type": "application/json", **bearer_header(self.tokens.newest())},
                timeout=urllib3.Timeout(total=timeout_s),
            )
        except urllib3.exceptions.HTTPError as exc:
            why = _connection_reason(exc)
            return [
                ("vllm", False, f"{where} unreachable: {why}"),
                ("refit_extension", False, f"unknown: {where} does not answer"),
            ]
        try:
            body = json.loads(resp.data) if resp.data else {}
        except ValueError:
            body = {}
        body = body if isinstance(body, dict) else {}
        if resp.status == 200:
            healthy = bool(body.get("engine_healthy"))
            engine = "engine healthy" if healthy else f"engine failed: {body.get('engine_error')}"
            name = str(body.get("worker_extension") or "")
            if body.get("refit_unavailable"):
                ext = (False, f"{where}: {body['refit_unavailable']}")
            elif body.get("refit_extension"):
                ext = (True, f"refit control path and worker extension {name} loaded")
            elif name and body.get("refit_extension", False) is None:
                ext = (True, f"worker extension {name}: the server cannot import it to check")
            elif name:
                ext = (False, f"{where} runs worker extension {name}, not the refit one: {workers}")
            else:
                ext = (False, f"{where} runs no worker extension: start it with {workers}")
            return [("vllm", healthy, f"{where}: {engine}"), ("refit_extension", *ext)]
        reachable = ("vllm", True, f"{where} answers")
        ours = "code" in body or ("error" in body and "detail" not in body)  # not FastAPI's
        if resp.status == 404 and not ours:
            missing = f"{where} has no refit control path: {extension} and {workers}"
        elif resp.status == 404:
            missing = f"{where} runs an older refit control path (no /status): restart it"
        elif resp.status in (401, 403):
            missing = (
                f"{where} refused this receiver's token on the refit control path (HTTP "
                f"{resp.status}: {body.get('error', '')}): give vLLM the pod's token "
                "($KUBEREFIT_TOKEN_FILE)"
            )
        else:
            missing = f"{where} refit control path: HTTP {resp.status}: {body.get('error', body)}"
        return [reachable, ("refit_extension", False, missing)]

    # -- Applier -----------------------------------------------------------------------------------
    def prewarm(self, metas: Mapping[str, TensorMeta]) -> list[RankPrewarm]:
        ranks = []
        for i, r in enumerate(self._rpc("refit_prewarm", metas_to_wire(metas.values()))):
            if not isinstance(r, dict):
                raise VllmRpcError(f"refit_prewarm: rank {i} answered {r!r}")
            ranks.append(
                RankPrewarm(
                    rank=int(r.get("rank", i)),
                    host=str(r.get("host", "")),
                    skipped=list(r.get("skipped", [])),
                    xor_incompatible=dict(r.get("xor_incompatible", {})),
                    unsupported=dict(r.get("unsupported", {})),
                    scratch_bytes=int(r.get("scratch_bytes", 0)),
                )
            )
        return ranks

    def stage(self, decoded: DecodedPayload) -> StagedPayload:
        return stage_file(self.shm_dir, decoded)

    def apply(self, batch: Sequence[StagedPayload], check_samples: int) -> ApplyReport:
        """The whole group in one call (`refit_apply` takes the paths in application order):
        the call path, not the apply, was half the time per payload."""
        t0 = time.perf_counter()
        report = ApplyReport()
        paths = [str(staged.path) for staged in batch if staged.path is not None]
        if len(paths) != len(batch):
            raise VllmRpcError("refit_apply: a payload of the group was not staged as a file")
        if paths:
            results = self._rpc("refit_apply", paths, check_samples, self.config.stage_wait)
            for r in results:
                if not isinstance(r, dict):
                    raise VllmRpcError(f"refit_apply: a rank answered {r!r}")
                report.per_rank.append(r)
            first = results[0] if results else {}
            report.payloads += len(paths)
            report.items += int(first.get("items", 0))
            report.values += int(first.get("values", 0))
            report.checks += sum(int(r.get("checks", 0)) for r in results)
        for staged in batch:
            self.discard(staged)
        report.seconds = time.perf_counter() - t0
        return report

    def discard(self, staged: StagedPayload) -> None:
        discard_file(staged)

    def sync(self) -> None:
        """refit_apply synchronizes the device before it returns: nothing left to wait for."""

    def gate(self, closed: bool) -> None:
        if closed:
            self._post(f"{CONTROL_PREFIX}/pause", mode=self.config.pause_mode)
        else:
            self._post(f"{CONTROL_PREFIX}/resume")

    def restore(self, source: str) -> set[str]:
        """The workers read the checkpoint themselves (`refit_dense_load`, vLLM's loader);
        a name counts as loaded only if every rank loaded it."""
        with _checkpoint_errors():
            per_rank = [set(names) for names in self._rpc("refit_dense_load", source)]
        return set.intersection(*per_rank) if per_rank else set()

    def audit(self, source: str) -> list[dict[str, Any]]:
        """Every rank's audit against the checkpoint directory `source` (the workers read it)."""
        with _checkpoint_errors():
            return [dict(r) for r in self._rpc("refit_audit", source)]

    def close(self) -> None:
        self._http.clear()


@contextlib.contextmanager
def _checkpoint_errors() -> Iterator[None]:
    """A worker's `CheckpointError` (its reader refused a file) reaches us flattened into the
    RPC's error text by vLLM: raise it as one again, so the node answers 422, not 409."""
    try:
        yield
    except VllmRpcError as exc:
        m = re.search(r"CheckpointError: ([^\"']+)", str(exc))
        if m is None:
            raise
        raise CheckpointError(m.group(1)[:500]) from exc


def _connection_reason(exc: BaseException) -> str:
    """Why a connection failed, in a few words ("connection refused", "timed out")."""
    reason = getattr(exc, "reason", None) or exc
    text = str(reason)
    m = re.search(r"\[Errno -?\d+\] ([^')\]]+)", text)
    if m is not None:
        text = m.group(1)
    elif isinstance(reason, urllib3.exceptions.TimeoutError):
        text = "no answer in time"
    elif ": " in text:
        text = text.rsplit(": ", 1)[1]
    text = text.strip().rstrip(".")
    return text[:1].lower() + text[1:]
