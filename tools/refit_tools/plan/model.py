"""The refit latency model: pure functions of a deployment and calibrated constants.

A refit attempt is a pipeline (paper §7.2, Figure 8): owners compare chunk after chunk and seal
buckets into payloads, each payload crosses the cluster boundary once to a relay root (or is
uploaded to S3), is forwarded down the rollout cluster's binary relay tree (or downloaded by
every node), and every node applies it through its loader. Stages overlap, so the stream of
payloads moves at the pace of its slowest stage; the first payload has to be constructed before
anything is sent (start-up), the last one still has to travel down the tree and be applied after
the last send (drain), and the commit and baseline update follow (finalization). Hence

    latency = startup + stream + drain + finalization
    startup = fixed start-up + construction of the first payload's region
    stream  = max over stages of (stage time - the part already counted in start-up / drain)
    drain   = (tree depth - 1) relay hops of the last payload + applying its region
    finalization = per-byte baseline update of each producer's share of H

with the stage times (whole attempt)

    construction  = (H / P) / construction throughput          (P producers split H)
    cross-cluster = V * link overhead / cross rate + payloads per producer * per-payload cost
    fan-out       = children * V / min(intra rate, relay hop throughput) + payloads * hop cost
    apply         = H / apply throughput                       (every node applies all of H)

and V = V_payload(rate) * H. Nothing here is a constant of its own: every throughput, overhead
and fixed time comes in through `Constants`, which `calibration` fits from bench results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

Transport = Literal["relay", "s3"]
#: Stage names, in pipeline order (S3 adds "upload"; its "fan-out" is every node's download).
STAGES = ("construction", "upload", "cross-cluster", "fan-out", "apply")


@dataclass(frozen=True)
class Deployment:
    """What is being refit, and over what (bytes and bytes per second)."""

    model_bytes: int
    change_rate: float
    producers: int
    nodes: int
    #: Rate between the clusters shared by all producers' flows; None: not link-limited.
    cross_bytes_s: float | None
    #: Rate of each rollout node's link inside its cluster; None: not link-limited.
    intra_bytes_s: float | None
    #: Export chunk limit and bucket target in effect (`projection.product_sizes` resolves the
    #: product's `auto`).
    chunk_bytes: int
    bucket_bytes: int
    transport: Transport = "relay"
    #: Size of the last tensor in export order (the output head), when known: its payload is
    #: applied after the last send, however small the buckets.
    last_tensor_bytes: int | None = None


@dataclass(frozen=True)
class Constants:
    """Calibrated figures at the deployment's change rate (bytes, seconds)."""

    v_over_h: float
    link_overhead: float
    payload_overhead_s: float
    construction_bytes_s: float
    apply_bytes_s: float
    startup_fixed_s: float
    finalization_s_per_byte: float
    hop_bytes_s: float | None = None
    hop_payload_s: float = 0.0
    s3_upload_bytes_s: float | None = None
    s3_download_bytes_s: float | None = None


@dataclass(frozen=True)
class Breakdown:
    """A projection: stage times of the whole attempt, the latency terms and the reference."""

    v_payload_bytes: float
    cross_bytes: float
    payloads: int
    tree_depth: int
    stages: dict[str, float]
    bound: str
    startup_s: float
    stream_s: float
    drain_s: float
    finalization_s: float
    reference_s: float
    reference_cross_bytes: float
    notes: list[str] = field(default_factory=list)

    @property
    def latency_s(self) -> float:
        return self.startup_s + self.stream_s + self.drain_s + self.finalization_s

    @property
    def speedup(self) -> float:
        return self.reference_s / self.latency_s

    @property
    def link_limit(self) -> float:
        """H / V_payload: the speedup if both sides were bound by the same link alone."""
        return self.reference_cross_bytes / self.cross_bytes


def tree_depth(nodes: int) -> int:
    """Levels of the balanced binary relay tree (`refit_sidecar.transport.relay.tree.depth`)."""
    return max(nodes, 0).bit_length()


def tree_children(nodes: int) -> int:
    """Most children any relay node forwards to (position i sends to 2i+1 and 2i+2)."""
    return min(2, max(nodes - 1, 0))


def payloads_per_producer(model_bytes: int, producers: int, bucket_bytes: int) -> int:
    """Buckets are filled with whole chunks up to `bucket_bytes` of H each."""
    return max(1, math.ceil(model_bytes / producers / bucket_bytes))


def first_region(d: Deployment) -> float:
    """Bytes of H compared before the first send: a bucket closes only on whole chunks."""
    return min(max(d.chunk_bytes, d.bucket_bytes), d.model_bytes / d.producers)


def last_region(d: Deployment) -> float:
    """Bytes of H the last payload covers: a bucket, or the last tensor when that is larger."""
    share = d.model_bytes / d.producers
    return min(max(min(d.bucket_bytes, share), d.last_tensor_bytes or 0), share)


def _per(nbytes: float, rate: float | None) -> float:
    return 0.0 if rate is None or math.isinf(rate) else nbytes / rate


def _min_rate(*rates: float | None) -> float | None:
    known = [r for r in rates if r is not None and not math.isinf(r)]
    return min(known) if known else None


def project(d: Deployment, k: Constants) -> Breakdown:
    """Project one refit attempt (see the module docstring for the formula)."""
    h, p = float(d.model_bytes), d.producers
    v = k.v_over_h * h
    n_p = payloads_per_producer(d.model_bytes, p, d.bucket_bytes)
    depth, children = tree_depth(d.nodes), tree_children(d.nodes)
    first, last = first_region(d), last_region(d)
    last_wire = k.v_over_h * last
    construction = (h / p) / k.construction_bytes_s
    apply = h / k.apply_bytes_s
    notes: list[str] = []
    stages: dict[str, float] = {"construction": construction}
    if d.transport == "relay":
        hop = _min_rate(d.intra_bytes_s, k.hop_bytes_s)
        cross_link = _per(v * k.link_overhead, d.cross_bytes_s)
        # One producer's flow to its relay root also passes a relay hop (the root's receive).
        per_flow = _per(v / p, k.hop_bytes_s)
        cross = max(cross_link, per_flow) + n_p * k.payload_overhead_s
        fan = children * _per(v, hop) + (n_p * p * k.hop_payload_s if children else 0.0)
        stages |= {"cross-cluster": cross, "fan-out": fan, "apply": apply}
        cross_bytes = v * k.link_overhead
        drain_move = (depth - 1) * (_per(last_wire, hop) + k.hop_payload_s)
        ref_fan = children * _per(h, hop)
        ref_cross = max(_per(h * k.link_overhead, d.cross_bytes_s), _per(h / p, k.hop_bytes_s))
        reference = max(ref_cross, ref_fan) + (depth - 1) * _per(d.bucket_bytes, hop)
        reference_bytes = h * k.link_overhead
    else:
        if k.s3_upload_bytes_s is None or k.s3_download_bytes_s is None:
            raise ValueError("no S3 calibration: S3 upload/download throughput unmeasured")
        # Owners upload once (next to the trainers); every node's download crosses the boundary.
        upload = (v / p) / k.s3_upload_bytes_s
        cross_bytes = d.nodes * v * k.link_overhead
        cross = _per(cross_bytes, d.cross_bytes_s)
        download = max(v / k.s3_download_bytes_s, _per(v, d.intra_bytes_s))
        stages |= {"upload": upload, "cross-cluster": cross, "fan-out": download, "apply": apply}
        drain_move = last_wire / k.s3_download_bytes_s
        reference_bytes = d.nodes * h * k.link_overhead
        reference = max(
            (h / p) / k.s3_upload_bytes_s,
            _per(reference_bytes, d.cross_bytes_s),
            h / k.s3_download_bytes_s,
        )
        notes.append("s3: per-payload overheads not calibrated (taken as 0)")
    bound = max(stages, key=lambda s: stages[s])
    # Start-up already built the first payload and the drain applies the last one.
    overlap = dict(stages)
    overlap["construction"] = max(construction - first / k.construction_bytes_s, 0.0)
    overlap["apply"] = max(apply - last / k.apply_bytes_s, 0.0)
    return Breakdown(
        v_payload_bytes=v,
        cross_bytes=cross_bytes,
        payloads=n_p * p,
        tree_depth=depth if d.transport == "relay" else 1,
        stages=stages,
        bound=bound,
        startup_s=k.startup_fixed_s + first / k.construction_bytes_s,
        stream_s=max(overlap.values()),
        drain_s=drain_move + last / k.apply_bytes_s,
        finalization_s=k.finalization_s_per_byte * h / p,
        reference_s=reference,
        reference_cross_bytes=reference_bytes,
        notes=notes,
    )
