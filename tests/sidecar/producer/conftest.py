"""Fixtures of the producer tests: one producer service served over HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from refit_sidecar.baseline.chunks import chunk_export
from refit_sidecar.baseline.config import BaselineConfig
from refit_sidecar.baseline.source import SourceBaseline
from refit_sidecar.producer.http import create_producer_app
from refit_sidecar.producer.service import ProducerService
from tests.harness.s3_payloads import S3Delivery
from tests.harness.web import serve_app
from tests.sidecar.producer.http_app import TOKEN
from tests.sidecar.producer.states import state


@pytest.fixture
async def served(
    tmp_path: Path, delivery: S3Delivery
) -> AsyncIterator[tuple[str, ProducerService]]:
    """The URL and service of producer 0 of 1 (baseline `state(0)`, 20000-byte chunks, token
    `TOKEN`), sending through `delivery`."""
    baseline = SourceBaseline(
        producer=0, producers=1, config=BaselineConfig(directory=tmp_path, export_chunk_bytes=20000)
    )
    baseline.load_initial(chunk_export(state(0).items(), 20000))
    service = ProducerService(baseline, delivery.factory(baseline))
    runner, url = await serve_app(create_producer_app(service, token=TOKEN))
    try:
        yield url, service
    finally:
        await runner.cleanup()
        baseline.close()
