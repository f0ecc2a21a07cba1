"""A worker's refusal of a checkpoint file crosses vLLM's control path as text: the receiver's
vLLM applier raises it as a `CheckpointError` again (so the node answers 422), and leaves every
other RPC failure as it was."""

from __future__ import annotations

import json

import pytest

from refit_protocol.errors import ErrorBody
from refit_sidecar.apply.checkpoint import CheckpointError
from refit_sidecar.receiver.appliers.vllm_http import VllmRpcError, _checkpoint_errors


def _rpc_error(message: str) -> VllmRpcError:
    """What `VllmHttpApplier._post` raises for the control path's 500 (its error body)."""
    body = ErrorBody.of(500, message).to_json()
    return VllmRpcError(f"/kuberefit/v1/rpc: HTTP 500: {json.dumps(body).encode()[:500]!r}")


def test_a_workers_checkpoint_refusal_is_a_checkpoint_error_again() -> None:
    with pytest.raises(CheckpointError) as caught, _checkpoint_errors():
        raise _rpc_error("CheckpointError: /ckpt/model.safetensors: header length 2^62 > file")
    assert str(caught.value) == "/ckpt/model.safetensors: header length 2^62 > file"


def test_other_rpc_failures_are_left_alone() -> None:
    with pytest.raises(VllmRpcError), _checkpoint_errors():
        raise _rpc_error("RuntimeError: engine dead")
