"""The refit latency model: pure functions of a deployment and calibrated constants.

A refit attempt is a pipeline (paper §7.2, Figure 8): owners compare chunk after chunk and seal
buckets into payloads, each payload crosses the cluster boundary once to a relay root (or is
uploaded to S3), is forwarded down the rollout cluster's binary relay tree (or downloaded by
every node), and every node applies it through its loader. Stages overlap, so the stream of
payloads moves at the pace of its slowest stage; the first payload has to be constructed before
anything is sent (start-up), the last one still has to travel down the tree and be applied after
the last send (drain), and the commit follows (finalization; each producer writes its baseline
update while the payloads travel, `baseline.early_update`, so only a wait for writes still
running is left of it). Hence

    latency = startup + stream + drain + finalization
    startup = fixed start-up + construction of the first payload's region
    stream  = max over stages of (stage time - the part already counted in start-up / drain)
    drain   = fixed (flush barriers) + (tree depth - 1) relay hops of the last payload
              + the last payload's region at the drain's rate x its CPU share
    finalization = fixed + per byte of each producer's share of H (fitted; ~0 since the
                   baseline update moved into the stream)

with the stage times (whole attempt)

    construction  = (H / P) / construction throughput          (P producers split H)
    cross-cluster = max(V * link overhead / cross rate, V / P / relay hop)
                    + fixed + payloads per producer * per-payload cost
    fan-out       = children * V / min(intra rate, intra relay hop) + payloads * hop cost
                    (the intra hop: the MAC-only hop, or the encrypted one when the policy
                    encrypts inside the rollout cluster; the cross-cluster stage's root receive
                    is always the encrypted hop)
    apply         = H / apply throughput + payloads * per-payload apply  (every node, all of H)

and V = V_payload(rate) * H. Throughputs are at the deployment's change rate: the calibration
fits each CPU cost as (per byte of H + per changed element) and turns it into bytes of H per
second at that rate.

Where every process shares one machine's cores (`Deployment.shared_cpus`, the bench), the CPU
stages do not overlap but take turns: one more stage, "shared CPU", adds up the machine-seconds
after start-up and before the drain (producers' remaining construction, each node's receive at
the relay hop's pace, each node's apply of all but the last payload on one core of `cpus`), and
the drain's last apply runs on every node at once (x max(1, nodes / cpus)).

Nothing here is a constant of its own: every throughput, overhead and fixed time comes in
through `Constants`, which `calibration` fits from bench results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from refit_protocol.transports import TransportKind

Transport = TransportKind
#: Stage names, in pipeline order (S3 adds "upload"; its "fan-out" is every node's download;
#: a deployment on shared cores adds "shared CPU").
STAGES = ("construction", "upload", "cross-cluster", "fan-out", "apply", "shared CPU")
#: Bytes per element of the canonical checkpoint (BF16) unless the deployment says otherwise.
ELEMENT_BYTES = 2


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
    transport: Transport = "zmq"
    #: A changed tensor above this travels in parts (`refit_sidecar.pipeline.parts`); None: in
    #: one payload (results measured before tensors were split).
    split_bytes: int | None = None
    #: Size of the last tensor in export order (the output head), when known: its payload is
    #: applied after the last send, however small the buckets.
    last_tensor_bytes: int | None = None
    #: Size of the first tensor in export order (the embedding), when known: the first payload
    #: waits for its whole chunk.
    first_tensor_bytes: int | None = None
    #: Bytes of H each of one producer's payloads covers, in send order, when the tensor layout
    #: is known (a bench run, or a Hugging Face config: `payloads.payload_regions`); otherwise
    #: estimated from the chunk and bucket sizes.
    regions: tuple[int, ...] | None = None
    #: Every producer, relay and node shares this many cores (the bench machine); None: each
    #: has its own.
    shared_cpus: int | None = None
    element_bytes: int = ELEMENT_BYTES
    #: Relay-to-relay links inside the rollout cluster (`spec.security.intraCluster`).
    intra_cluster: Literal["mac", "encrypted"] = "mac"


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
    #: A MAC-only relay hop (None: not measured; the encrypted hop stands in).
    hop_mac_bytes_s: float | None = None
    s3_upload_bytes_s: float | None = None
    s3_download_bytes_s: float | None = None
    #: Fixed part of the cross-cluster stream (beyond the link time and per-payload costs).
    stream_fixed_s: float = 0.0
    #: Per payload each node applies, beyond its bytes.
    apply_payload_s: float = 0.0
    #: The drain after the last send: fixed part (flush barriers) and the rate at which it
    #: covers the last payload's region (None: the apply throughput).
    drain_fixed_s: float = 0.0
    drain_bytes_s: float | None = None
    finalization_fixed_s: float = 0.0


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
    #: What the relay hop's throughput (not a link rate) bounds: "fan-out", "cross-cluster"
    #: (a relay root's receive of one producer's flow) and "reference" (the full-checkpoint
    #: transfer), each with the link it outpaces ("intra" or "cross").
    hop_bound: dict[str, str] = field(default_factory=dict)

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


def payload_count(d: Deployment) -> int:
    """Payloads of one producer: the known regions, else the bucket estimate."""
    if d.regions:
        return len(d.regions)
    return payloads_per_producer(d.model_bytes, d.producers, d.bucket_bytes)


def _whole(d: Deployment, tensor_bytes: int | None) -> int:
    """Bytes of a tensor that travel in one payload: all of it, or a part when it is split."""
    if tensor_bytes is None:
        return 0
    return tensor_bytes if d.split_bytes is None else min(tensor_bytes, d.split_bytes)


def first_region(d: Deployment) -> float:
    """Bytes of H built before the first send: a bucket closes only on whole chunks (and a
    tensor larger than the chunk limit is a chunk of its own), or on the first part of a split
    tensor (whose compare covers the whole tensor, a small share of the build at ~4 GB/s)."""
    if d.regions:
        return float(d.regions[0])
    share = d.model_bytes / d.producers
    return min(max(d.chunk_bytes, d.bucket_bytes, _whole(d, d.first_tensor_bytes)), share)


def last_region(d: Deployment) -> float:
    """Bytes of H the last payload covers: a bucket, or the last tensor (its last part when
    split) when that is larger."""
    if d.regions:
        return float(d.regions[-1])
    share = d.model_bytes / d.producers
    return min(max(min(d.bucket_bytes, share), _whole(d, d.last_tensor_bytes)), share)


def changed_elements(d: Deployment, nbytes: float) -> float:
    """Elements of `nbytes` of H expected to change at the deployment's rate."""
    return d.change_rate * nbytes / d.element_bytes


def _per(nbytes: float, rate: float | None) -> float:
    return 0.0 if rate is None or math.isinf(rate) else nbytes / rate


def _min_rate(*rates: float | None) -> float | None:
    known = [r for r in rates if r is not None and not math.isinf(r)]
    return min(known) if known else None


def project(d: Deployment, k: Constants) -> Breakdown:
    """Project one refit attempt (see the module docstring for the formula)."""
    h, p = float(d.model_bytes), d.producers
    v = k.v_over_h * h
    n_p = payload_count(d)
    depth, children = tree_depth(d.nodes), tree_children(d.nodes)
    first, last = first_region(d), last_region(d)
    last_wire = k.v_over_h * last
    g_drain = k.drain_bytes_s or k.apply_bytes_s
    construction = (h / p) / k.construction_bytes_s
    apply = h / k.apply_bytes_s + n_p * p * k.apply_payload_s
    notes: list[str] = []
    hop_bound: dict[str, str] = {}
    stages: dict[str, float] = {"construction": construction}
    relay_cpu = 0.0  # each node's receive at the relay hop's pace (shared cores only)
    if d.transport == "zmq":
        intra_hop = k.hop_bytes_s  # what a relay-to-relay hop moves in the policy's mode
        if d.intra_cluster == "mac" and k.hop_mac_bytes_s is not None:
            intra_hop = k.hop_mac_bytes_s
        hop = _min_rate(d.intra_bytes_s, intra_hop)
        cross_link = _per(v * k.link_overhead, d.cross_bytes_s)
        # One producer's flow to its relay root also passes a relay hop (the root's receive).
        per_flow = _per(v / p, k.hop_bytes_s)
        cross = max(cross_link, per_flow) + k.stream_fixed_s + n_p * k.payload_overhead_s
        fan = children * _per(v, hop) + (n_p * p * k.hop_payload_s if children else 0.0)
        stages |= {"cross-cluster": cross, "fan-out": fan, "apply": apply}
        cross_bytes = v * k.link_overhead
        drain_move = (depth - 1) * (_per(last_wire, hop) + k.hop_payload_s)
        # The roots receive V over the encrypted hop, the other nodes over the intra hop.
        relay_cpu = (
            _per(v, k.hop_bytes_s)
            + (d.nodes - 1) * _per(v, intra_hop)
            + d.nodes * n_p * p * k.hop_payload_s
        )
        ref_fan = children * _per(h, hop)
        ref_link = _per(h * k.link_overhead, d.cross_bytes_s)
        ref_flow = _per(h / p, k.hop_bytes_s)
        reference = max(ref_link, ref_flow, ref_fan) + (depth - 1) * _per(d.bucket_bytes, hop)
        reference_bytes = h * k.link_overhead
        # Where the relay hop, not the link given, sets the pace.
        hop_paced = hop is not None and hop != _min_rate(d.intra_bytes_s)
        if children and hop_paced:
            hop_bound["fan-out"] = "intra"
        if per_flow > cross_link:
            hop_bound["cross-cluster"] = "cross"
        if max(ref_flow, ref_fan) > ref_link:
            if ref_fan >= ref_flow and hop_paced:
                hop_bound["reference"] = "intra"
            elif ref_flow > ref_fan:
                hop_bound["reference"] = "cross"
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
    # Start-up already built the first payload and the drain applies the last one.
    overlap = dict(stages)
    overlap["construction"] = max(construction - first / k.construction_bytes_s, 0.0)
    overlap["apply"] = max(apply - last / k.apply_bytes_s - k.apply_payload_s, 0.0)
    tail_share = 1.0
    if d.shared_cpus:
        cpus = d.shared_cpus
        shared = p * overlap["construction"] + d.nodes / cpus * overlap["apply"] + relay_cpu
        stages["shared CPU"] = shared
        overlap["shared CPU"] = shared
        tail_share = max(1.0, d.nodes / cpus)
    bound = max(overlap, key=lambda s: overlap[s])
    return Breakdown(
        v_payload_bytes=v,
        cross_bytes=cross_bytes,
        payloads=n_p * p,
        tree_depth=depth if d.transport == "zmq" else 1,
        stages=stages,
        bound=bound,
        startup_s=k.startup_fixed_s + first / k.construction_bytes_s,
        stream_s=max(overlap.values()),
        drain_s=k.drain_fixed_s + drain_move + tail_share * last / g_drain,
        finalization_s=k.finalization_fixed_s + k.finalization_s_per_byte * h / p,
        reference_s=reference,
        reference_cross_bytes=reference_bytes,
        notes=notes,
        hop_bound=hop_bound,
    )
