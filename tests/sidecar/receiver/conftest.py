"""One in-process receiver node (HTTP on a free port, token `NODE_TOKEN`), shared by the service
tests of this folder (their client session is tests/conftest.py's)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from refit_sidecar.receiver.config import ReceiverConfig
from refit_sidecar.receiver.node import ReceiverNode
from tests.sidecar.receiver.models import NODE_TOKEN, RecordingApplier, TinyModel, canonical


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[ReceiverNode]:
    cfg = ReceiverConfig(node="n0", port=0, token=SecretStr(NODE_TOKEN), held_version=0)
    n = ReceiverNode(cfg, RecordingApplier(TinyModel(canonical(0)), str(tmp_path / "log")))
    await n.start()
    try:
        yield n
    finally:
        await n.close()
