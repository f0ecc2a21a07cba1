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
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from pydantic import SecretStr

from refit_protocol.keys import payload_mac_key
from refit_protocol.receiver_api import PrewarmRequest, RankPrewarm
from refit_protocol.tensors import TensorMetaModel
from refit_sidecar.codec.encode import encode_payload
from refit_sidecar.codec.records import Item, Op, TensorMeta
from refit_sidecar.codec.wire import CODEC_VERSION, DecodedPayload, EncodedPayload, PayloadHeader
from refit_sidecar.receiver.appliers.base import ApplyReport, StagedPayload
from refit_sidecar.transport.relay import tree
from refit_sidecar.transport.relay.config import RootDealerConfig
from refit_sidecar.transport.relay.frames import DATA, FrameMeta, LinkSecurity, sign_frame
from refit_sidecar.transport.relay.transport import RelayTransport, RelayTransportConfig
from refit_sidecar.transport.s3 import S3Config, S3Fetcher, make_client, upload_payload
from refit_tools.bench.bare_forward import run_bare_forward
from refit_tools.bench.nodes import BenchNodes

MIB = 1 << 20
Say = Callable[[str], None]


class DiscardApplier:
    """Benchmark only: accepts every payload and writes nothing."""

    def prewarm(self, metas: Mapping[str, TensorMeta]) -> list[RankPrewarm]:
        return [RankPrewarm(rank=0)]

    def stage(self, decoded: DecodedPayload) -> StagedPayload:
        return StagedPayload(decoded.header, 0)

    def apply(self, batch: Sequence[StagedPayload], check_samples: int) -> ApplyReport:
        return ApplyReport(payloads=len(batch))

    def discard(self, staged: StagedPayload) -> None:
        pass

    def sync(self) -> None:
        pass

    def gate(self, closed: bool) -> None:
        pass

    def restore(self, source: str) -> set[str]:
        return set()

    def audit(self, source: str) -> list[dict[str, Any]]:
        raise RuntimeError("the benchmark's discarding applier holds no weights to audit")

    def close(self) -> None:
        pass


def discard_applier() -> DiscardApplier:
    return DiscardApplier()


def synthetic_payloads(
    attempt: str, count: int, size: int, seed: int = 0, *, mac_key: bytes | None = None
) -> tuple[list[EncodedPayload], list[TensorMetaModel]]:
    """`count` incompressible payloads of about `size` bytes (one overwrite item each), signed
    with `mac_key` (the receivers' policy key) when given."""
    numel = max(size // 4, 1)
    g = torch.Generator().manual_seed(seed)
    out, metas = [], []
    for i in range(count):
        meta = TensorMeta(f"bench.{i}", (numel,), torch.float32)
        values = torch.randint(-(2**31), 2**31 - 1, (numel,), generator=g, dtype=torch.int32)
        header = PayloadHeader(CODEC_VERSION, attempt, 0, i, i)
        item = Item(meta, Op.OVERWRITE, 0, None, values)
        out.append(encode_payload(header, [item], mac_key=mac_key))
        metas.append(TensorMetaModel(name=meta.name, shape=(numel,), dtype="float32"))
    return out, metas


def _nodes(n: int, workdir: Path, links: LinkSecurity) -> BenchNodes:
    """Receiver node processes on loopback whose applier discards everything."""
    return BenchNodes(
        n,
        workdir,
        applier=lambda _i: {"kind": "factory", "factory": f"{__name__}:discard_applier"},
        links=links,
    ).start()


def _relay_round(
    nodes: BenchNodes,
    attempt: str,
    ps: list[EncodedPayload],
    metas: list[TensorMetaModel],
    links: LinkSecurity,
) -> float:
    """Seconds from the first send to a successful relay flush on every node (the producer's
    link to the root in the same mode as the others: this measures a hop of that mode). The
    producer connects once the attempt is prepared, as a relay forwarding it does: a MAC-only
    port admits only the relays of a prepared attempt (the connection's set-up is timed, in
    both modes)."""
    nodes.each(lambda u: nodes.post(u, "/prewarm", PrewarmRequest(metas=metas)))
    mac = links is LinkSecurity.MAC
    config = RelayTransportConfig(
        root=nodes.mac_relays[0] if mac else nodes.relays[0],
        token=SecretStr(nodes.token),
        client=RootDealerConfig(),
        link=links,
    )
    opened: list[RelayTransport] = []

    def send() -> float:
        t0 = time.monotonic()
        t = RelayTransport(config)
        opened.append(t)
        for p in ps:
            t.send(attempt, p)
        t.stop_and_wait(attempt)
        return t0

    try:
        return nodes.deliver(attempt, {0: len(ps)}, send, timeout_s=300)
    finally:
        for t in opened:
            t.close()


def _frames(ps: list[EncodedPayload], token: str, links: LinkSecurity) -> list[list[bytes]]:
    """The DATA frames a dealer sends for `ps`: over CurveZMQ metadata with the token and the
    body; over a MAC-only link metadata, its tag and the body."""
    if links is LinkSecurity.MAC:
        raw = [FrameMeta.of(p).model_dump_json().encode() for p in ps]
        return [[DATA, m, sign_frame(token, DATA, m), p.body] for m, p in zip(raw, ps, strict=True)]
    metas = [FrameMeta.of(p).model_copy(update={"token": token}) for p in ps]
    return [[DATA, m.model_dump_json().encode(), p.body] for m, p in zip(metas, ps, strict=True)]


def run_relay_bench(
    *,
    nodes: int = 7,
    payloads: int = 16,
    payload_mib: int = 16,
    small: int = 200,
    links: LinkSecurity = LinkSecurity.CURVE,
    rounds: int = 3,
    workdir: Path | None = None,
    say: Say = print,
) -> dict[str, Any]:
    """Relay-tree delivery to `nodes` processes on loopback with every link of the kind
    `links`, and the bare pyzmq forward of the same frames with the same security through as
    many processes (`bare_forward.py`), measured in the same run: `rounds` rounds, each a
    relay delivery then two bare ones of the same frames (every node holding what it
    received, as a staging node must; every node dropping it), and the medians reported (one
    round of a few hundred MiB moves by a quarter on a shared 2-core machine)."""
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    own = workdir is None  # a temporary directory of ours: removed at the end
    workdir = workdir or Path(tempfile.mkdtemp(prefix="kuberefit-bench-"))
    started = datetime.now(timezone.utc)
    say(f"starting {nodes} receiver nodes ...")
    t_bigs: list[float] = []
    t_bares: list[float] = []
    t_drops: list[float] = []
    try:
        cluster = _nodes(nodes, workdir, links)
        try:
            key, token = payload_mac_key(cluster.token), cluster.token
            for r in range(rounds):
                attempt = f"bench-big-{r}"
                big, big_metas = synthetic_payloads(
                    attempt, payloads, payload_mib * MIB, seed=r, mac_key=key
                )
                volume = sum(p.size for p in big)
                say(
                    f"round {r + 1}/{rounds}: relay tree, {links.value} links: {payloads} x "
                    f"{payload_mib} MiB to {nodes} nodes, then bare pyzmq forwards of the "
                    "same frames (holding them, dropping them)"
                )
                t_bigs.append(_relay_round(cluster, attempt, big, big_metas, links))
                frames = _frames(big, token, links)
                t_bares.append(run_bare_forward(nodes, frames, token, links, keep=True))
                t_drops.append(run_bare_forward(nodes, frames, token, links))
            tiny, tiny_metas = synthetic_payloads("bench-small", small, 1024, mac_key=key)
            say(f"relay tree: {small} payloads of 1 KiB ...")
            t_small = _relay_round(cluster, "bench-small", tiny, tiny_metas, links)
        finally:
            cluster.close()
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    t_big, t_bare = statistics.median(t_bigs), statistics.median(t_bares)
    t_drop = statistics.median(t_drops)
    aesgcm: dict[str, float] = {}
    if links is LinkSecurity.CURVE:  # the cipher an encrypted link could use instead
        say(f"bare forward with AES-256-GCM sealed bodies: the same {payloads} payloads ...")
        plain = [[DATA, FrameMeta.of(p).model_dump_json().encode(), p.body] for p in big]
        t_aes = run_bare_forward(nodes, plain, token, aesgcm=True, keep=True)
        aesgcm = {
            "bare_aesgcm_delivery_s": t_aes,
            "bare_aesgcm_unique_gb_s": volume / t_aes / 1e9,
            "aesgcm_over_curve": t_bare / t_aes,
        }
    unique = volume / t_big / 1e9
    return {
        "benchmark": "transport",
        "started": started.isoformat(timespec="seconds"),
        "nodes": nodes,
        "links": links.value,
        "tree_depth": tree.depth(nodes),
        "payloads": payloads,
        "payload_mib": payload_mib,
        "v_payload_bytes": volume,
        "rounds": rounds,
        "round_delivery_s": t_bigs,
        "round_bare_delivery_s": t_bares,
        "round_bare_dropping_delivery_s": t_drops,
        "delivery_s": t_big,
        "unique_gb_s": unique,
        # One node is one hop: what `kuberefit plan` takes as a relay hop's throughput.
        **({"hop_gb_s": unique} if nodes == 1 else {}),
        "delivered_gb_s": nodes * volume / t_big / 1e9,
        "bare_delivery_s": t_bare,
        "bare_unique_gb_s": volume / t_bare / 1e9,
        "hop_ratio": t_bare / t_big,
        "bare_dropping_delivery_s": t_drop,
        "bare_dropping_unique_gb_s": volume / t_drop / 1e9,
        "hop_ratio_dropping": t_drop / t_big,
        **aesgcm,
        "small_payloads": small,
        "per_payload_ms": 1000 * t_small / small,
        "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()},
        "definitions": DEFINITIONS,
    }


#: Written into every result file, so a number never travels without its meaning.
DEFINITIONS = {
    "delivery_s": "first send until a successful relay flush on every node (every payload "
    "received, checked, staged and forwarded); the median of the rounds",
    "rounds": "rounds measured: each a relay delivery of fresh payloads, then the bare forwards "
    "of the same frames (round_*: every round's figure)",
    "unique_gb_s": "V_payload / delivery_s",
    "delivered_gb_s": "nodes x V_payload / delivery_s",
    "links": "how every link of the run is protected, the producer's too: curve (CurveZMQ) or "
    "mac (plain TCP, every frame tagged; in the product only relay-to-relay links inside the "
    "rollout cluster are)",
    "bare_delivery_s": "the same DATA frames through a bare pyzmq forward with the same "
    "security (CurveZMQ sockets, or plain sockets checking each frame's tag) and each body's "
    "payload MAC checked, in as many processes and the same tree, every node holding each "
    "frame it received until the end as a relay node holds what it stages (the bare node "
    "parses and stages nothing): first send until every bare node received every frame; "
    "measured in the same run, after each relay round; the median of the rounds",
    "bare_dropping_delivery_s": "the same bare forward with every node dropping each frame "
    "once forwarded (no fresh memory per frame): the socket and checks alone; the median",
    "bare_dropping_unique_gb_s": "V_payload / bare_dropping_delivery_s",
    "hop_ratio_dropping": "bare_dropping_delivery_s / delivery_s",
    "hop_ratio": "bare_delivery_s / delivery_s (the medians): the share of the socket's ceiling "
    "the relay keeps",
    "bare_aesgcm_delivery_s": "curve runs only: the same payloads through the same bare forward "
    "over plain sockets, each body sealed with AES-256-GCM by the sender (inside the timed "
    "window) and opened by every node before its payload MAC check, forwarded sealed and "
    "held like bare_delivery_s's (`bare_forward.py`); a cipher the product does not offer yet, "
    "measured for the choice",
    "bare_aesgcm_unique_gb_s": "V_payload / bare_aesgcm_delivery_s",
    "aesgcm_over_curve": "bare_delivery_s / bare_aesgcm_delivery_s: how much faster the bare "
    "forward is with AES-GCM than with CurveZMQ",
    "per_payload_ms": "time per payload of a stream of 1 KiB payloads (the product's default "
    "send window)",
    "tree_depth": "hops from the producer to the deepest node of the balanced binary tree",
    "hop_gb_s": "with 1 node only: unique_gb_s, one relay hop's throughput",
}


def write_result(result: Mapping[str, Any], directory: Path, *, kind: str = "transport") -> Path:
    """`<kind>-<UTC time>.json` under `directory` (`kuberefit plan --calibrate` reads the
    transport results)."""
    directory.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = directory / f"{kind}-{stamp}.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return path


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
            f"relay tree, {result['nodes']} nodes on loopback, "
            f"{result.get('links', 'curve')} links: V_payload "
            f"{result['v_payload_bytes'] / MIB:.0f} MiB in {result['delivery_s']:.2f}s = "
            f"{result['unique_gb_s']:.3f} GB/s unique, {result['delivered_gb_s']:.3f} GB/s "
            f"delivered; per-payload overhead {result['per_payload_ms']:.2f} ms"
        )
        lines.append(
            f"bare pyzmq forward of the same frames, each node holding them: "
            f"{result['bare_unique_gb_s']:.3f} GB/s unique; the relay keeps "
            f"{result['hop_ratio']:.2f} of it (tree depth {result['tree_depth']})"
        )
        lines.append(
            f"the same, each node dropping every frame once forwarded: "
            f"{result['bare_dropping_unique_gb_s']:.3f} GB/s unique (the relay keeps "
            f"{result['hop_ratio_dropping']:.2f} of it)"
        )
        if "bare_aesgcm_unique_gb_s" in result:
            lines.append(
                f"bare forward with AES-256-GCM sealed bodies instead of CurveZMQ: "
                f"{result['bare_aesgcm_unique_gb_s']:.3f} GB/s unique, "
                f"{result['aesgcm_over_curve']:.2f}x CurveZMQ's"
            )
    if result.get("files"):
        lines.append("results: " + ", ".join(result["files"]))
    if "upload_gb_s" in result:
        lines.append(
            f"S3: {result['s3_payloads']} x {result['s3_payload_mib']} MiB, upload "
            f"{result['upload_gb_s']:.3f} GB/s, download {result['download_gb_s']:.3f} GB/s"
        )
    return "\n".join(lines)


def format_comparison(results: Sequence[Mapping[str, Any]]) -> str:
    """One line per run (nodes, kind of link), and each MAC-only hop against the encrypted
    hop of the same node count measured in this invocation."""
    lines = [
        "nodes  links  relay GB/s  bare GB/s  relay/bare  bare dropping  relay/dropping",
    ]
    for r in results:
        lines.append(
            f"{r['nodes']:>5}  {r.get('links', 'curve'):<5}  {r['unique_gb_s']:>10.3f}  "
            f"{r['bare_unique_gb_s']:>9.3f}  {r['hop_ratio']:>10.2f}  "
            f"{r['bare_dropping_unique_gb_s']:>13.3f}  {r['hop_ratio_dropping']:>14.2f}"
        )
    for r in results:
        if "aesgcm_over_curve" in r:
            lines.append(
                f"{r['nodes']} node(s): a bare forward with AES-256-GCM carries "
                f"{r['aesgcm_over_curve']:.2f}x the bare CurveZMQ one's unique GB/s"
            )
    by = {(r["nodes"], r.get("links", "curve")): r for r in results}
    for (n, links), r in sorted(by.items()):
        enc = by.get((n, "curve"))
        if links == "mac" and enc is not None:
            ratio = r["unique_gb_s"] / enc["unique_gb_s"]
            lines.append(
                f"{n} node(s): the MAC-only tree moves {ratio:.2f}x the encrypted one's unique GB/s"
            )
    return "\n".join(lines)
