"""Payload delivery through the real parts, for tests that inspect what a producer emitted.

`S3Delivery` gives producers the real `S3Transport`: each payload is uploaded to a real SeaweedFS
and its manifest entry announced to a real receiver node (`ReceiverNode`, in this process, on its
own event-loop thread), which stages it and then downloads it and checks its digest in the
background. The node takes the attempt in async mode (`sync=False`): it holds the verified bytes
and applies nothing, so a test needs no gate, apply or flush. The test then reads the attempt's
objects back (`payloads`, which first waits, against a deadline, until the node has verified
every one of them without an error) and applies them itself, as a receiver would.

One receiver node per attempt, holding the attempt's `from_version`: every attempt is admitted
however the test sequences them (retries from the same version, transitions one after another).

The SeaweedFS server is the session's `s3` fixture, with one payload bucket (`BUCKET`, made by the
`payload_s3` fixture of `tests/sidecar/conftest.py`). Each `S3Delivery` works below a fresh key
prefix of it, which `close` empties (a fresh bucket per test would cost SeaweedFS a volume
allocation, about a second, on first write).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from refit_protocol.commit import AttemptMode
from refit_protocol.producer_api import AttemptPlan
from refit_protocol.receiver_api import PrepareRequest
from refit_protocol.tensors import TensorMetaModel
from refit_sidecar.baseline.source import SourceBaseline
from refit_sidecar.codec.dtypes import dtype_name
from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.codec.wire import EncodedPayload, read_preamble
from refit_sidecar.receiver.appliers.inprocess import InProcessApplier
from refit_sidecar.receiver.config import ReceiverConfig
from refit_sidecar.receiver.node import ReceiverNode
from refit_sidecar.transport.base import Transport
from refit_sidecar.transport.s3 import (
    S3Transport,
    S3TransportConfig,
    attempt_prefix,
    delete_prefix,
    make_client,
    object_key,
)
from tests.harness.operator_env import wait_for
from tests.harness.receivers import Ctl
from tests.harness.s3 import S3Server, store_config
from tests.sidecar.receiver.models import TinyModel

BUCKET = "kuberefit-payloads"


class S3Delivery:
    """Real S3 transports below a fresh key prefix, with one real receiver node per attempt."""

    def __init__(self, server: S3Server) -> None:
        """`server` must hold the bucket `BUCKET` (the `payload_s3` fixture's does)."""
        self.config = store_config(server, BUCKET, prefix="payloads-" + secrets.token_hex(6))
        self.client: Any = make_client(self.config)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._nodes: dict[str, ReceiverNode] = {}
        self._transports: dict[tuple[str, int], S3Transport] = {}

    # -- producers' side ------------------------------------------------------------------------
    def transport(
        self,
        attempt: str,
        baseline: SourceBaseline,
        *,
        mode: AttemptMode = "mixed",
        from_version: int = 0,
        target_version: int = 1,
    ) -> S3Transport:
        """The S3 transport of `baseline`'s producer for `attempt`, whose receiver node is
        prewarmed with the baseline's tensors and prepared for all its producers."""
        with self._lock:
            if attempt not in self._nodes:
                self._receiver(
                    attempt,
                    baseline.metadata,
                    mode=mode,
                    producers=list(range(baseline.producers)),
                    from_version=from_version,
                    target_version=target_version,
                )
            key = (attempt, baseline.producer)
            if key not in self._transports:
                node = self._nodes[attempt]
                self._transports[key] = S3Transport(
                    S3TransportConfig(
                        s3=self.config,
                        receivers=[f"http://127.0.0.1:{node.port}"],
                        producer=baseline.producer,
                    ),
                    client=self.client,
                )
            return self._transports[key]

    def factory(self, baseline: SourceBaseline) -> Callable[[AttemptPlan], Transport]:
        """`ProducerService`'s transport factory: each plan's attempt through `transport`."""

        def transport_for(plan: AttemptPlan) -> Transport:
            return self.transport(
                plan.attempt,
                baseline,
                mode=plan.mode,
                from_version=plan.from_version,
                target_version=plan.target_version,
            )

        return transport_for

    # -- what arrived ---------------------------------------------------------------------------
    def payloads(self, attempt: str, producer: int | None = None) -> list[EncodedPayload]:
        """The attempt's payload objects in the bucket (of one producer, or all), by producer
        and payload id. Each object's key must name the identity and digest its bytes carry."""
        prefix = attempt_prefix(self.config, attempt)
        if producer is not None:
            prefix += f"p{producer}/"
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.config.bucket, Prefix=prefix
        ):
            for obj in page.get("Contents", []):
                body = self.client.get_object(Bucket=self.config.bucket, Key=obj["Key"])
                data: bytes = body["Body"].read()
                pre = read_preamble(memoryview(data))
                h = pre.header
                expected = object_key(
                    self.config, attempt, h.producer, h.payload_id, pre.digest.hex()
                )
                assert (h.attempt, obj["Key"]) == (attempt, expected), (h, obj["Key"])
                out.append(EncodedPayload(h, data, pre.digest))
        if producer is None and out and attempt in self._nodes:  # (none left after a cleanup)
            self._wait_verified(attempt, len(out))
        return sorted(out, key=lambda p: (p.header.producer, p.header.payload_id))

    def _wait_verified(self, attempt: str, n: int) -> None:
        """The attempt's receiver has downloaded and checked all `n` payloads, refusing none."""
        ctl = Ctl(f"http://127.0.0.1:{self._nodes[attempt].port}", None)

        def verified() -> bool:
            status = ctl.status()
            assert status.errors == [], status.errors
            return status.staged == n

        wait_for(f"the receiver of {attempt} verified {n} payloads", verified, timeout=60)

    # -- receivers ------------------------------------------------------------------------------
    def _receiver(
        self,
        attempt: str,
        metas: Mapping[str, TensorMeta],
        *,
        mode: AttemptMode,
        producers: list[int],
        from_version: int,
        target_version: int,
    ) -> None:
        loop = self._event_loop()
        model = TinyModel({m.name: torch.zeros(m.shape, dtype=m.dtype) for m in metas.values()})
        node = ReceiverNode(
            ReceiverConfig(node=f"r-{attempt}", port=0, held_version=from_version, s3=self.config),
            InProcessApplier(model),
        )
        asyncio.run_coroutine_threadsafe(node.start(), loop).result(30)
        self._nodes[attempt] = node  # closed by `close` even if prewarm or prepare fails
        ctl = Ctl(f"http://127.0.0.1:{node.port}", None)
        ctl.prewarm(
            [
                TensorMetaModel(name=m.name, shape=m.shape, dtype=dtype_name(m.dtype))
                for m in metas.values()
            ]
        )
        prepared = ctl.prepare(
            PrepareRequest(
                attempt=attempt,
                from_version=from_version,
                target_version=target_version,
                mode=mode,
                sync=False,  # hold the verified bytes; the test applies what it reads back
                producers=producers,
            )
        )
        assert prepared.accepted, prepared.reason

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=loop.run_forever, name="s3-delivery-receivers", daemon=True
            )
            self._thread.start()
            self._loop = loop
        return self._loop

    def close(self) -> None:
        """Transports, nodes, the loop and the key prefix: each released even if one fails."""
        with contextlib.ExitStack() as stack:
            stack.callback(delete_prefix, self.client, self.config.bucket, self.config.prefix + "/")
            if self._loop is not None:
                stack.callback(self._stop_loop, self._loop)
                for node in self._nodes.values():
                    stack.callback(self._close_node, node, self._loop)
            for t in self._transports.values():
                stack.callback(t.close)

    @staticmethod
    def _close_node(node: ReceiverNode, loop: asyncio.AbstractEventLoop) -> None:
        asyncio.run_coroutine_threadsafe(node.close(), loop).result(30)

    def _stop_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.call_soon_threadsafe(loop.stop)
        assert self._thread is not None
        self._thread.join(30)
        if not self._thread.is_alive():
            loop.close()
