"""`kuberefit bench transport`: relay-tree throughput and per-payload overhead on loopback, and
S3 upload/download throughput against a given S3 endpoint (docs/performance.md "Transport").

Receiver nodes run as real processes (`python -m refit_sidecar.receiver`) in async mode, so a
relay flush measures delivery only: receive, digest check, dedup, staging, forwarding. Their
applier is `DiscardApplier` (benchmark only: it writes nothing, so apply cost is not measured
here; `kuberefit bench apply` measures that).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import urllib3
from pydantic import SecretStr

from refit_operator.api import (
    PrepareRequest,
    PrewarmRequest,
    RankPrewarm,
    RelayFlushRequest,
    RelayFlushResponse,
    TensorMetaModel,
)
from refit_sidecar.codec.records import Item, Op, TensorMeta
from refit_sidecar.codec.wire import (
    CODEC_VERSION,
    DecodedPayload,
    EncodedPayload,
    PayloadHeader,
    encode_payload,
)
from refit_sidecar.receiver.applier import ApplyReport, StagedPayload
from refit_sidecar.transport.client import RelayClientConfig
from refit_sidecar.transport.s3 import S3Config, S3Fetcher, make_client, upload_payload
from refit_sidecar.transport.zmq_relay import ZmqRelayTransport, ZmqTransportConfig

MIB = 1 << 20
Say = Callable[[str], None]


class DiscardApplier:
    """Benchmark only: accepts every payload and writes nothing."""

    def prewarm(self, metas: Mapping[str, TensorMeta]) -> list[RankPrewarm]:
        return [RankPrewarm(rank=0)]

    def stage(self, body: bytes | memoryview, decoded: DecodedPayload) -> StagedPayload:
        return StagedPayload(decoded.header, 0)

    def apply(self, batch: Sequence[StagedPayload], check_samples: int) -> ApplyReport:
        return ApplyReport(payloads=len(batch))

    def discard(self, staged: StagedPayload) -> None:
        pass

    def sync(self) -> None:
        pass

    def gate(self, closed: bool) -> None:
        pass

    def close(self) -> None:
        pass


def discard_applier() -> DiscardApplier:
    return DiscardApplier()


def synthetic_payloads(
    attempt: str, count: int, size: int, seed: int = 0
) -> tuple[list[EncodedPayload], list[TensorMetaModel]]:
    """`count` incompressible payloads of about `size` bytes (one overwrite item each)."""
    numel = max(size // 4, 1)
    g = torch.Generator().manual_seed(seed)
    out, metas = [], []
    for i in range(count):
        meta = TensorMeta(f"bench.{i}", (numel,), torch.float32)
        values = torch.randint(-(2**31), 2**31 - 1, (numel,), generator=g, dtype=torch.int32)
        header = PayloadHeader(CODEC_VERSION, attempt, 0, i, i)
        out.append(encode_payload(header, [Item(meta, Op.OVERWRITE, 0, None, values)]))
        metas.append(TensorMetaModel(name=meta.name, shape=(numel,), dtype="float32"))
    return out, metas


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class _Nodes:
    """Receiver node processes on loopback for the benchmark (stopped by PID at the end)."""

    def __init__(self, n: int, workdir: Path) -> None:
        self.token = secrets.token_hex(16)
        ports = _free_ports(2 * n)
        self.http = [f"http://127.0.0.1:{p}" for p in ports[:n]]
        self.relays = [f"tcp://127.0.0.1:{p}" for p in ports[n:]]
        self.pool = urllib3.PoolManager(maxsize=2 * n, retries=False)
        self.procs: list[subprocess.Popen[bytes]] = []
        env = dict(os.environ, KUBEREFIT_LOG_LEVEL="WARNING")
        for i in range(n):
            cfg = {
                "node": f"bench{i}",
                "port": ports[i],
                "token": self.token,
                "held_version": 0,
                "applier": {"kind": "factory", "factory": f"{__name__}:discard_applier"},
                "relay": {"bind": self.relays[i], "nodes": self.relays},
            }
            path = workdir / f"bench{i}.json"
            path.write_text(json.dumps(cfg))
            log = (workdir / f"bench{i}.log").open("wb")
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "refit_sidecar.receiver", "--config", str(path)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            )
        deadline = time.monotonic() + 120
        for url in self.http:
            while True:
                try:
                    if self.pool.request("GET", url + "/healthz", timeout=1.0).status == 200:
                        break
                except urllib3.exceptions.HTTPError:
                    pass
                if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                    self.close()
                    raise RuntimeError(f"receiver nodes did not start; logs in {workdir}")
                time.sleep(0.1)

    def post(self, url: str, path: str, body: Any, timeout: float = 300) -> dict[str, Any]:
        resp = self.pool.request(
            "POST",
            url + "/v1" + path,
            body=body.model_dump_json().encode(),
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
            timeout=timeout,
        )
        if resp.status != 200:
            raise RuntimeError(f"{url}{path}: HTTP {resp.status}: {resp.data[:300]!r}")
        data: dict[str, Any] = json.loads(resp.data)
        return data

    def each(self, fn: Callable[[str], Any]) -> list[Any]:
        with ThreadPoolExecutor(len(self.http)) as ex:
            return list(ex.map(fn, self.http))

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def _relay_round(
    nodes: _Nodes, attempt: str, ps: list[EncodedPayload], metas: list[TensorMetaModel]
) -> float:
    """Seconds from the first send to a successful relay flush on every node."""
    nodes.each(lambda u: nodes.post(u, "/prewarm", PrewarmRequest(metas=metas)))
    req = PrepareRequest(
        attempt=attempt,
        from_version=0,
        target_version=1,
        mode="overwrite",
        sync=False,
        producers=[0],
        relay_tree=nodes.relays,
    )
    nodes.each(lambda u: nodes.post(u, "/prepare", req))
    t = ZmqRelayTransport(
        ZmqTransportConfig(
            root=nodes.relays[0], token=SecretStr(nodes.token), client=RelayClientConfig()
        )
    )
    t0 = time.perf_counter()
    try:
        for p in ps:
            t.send(attempt, p)
        t.stop_and_wait(attempt)
    finally:
        t.close()
    flush = RelayFlushRequest(attempt=attempt, expected={0: len(ps)}, timeout_s=300)
    answers = nodes.each(lambda u: RelayFlushResponse(**nodes.post(u, "/relay-flush", flush)))
    elapsed = time.perf_counter() - t0
    bad = [a.errors for a in answers if not a.ok]
    if bad:
        raise RuntimeError(f"relay flush failed: {bad[0]}")
    nodes.each(lambda u: nodes.post(u, "/stop", _attempt(attempt)))
    return elapsed


def _attempt(attempt: str) -> Any:
    from refit_operator.api import AttemptRequest

    return AttemptRequest(attempt=attempt)


def run_relay_bench(
    *,
    nodes: int = 7,
    payloads: int = 16,
    payload_mib: int = 16,
    small: int = 200,
    workdir: Path | None = None,
    say: Say = print,
) -> dict[str, Any]:
    """Relay-tree delivery to `nodes` processes on loopback."""
    workdir = workdir or Path(tempfile.mkdtemp(prefix="kuberefit-bench-"))
    say(f"starting {nodes} receiver nodes ...")
    cluster = _Nodes(nodes, workdir)
    try:
        big, big_metas = synthetic_payloads("bench-big", payloads, payload_mib * MIB)
        volume = sum(p.size for p in big)
        say(f"relay tree: {payloads} x {payload_mib} MiB to {nodes} nodes ...")
        t_big = _relay_round(cluster, "bench-big", big, big_metas)
        tiny, tiny_metas = synthetic_payloads("bench-small", small, 1024)
        say(f"relay tree: {small} payloads of 1 KiB ...")
        t_small = _relay_round(cluster, "bench-small", tiny, tiny_metas)
    finally:
        cluster.close()
    return {
        "nodes": nodes,
        "payloads": payloads,
        "payload_mib": payload_mib,
        "v_payload_bytes": volume,
        "delivery_s": t_big,
        "unique_gb_s": volume / t_big / 1e9,
        "delivered_gb_s": nodes * volume / t_big / 1e9,
        "small_payloads": small,
        "per_payload_ms": 1000 * t_small / small,
    }


def run_s3_bench(
    cfg: S3Config, *, payloads: int = 8, payload_mib: int = 64, say: Say = print
) -> dict[str, Any]:
    """Upload then download `payloads` objects with this module's client code."""
    client = make_client(cfg)
    ps, _ = synthetic_payloads("bench-s3", payloads, payload_mib * MIB)
    keys = [f"{cfg.prefix}/bench-s3/{secrets.token_hex(4)}-{i}.krp" for i in range(payloads)]
    volume = sum(p.size for p in ps)
    say(f"S3: uploading {payloads} x {payload_mib} MiB ...")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as ex:  # the transport's default max_in_flight
        list(
            ex.map(
                lambda kp: upload_payload(client, cfg, kp[0], kp[1].body),
                zip(keys, ps, strict=True),
            )
        )
    t_up = time.perf_counter() - t0
    fetcher = S3Fetcher(cfg, client)
    say("S3: downloading ...")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as ex:  # the receiver's default download_workers
        list(
            ex.map(
                lambda kp: fetcher.fetch(cfg.bucket, kp[0], kp[1].size), zip(keys, ps, strict=True)
            )
        )
    t_down = time.perf_counter() - t0
    for k in keys:
        client.delete_object(Bucket=cfg.bucket, Key=k)
    return {
        "s3_payloads": payloads,
        "s3_payload_mib": payload_mib,
        "upload_gb_s": volume / t_up / 1e9,
        "download_gb_s": volume / t_down / 1e9,
        "multipart": any(p.size > cfg.multipart_threshold for p in ps),
    }


def format_report(result: Mapping[str, Any]) -> str:
    lines = []
    if "delivery_s" in result:
        lines.append(
            f"relay tree, {result['nodes']} nodes on loopback: V_payload "
            f"{result['v_payload_bytes'] / MIB:.0f} MiB in {result['delivery_s']:.2f}s = "
            f"{result['unique_gb_s']:.3f} GB/s unique, {result['delivered_gb_s']:.3f} GB/s "
            f"delivered; per-payload overhead {result['per_payload_ms']:.2f} ms"
        )
    if "upload_gb_s" in result:
        lines.append(
            f"S3: {result['s3_payloads']} x {result['s3_payload_mib']} MiB, upload "
            f"{result['upload_gb_s']:.3f} GB/s, download {result['download_gb_s']:.3f} GB/s"
        )
    return "\n".join(lines)
