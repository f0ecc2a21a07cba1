"""Refit worker methods through a local vLLM server's refit control path (loopback only).

Kept apart from `nodes.py` so a short-lived helper can call it without importing torch.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from refit_protocol.kit.auth import bearer_header
from refit_sidecar.vllm.control_path import PREFIX as CONTROL_PREFIX


def vllm_rpc(base_url: str, token: str, method: str, *args: Any, timeout: float = 600) -> list[Any]:
    """A refit worker method on every worker of a local vLLM server, through its control path."""
    body = json.dumps({"method": method, "args": list(args), "timeout": timeout}).encode()
    headers = {"Content-Type": "application/json", **bearer_header(token)}
    req = urllib.request.Request(  # noqa: S310 - loopback only
        f"{base_url}{CONTROL_PREFIX}/rpc", data=body, headers=headers
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - loopback only
        out = json.loads(resp.read())
    results = out.get("results")
    if not isinstance(results, list):
        raise RuntimeError(f"{method}: unexpected answer {out!r}")
    return results
