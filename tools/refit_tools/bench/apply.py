"""`kuberefit bench apply`: receiver apply throughput through a generic native loader.

A synthetic transformer-shaped BF16 model (default 1 GiB) whose `load_weights` copies each
canonical tensor into its parameter — fused at offsets for q/k/v and gate/up, as serving
runtimes do — is updated at uniform change rates with XOR and overwrite items. Reported:
changed values per second, canonical bytes per second (bytes of the tensors that had changes),
and the share of apply time spent resetting scratch.

`node_cpu`: the rollout node's work per payload on the vLLM path, split as it runs in a pod:
the receiver sidecar's CPU (the relay's digest check, one decode, writing the decoded payload
file) and the vLLM worker's (reading that file; the apply as wall time, it is multi-threaded);
`worker_decode_ms` is what a second decode in the worker would cost, measured on the same
payloads (`worker_read_over_decode`).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from refit_sidecar.apply import ApplyContext, prewarm
from refit_sidecar.apply.audit import audit
from refit_sidecar.codec import (
    CODEC_VERSION,
    Item,
    Op,
    PayloadHeader,
    TensorMeta,
    decode_payload,
    encode_payload,
)
from refit_sidecar.codec.decoded_file import read_decoded, write_decoded
from refit_sidecar.transport.relay.frames import FrameMeta, verify_body
from refit_tools.bench.synthetic import FULL_SHAPE, checkpoint_layout
from refit_tools.peak_rss import PeakRss

BF16 = torch.bfloat16
#: Where pods keep decoded payload files (a tmpfs); the system temp directory if absent.
_SHM = Path("/dev/shm")
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class SyntheticServingModel(torch.nn.Module):
    """Parameters in a serving layout (fused q/k/v and gate/up); one generic loader."""

    def __init__(
        self, layout: list[tuple[str, tuple[int, ...]]], seed: int = 0, *, empty: bool = False
    ) -> None:
        """Random BF16 parameters, or uninitialized ones when `empty` (the caller loads a
        checkpoint densely next, so drawing values would be wasted work)."""
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.slots: dict[str, tuple[str, int]] = {}  # canonical -> (param, row offset)
        sizes: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        for name, shape in layout:
            prefix, _, leaf = name.rpartition(".weight")[0].rpartition(".")
            fused = _FUSED.get(leaf)
            target = f"{prefix}.{fused[0]}" if fused else name.removesuffix(".weight")
            sizes.setdefault(target, []).append((name, shape))
        self.params = torch.nn.ParameterDict()
        for target, parts in sizes.items():
            rows = sum(s[0] for _, s in parts)
            shape = (rows, *parts[0][1][1:])
            data = (
                torch.empty(shape, dtype=BF16)
                if empty
                else torch.randn(shape, generator=g, dtype=torch.float32).to(BF16)
            )
            key = target.replace(".", "__")
            self.params[key] = torch.nn.Parameter(data, requires_grad=False)
            offset = 0
            for name, s in parts:
                self.slots[name] = (key, offset)
                offset += s[0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        for name, w in weights:
            key, offset = self.slots[name]
            self.params[key].data.narrow(0, offset, w.shape[0]).copy_(w)
            loaded.add(f"params.{key}")
        return loaded


def _items(metas: list[TensorMeta], rate: float, op: Op, seed: int) -> tuple[list[Item], int]:
    rng = np.random.default_rng(seed)
    items, values = [], 0
    for meta in metas:
        n = meta.numel
        k = int(rng.binomial(n, rate))
        if k == 0:
            continue
        locs = np.unique(rng.integers(0, n, size=k, dtype=np.int64))
        vals = rng.integers(1, 1 << 15, size=locs.size, dtype=np.int16)
        items.append(Item(meta, op, None, torch.from_numpy(locs), torch.from_numpy(vals)))
        values += int(locs.size)
    return items, values


def run_apply_bench(
    *,
    size_bytes: int = 1 << 30,
    rates: tuple[float, ...] = (0.01, 0.05),
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    layout = checkpoint_layout(FULL_SHAPE, size_bytes)
    metas = [TensorMeta(n, s, BF16) for n, s in layout]
    total_bytes = sum(m.nbytes for m in metas)
    say(f"[bench apply] building a {total_bytes / 2**30:.2f} GiB synthetic model")
    model = SyntheticServingModel(layout)
    ctx = ApplyContext(model, {m.name: m for m in metas})
    t0 = time.perf_counter()
    report = prewarm(ctx)
    prewarm_s = time.perf_counter() - t0
    if report.unsupported or report.xor_incompatible:
        raise RuntimeError(f"synthetic loader not XOR-compatible: {report.to_json()}")
    out: dict[str, Any] = {
        "checkpoint_bytes": total_bytes,
        "tensors": len(metas),
        "prewarm_s": prewarm_s,
        "rates": {},
    }
    for rate in rates:
        row: dict[str, Any] = {}
        for op in (Op.XOR, Op.OVERWRITE):
            items, values = _items(metas, rate, op, seed=int(rate * 1e6) + int(op))
            t0 = time.perf_counter()
            stats = ctx.apply(items)
            wall = time.perf_counter() - t0
            row[op.name.lower()] = {
                "values": values,
                "wall_s": wall,
                "values_per_s": values / wall,
                "canonical_gbps": stats.canonical_bytes / wall / 1e9,
                "reset_share": stats.reset_s / wall,
                "scatter_share": stats.scatter_s / wall,
                "loader_share": stats.load_s / wall,
            }
            say(
                f"[bench apply] rate {rate:.0%} {op.name.lower():9s}: "
                f"{values / wall / 1e6:6.1f} M values/s, "
                f"{stats.canonical_bytes / wall / 1e9:5.2f} GB/s canonical, "
                f"reset {stats.reset_s / wall:5.1%}"
            )
        row["node_cpu"] = _node_cpu(ctx, metas, rate)
        say(
            f"[bench apply] rate {rate:.0%} per payload: receiver "
            f"{row['node_cpu']['receiver_ms']:.2f} ms, worker read "
            f"{row['node_cpu']['worker_read_ms']:.2f} ms (a second decode: "
            f"{row['node_cpu']['worker_decode_ms']:.2f} ms) + apply "
            f"{row['node_cpu']['worker_apply_wall_ms']:.2f} ms wall"
        )
        out["rates"][f"{rate:.2f}"] = row
    out["audit"] = _audit_figures(ctx, model, metas)
    a = out["audit"]
    say(
        f"[bench apply] audit: {a['audit_s']:.2f} s for {a['elements'] / 1e6:.0f} M elements "
        f"(a dense load: {a['dense_load_s']:.2f} s, x{a['audit_over_dense']:.2f}), peak extra "
        f"memory {a['audit_peak_extra_bytes'] / 2**20:.0f} MiB (dense load "
        f"{a['dense_peak_extra_bytes'] / 2**20:.0f} MiB)"
    )
    return out


def _audit_figures(
    ctx: ApplyContext, model: SyntheticServingModel, metas: list[TensorMeta]
) -> dict[str, Any]:
    """The audit over the checkpoint the model holds, beside a dense load of the same tensors
    (both fed one canonical tensor at a time, as from a safetensors file)."""

    def checkpoint() -> Iterator[tuple[str, torch.Tensor]]:
        for m in metas:
            key, offset = model.slots[m.name]
            yield m.name, model.params[key].data.narrow(0, offset, m.shape[0]).clone()

    with PeakRss() as audit_mem:
        t0 = time.perf_counter()
        report = audit(ctx, checkpoint())
        audit_s = time.perf_counter() - t0
    if not report.ok:
        raise RuntimeError(f"the audit of an untouched model found {report.mismatched_elements}")
    with PeakRss() as dense_mem:
        t0 = time.perf_counter()
        model.load_weights(checkpoint())
        dense_s = time.perf_counter() - t0
    return {
        "tensors": report.tensors,
        "elements": report.elements,
        "audit_s": audit_s,
        "dense_load_s": dense_s,
        "audit_over_dense": audit_s / dense_s,
        "audit_peak_extra_bytes": audit_mem.extra,
        "dense_peak_extra_bytes": dense_mem.extra,
        "largest_tensor_bytes": max(m.nbytes for m in metas),
    }


def _node_cpu(
    ctx: ApplyContext, metas: list[TensorMeta], rate: float, payloads: int = 8, repeats: int = 3
) -> dict[str, Any]:
    """Median per payload of each part of the vLLM path (see the module docstring)."""
    items, _ = _items(metas, rate, Op.XOR, seed=int(rate * 1e6) + 7)
    per = max(1, -(-len(items) // payloads))
    encoded = [
        encode_payload(PayloadHeader(CODEC_VERSION, "bench", 0, i, i), items[j : j + per])
        for i, j in enumerate(range(0, len(items), per))
    ]
    cpu: dict[str, list[float]] = {k: [] for k in ("receiver", "read", "decode", "apply")}
    with tempfile.TemporaryDirectory(dir=_SHM if _SHM.is_dir() else None) as d:
        path = Path(d) / "payload.krd"
        for p in encoded * repeats:
            meta = FrameMeta.of(p)
            # Thread CPU for the single-threaded parts (process CPU would also count torch's
            # OpenMP workers spinning after the apply); wall time for the apply.
            t0 = time.thread_time()
            verify_body(meta, p.body)  # the relay node, on arrival
            decoded = decode_payload(
                p.body, expected_digest=p.digest, body_hash=p.digest, known=ctx.metas
            )
            write_decoded(decoded, path)
            t1 = time.thread_time()
            _, read = read_decoded(path, ctx.metas)
            t2 = time.thread_time()
            w0 = time.perf_counter()
            ctx.apply(read)
            w1 = time.perf_counter()
            t3 = time.thread_time()
            decode_payload(p.body, known=ctx.metas)  # what a second decode would cost
            t4 = time.thread_time()
            for key, dt in zip(cpu, (t1 - t0, t2 - t1, t4 - t3, w1 - w0), strict=True):
                cpu[key].append(dt)
    ms = {k: 1e3 * statistics.median(v) for k, v in cpu.items()}
    return {
        "payloads": len(encoded),
        "mean_wire_bytes": statistics.mean(p.size for p in encoded),
        "receiver_ms": ms["receiver"],
        "worker_read_ms": ms["read"],
        "worker_apply_wall_ms": ms["apply"],
        "worker_decode_ms": ms["decode"],
        "worker_read_over_decode": ms["read"] / ms["decode"],
    }
